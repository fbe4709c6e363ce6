"""Reading untrusted YAML and JSON within limits, so that a few hundred bytes never cost gigabytes or
hours, and a refusal is one line naming the file.

Configs, checkpoints, run directories and data files may come from strangers. The standard loaders
have unbounded corners: a YAML "billion laughs" (anchors and aliases nested ten deep) builds a
structure whose expansion is exponential in the file's size (every copy, ``repr`` or comparison then
pays for it), deep nesting makes YAML's and JSON's recursive builders exhaust the stack, and a
duplicated YAML key silently drops the first value. Every YAML and JSON file mhmoe reads from a
config, a run, checkpoint or export directory, a ``.lock`` or a ``.jsonl`` data file goes through here:

* :func:`load_yaml`: at most :data:`MAX_YAML_CHARS` characters; before anything is built, one pass over
  the parser's events (non-recursive) refuses nesting deeper than :data:`MAX_YAML_DEPTH`, more than
  :data:`MAX_YAML_NODES` nodes with every alias expanded, and an alias of a collection that is still
  open (a recursive structure); then ``yaml.SafeLoader`` (no tags beyond plain data) with duplicate keys
  refused. Time and memory are linear in the text.
* :func:`load_json`: at most ``max_chars`` characters; nesting deeper than the interpreter allows
  (``json``'s C decoder stops at the recursion limit, about 1000 levels) is refused instead of escaping
  as a ``RecursionError``.
* :func:`check_torch_archive`: before ``torch.load(weights_only=True)`` reads a ``torch.save`` archive
  (``trainer_state.pt``, a DCP item), every record must be stored uncompressed within the archive (so
  what is loaded never exceeds the file), and its pickle is walked once, opcode by opcode
  (:func:`scan_pickle`: a table-driven pass with a shadow stack of nesting depths and an estimate of the
  objects built): containers nested deeper than :data:`MAX_PICKLE_DEPTH` or more than
  :data:`MAX_PICKLE_COST_FACTOR` bytes of objects per byte of pickle are refused. (torch's allow-list
  unpickler builds tuples of any depth, and hashing one used as a dict key recurses in C until the
  interpreter crashes; a stack of empty containers costs 80 to 230 bytes per byte.)

Errors are :class:`BoundedLoadError` (a ``ValueError``: exit status 2 in the CLI) with a message of at
most :data:`mhmoe.errors.MAX_CHARS` characters that names the file; no value from the file is embedded
beyond a short, cut excerpt.
"""

from __future__ import annotations

import array
import json
import pickletools
import zipfile
from typing import Any, BinaryIO

import yaml

from mhmoe.errors import one_line

MAX_YAML_CHARS = 1 << 20  # a run config is ~3 KB
MAX_YAML_DEPTH = 32  # run configs nest 3 deep (model.moe.top_k)
MAX_YAML_NODES = 100_000  # scalars + collections, aliases expanded
MAX_JSON_CHARS = 64 << 20  # meta.json of a checkpoint with many files, an HF config.json, a tokenizer's meta
MAX_PICKLE_DEPTH = 64  # nesting of a torch.save pickle (a trainer state or an optimizer state nests ~6 deep)
MAX_PICKLE_BYTES = 32 << 20  # the pickle of a torch.save archive (its tensors are separate records): a trainer
# state's is ~220 bytes per parameter tensor (AdamW), 448 KB for 2,000 tensors
#: bytes of Python objects (scan_pickle's estimate) a pickle may build per byte of it: real trainer states
#: and DCP metadata build 24 to 35 (a stack of empty sets: 232, of dicts: 80, of memo entries: 104)
MAX_PICKLE_COST_FACTOR = 64

_Base: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser where libyaml is installed
_MERGE = "tag:yaml.org,2002:merge"


class BoundedLoadError(ValueError):
    """A YAML or JSON text over a limit, malformed, or (YAML) with a duplicated key."""


class _StrictLoader(_Base):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (merge keys ``<<`` excepted)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE:
                key = (key_node.tag, key_node.value)
                if key in seen:
                    line = key_node.start_mark.line + 1 if key_node.start_mark else "?"
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {one_line(repr(key_node.value), 80)} (line {line})", None)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _refuse(where: str, what: str) -> BoundedLoadError:
    return BoundedLoadError(one_line(f"{where}: {what}"))


def check_yaml_events(text: str, where: str) -> None:
    """One linear pass over the parser's events: depth, expanded node count, recursive aliases."""
    depth, expanded = 0, 0
    sizes: dict[str, int] = {}  # anchor -> nodes it stands for, expanded
    stack: list[list[Any]] = [[0, None]]  # open collections: [nodes so far, anchor]
    for ev in yaml.parse(text, Loader=_Base):
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise _refuse(where, f"YAML nested deeper than {MAX_YAML_DEPTH} levels")
            stack.append([1, ev.anchor])
            n = 1
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            count, anchor = stack.pop()
            depth -= 1
            if anchor is not None:
                sizes[anchor] = count
            stack[-1][0] += count
            continue
        elif isinstance(ev, yaml.ScalarEvent):
            n = 1
            if ev.anchor is not None:
                sizes[ev.anchor] = 1
            stack[-1][0] += 1
        elif isinstance(ev, yaml.AliasEvent):
            if ev.anchor not in sizes:
                if any(anchor == ev.anchor for _, anchor in stack):
                    raise _refuse(where, "YAML alias inside its own anchor (a recursive structure)")
                continue  # an unknown alias: the loader reports it
            n = sizes[ev.anchor]
            stack[-1][0] += n
        else:
            continue
        expanded += n
        if expanded > MAX_YAML_NODES:
            raise _refuse(where, f"YAML with more than {MAX_YAML_NODES:,} values once its aliases are expanded "
                                 "(an alias bomb?)")


def load_yaml(text: str, where: str = "YAML") -> Any:
    """``text`` as plain data (``yaml.safe_load``), within the limits of this module; BoundedLoadError
    naming ``where`` otherwise (also for malformed YAML and duplicated keys)."""
    if len(text) > MAX_YAML_CHARS:
        raise _refuse(where, f"{len(text):,} characters of YAML, more than the {MAX_YAML_CHARS:,} allowed")
    try:
        check_yaml_events(text, where)
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise _refuse(where, f"invalid YAML ({exc.__class__.__name__}: {' '.join(str(exc).split())})") from None
    except RecursionError:  # not reached within MAX_YAML_DEPTH; kept so nothing escapes as a traceback
        raise _refuse(where, "YAML nested too deeply") from None


def load_json(text: str | bytes, where: str = "JSON", max_chars: int = MAX_JSON_CHARS) -> Any:
    """``json.loads(text)`` within ``max_chars`` characters and the interpreter's nesting limit;
    BoundedLoadError naming ``where`` otherwise (also for malformed JSON)."""
    if len(text) > max_chars:
        raise _refuse(where, f"{len(text):,} bytes of JSON, more than the {max_chars:,} allowed")
    try:
        return json.loads(text)
    except RecursionError:
        raise _refuse(where, "JSON nested too deeply (more levels than the interpreter's recursion limit)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _refuse(where, f"invalid JSON ({exc.__class__.__name__}: {one_line(exc, 120)})") from None


# ---- torch.save pickles, walked before torch.load: nesting, memory and time linear in the file -------------
# One entry per opcode byte: how its argument is laid out, what it does to the stack and what building it
# costs. Costs are bytes of Python objects an unpickler allocates (8 per stack slot, object sizes of
# CPython 3.11, a memo entry ~104; measured with tracemalloc against pickle._Unpickler: within 0.7x to
# 2x of what it allocates), the estimate the limit MAX_PICKLE_COST_FACTOR is set against.
_FIXED, _LINE, _LINES2, _LEN1, _LEN4, _LEN8 = range(6)
_PUSH, _MARK, _PUT, _MEMOIZE, _GET, _DUP, _INPLACE, _GENERIC, _PROTO, _STOP = range(10)
_OBJECT_COST = {"EMPTY_LIST": 64, "EMPTY_DICT": 72, "EMPTY_SET": 224, "LIST": 64, "DICT": 72, "TUPLE": 64,
                "FROZENSET": 224, "BININT": 36, "BININT2": 36, "INT": 36, "LONG": 36, "LONG1": 36, "LONG4": 36,
                "BINFLOAT": 32, "FLOAT": 32, "REDUCE": 128, "NEWOBJ": 128, "NEWOBJ_EX": 128, "INST": 128,
                "OBJ": 128, "BINPERSID": 128, "PERSID": 128, "TUPLE1": 48, "TUPLE2": 56, "TUPLE3": 64}
_ITEM_COST = {"APPEND": 8, "APPENDS": 8, "SETITEM": 25, "SETITEMS": 25, "ADDITEMS": 64, "BUILD": 25,
              "LIST": 8, "TUPLE": 8, "DICT": 25, "FROZENSET": 64}  # per item (dicts: per key and per value)
_MEMO_COST = 104  # an entry of the unpickler's memo dict, with its key


def _opcode_table() -> list[tuple | None]:
    table: list[tuple | None] = [None] * 256
    for op in pickletools.opcodes:
        arg, name, before = op.arg, op.name, op.stack_before
        if arg is None:
            layout, n = _FIXED, 0
        elif arg.n >= 0:
            layout, n = _FIXED, arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            layout, n = (_LINES2 if name in ("GLOBAL", "INST") else _LINE), 0
        else:
            layout, n = {pickletools.TAKEN_FROM_ARGUMENT1: _LEN1, pickletools.TAKEN_FROM_ARGUMENT4: _LEN4,
                         pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4, pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8}[arg.n], 0
        mark = pickletools.markobject in before
        below = before.index(pickletools.markobject) if mark else len(before)
        kind = {"MARK": _MARK, "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _MEMOIZE, "GET": _GET,
                "BINGET": _GET, "LONG_BINGET": _GET, "DUP": _DUP, "PROTO": _PROTO, "FRAME": _PROTO,
                "STOP": _STOP}.get(name)
        if kind is None:
            kind = _INPLACE if name in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD") else (
                _PUSH if not before and len(op.stack_after) == 1 else _GENERIC)
        depth0 = 1 if name.startswith("EMPTY_") else 0
        signed = name in ("BINSTRING", "LONG4")
        table[op.code.encode("latin-1")[0]] = (layout, n, kind, below, mark, len(op.stack_after),
                                               8 + _OBJECT_COST.get(name, 0), _ITEM_COST.get(name, 0), depth0,
                                               signed, name)
    return table


_TABLE = _opcode_table()
# fast paths of the walk (most opcodes of real pickles): a push with a fixed-size argument, a memo put or
# get with a binary index, MEMOIZE, MARK, POP, and a one-argument constructor (TUPLE1, BINPERSID)
_F_PUSH, _F_PUT, _F_GET, _F_MEMOIZE, _F_MARK, _F_POP, _F_UNARY, _F_OTHER = range(8)
_FAST: list[int | None] = [None] * 256
_SIZE, _BASE, _DEPTH0 = [0] * 256, [0] * 256, [0] * 256
for _code, _e in enumerate(_TABLE):
    if _e is None:
        continue
    _layout, _SIZE[_code], _kind, _below, _mark, _after, _BASE[_code], _, _DEPTH0[_code], _, _name = _e
    _FAST[_code] = (_F_PUSH if _layout == _FIXED and _kind == _PUSH else _F_PUT if _layout == _FIXED and _kind == _PUT
                    else _F_GET if _layout == _FIXED and _kind == _GET else _F_MEMOIZE if _kind == _MEMOIZE
                    else _F_MARK if _kind == _MARK else _F_POP if _name == "POP"
                    else _F_UNARY if _layout == _FIXED and _kind == _GENERIC and not _mark and _after == _below == 1
                    else _F_OTHER)


def _memo_key(arg: bytes) -> int:
    """A text memo index (PUT / GET of protocol 0) as the unpickler reads it; at most 10 digits (so no
    two keys share a hash)."""
    text = arg.strip()
    if not text.isdigit() or len(text) > 10:
        raise ValueError(f"memo index {text[:20]!r}")
    return int(text)


class _Memo:
    """The nesting depth of every memo entry of a pickle: a byte per index below 2**24 (most pickles
    number their entries from 0), a dict above; ``count``: the entries put (the next MEMOIZE index)."""

    DENSE = 1 << 24

    def __init__(self) -> None:
        self.dense, self.count = bytearray(), 0
        self.sparse: dict[int, int] = {}

    def put(self, key: int, depth: int) -> None:
        if key < self.DENSE:
            if key >= len(self.dense):
                self.dense.extend(bytes(key + 1 - len(self.dense)))
            self.count += not self.dense[key]
            self.dense[key] = depth + 1
        else:
            self.count += key not in self.sparse
            self.sparse[key] = depth

    def get(self, key: int) -> int:
        if key < len(self.dense) and self.dense[key]:
            return self.dense[key] - 1
        if key in self.sparse:
            return self.sparse[key]
        raise ValueError(f"memo get of index {key}, never put")


def _over_cost(limit: int, n: int) -> ValueError:
    return ValueError(f"builds more than {limit:,} bytes of objects from {n:,} bytes of pickle (a memory bomb?)")


def scan_pickle(data: bytes, max_depth: int = MAX_PICKLE_DEPTH, max_cost: int | None = None) -> tuple[int, int]:
    """``(depth, cost)`` of what a pickle builds, found without building anything: one linear pass over
    its opcodes with a stack of nesting depths in place of objects. ``depth``: the deepest container
    nesting; ``cost``: an estimate of the bytes of Python objects an unpickler allocates for it (stack
    slots, containers and their entries, memo entries, strings). ValueError as soon as the depth passes
    ``max_depth`` or the cost ``max_cost`` (default: :data:`MAX_PICKLE_COST_FACTOR` x its size + 1 MiB),
    or for a malformed pickle. About 0.15 us of CPU per one-byte opcode on an Intel Xeon (the
    ``pickletools.genops`` walk it replaces: 1 us).

    One loop on purpose (a call per opcode would double its time): the fast paths first, then the
    general case from :data:`_TABLE`."""
    limit = MAX_PICKLE_COST_FACTOR * len(data) + (1 << 20) if max_cost is None else max_cost
    max_depth = min(max_depth, 254)
    fast, sizes, bases, depth0s = _FAST, _SIZE, _BASE, _DEPTH0
    n, i = len(data), 0
    # the walk's own memory stays near the file's size: a byte per stack slot (depths <= max_depth < 255), a
    # byte per memo index below 2**24 (depth + 1; 0 = never put), 8 bytes per open mark
    stack = bytearray()
    marks = array.array("q")
    memo = _Memo()
    push = stack.append
    deepest = cost = 0
    while i < n:
        code = data[i]
        path = fast[code]
        i += 1
        if path == _F_PUSH:
            i += sizes[code]
            depth = depth0s[code]
            push(depth)
            cost += bases[code] + sizes[code]
            if depth > deepest:
                deepest = depth
            if cost > limit:
                raise _over_cost(limit, n)
            continue
        if path == _F_PUT or path == _F_MEMOIZE:
            if not stack:
                raise ValueError("memo put on an empty stack")
            key = memo.count if path == _F_MEMOIZE else int.from_bytes(data[i:i + sizes[code]], "little")
            i += sizes[code]
            memo.put(key, stack[-1])
            cost += _MEMO_COST
            if cost > limit:
                raise _over_cost(limit, n)
            continue
        if path == _F_GET:
            key = int.from_bytes(data[i:i + sizes[code]], "little")
            i += sizes[code]
            push(memo.get(key))
            cost += 8
            if cost > limit:
                raise _over_cost(limit, n)
            continue
        if path == _F_POP:
            if not stack:
                raise ValueError("POP on an empty stack")
            stack.pop()
            continue
        if path == _F_MARK:  # the unpickler keeps a new stack per mark
            marks.append(len(stack))
            cost += 72
            if cost > limit:
                raise _over_cost(limit, n)
            continue
        if path == _F_UNARY:
            if not stack:
                raise ValueError(f"opcode 0x{code:02x} on an empty stack")
            depth = stack[-1] + 1
            if depth > max_depth:
                raise ValueError(f"containers nested deeper than {max_depth} levels")
            stack[-1] = depth
            if depth > deepest:
                deepest = depth
            cost += bases[code]
            if cost > limit:
                raise _over_cost(limit, n)
            continue
        if path is None:
            raise ValueError(f"unknown pickle opcode 0x{code:02x} at byte {i - 1}")
        layout, size, kind, below, mark, after, base, per_item, depth0, signed, name = _TABLE[code]  # type: ignore[misc]
        start = i
        if layout == _FIXED:
            i += size
        elif layout == _LEN1:
            if i >= n:
                break
            length = data[i]
            start = i = i + 1
            i += length
        elif layout == _LINE or layout == _LINES2:
            i = data.find(b"\n", i) + 1
            if layout == _LINES2 and i:
                i = data.find(b"\n", i) + 1
            if not i:
                raise ValueError(f"{name}: no end of line")
        else:
            width = 4 if layout == _LEN4 else 8
            length = int.from_bytes(data[i:i + width], "little", signed=signed)
            if length < 0:
                raise ValueError(f"{name}: negative length")
            start = i = i + width
            i += length
        if i > n:
            break
        if kind == _PUSH:
            push(depth0)
            cost += base + (i - start)
            if depth0 > deepest:
                deepest = depth0
        elif kind == _PUT or kind == _GET:  # a text index (protocol 0)
            key = _memo_key(data[start:i])
            if kind == _GET:
                push(memo.get(key))
                cost += 8
            else:
                if not stack:
                    raise ValueError(f"{name} on an empty stack")
                memo.put(key, stack[-1])
                cost += _MEMO_COST
        elif kind == _DUP:
            if not stack:
                raise ValueError("DUP on an empty stack")
            push(stack[-1])
            cost += 8
        elif kind != _PROTO:
            if mark:
                if not marks:
                    raise ValueError(f"{name} without MARK")
                m = marks.pop()
                items = stack[m:]
                del stack[m:]
            else:
                items = bytearray()
            if len(stack) < below:
                raise ValueError(f"{name} on a stack of {len(stack)}")
            if below:
                items = stack[-below:] + items
                del stack[-below:]
            if kind == _STOP:
                return deepest, cost
            if not after:  # POP_MARK
                continue
            if kind == _INPLACE:  # the container below the items, grown in place
                depth = max(items[0], 1 + max(items[1:], default=-1))
                cost += per_item * (len(items) - 1)
            else:
                depth = 1 + max(items) if items else depth0
                cost += base + per_item * len(items)
            if depth > max_depth:
                raise ValueError(f"containers nested deeper than {max_depth} levels")
            if depth > deepest:
                deepest = depth
            push(depth)
        if cost > limit:
            raise _over_cost(limit, n)
    raise ValueError("truncated pickle (no STOP)")


def pickle_depth(data: bytes, limit: int = MAX_PICKLE_DEPTH) -> int:
    """The container nesting depth a pickle builds (:func:`scan_pickle`); ValueError past ``limit``."""
    return scan_pickle(data, limit)[0]


def check_torch_archive(stream: BinaryIO, where: str) -> None:
    """Refuse a ``torch.save`` archive that could cost more than its size: a record that is compressed
    (``torch.save`` stores every record as is, so a record's bytes in memory never exceed the file; a
    deflated one may inflate 1000x), records that claim more bytes than the archive holds, no single
    ``data.pkl``, a pickle over :data:`MAX_PICKLE_BYTES`, or one whose walk (:func:`scan_pickle`, before
    anything is built) finds containers nested deeper than :data:`MAX_PICKLE_DEPTH` or more objects
    than :data:`MAX_PICKLE_COST_FACTOR` x its size. ``stream`` is left at its start. BoundedLoadError
    naming ``where``."""
    try:
        size = stream.seek(0, 2)
        stream.seek(0)
        with zipfile.ZipFile(stream) as z:
            infos = z.infolist()
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                    raise ValueError(f"record {info.filename[:80]!r} is compressed (torch.save stores records "
                                     "uncompressed)")
                if info.header_offset + info.file_size > size:
                    raise ValueError(f"record {info.filename[:80]!r} lies beyond the end of the archive")
            if sum(i.file_size for i in infos) > size:
                raise ValueError(f"records of {sum(i.file_size for i in infos):,} bytes in an archive of {size:,} "
                                 "(records that share bytes)")
            names = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(names) != 1:
                raise ValueError("not a torch.save archive (no single data.pkl)")
            if names[0].file_size > MAX_PICKLE_BYTES:
                raise ValueError(f"a pickle of {names[0].file_size:,} bytes, more than {MAX_PICKLE_BYTES:,}")
            scan_pickle(z.read(names[0]))
    except (ValueError, zipfile.BadZipFile, EOFError, KeyError, OSError, RecursionError, IndexError) as exc:
        raise _refuse(where, f"refused ({one_line(exc, 160)})") from None
    finally:
        stream.seek(0)


__all__ = ["MAX_JSON_CHARS", "MAX_PICKLE_BYTES", "MAX_PICKLE_COST_FACTOR", "MAX_PICKLE_DEPTH", "MAX_YAML_CHARS",
           "MAX_YAML_DEPTH", "MAX_YAML_NODES", "BoundedLoadError", "check_torch_archive", "load_json", "load_yaml",
           "pickle_depth", "scan_pickle"]
