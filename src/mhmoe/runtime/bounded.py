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
  (``trainer_state.pt``, a DCP item), its pickle is walked once, opcode by opcode, with a shadow stack
  of nesting depths: containers nested deeper than :data:`MAX_PICKLE_DEPTH` are refused. (torch's
  allow-list unpickler builds tuples of any depth, and hashing one used as a dict key recurses in C
  until the interpreter crashes.)

Errors are :class:`BoundedLoadError` (a ``ValueError``: exit status 2 in the CLI) with a message of at
most :data:`mhmoe.errors.MAX_CHARS` characters that names the file; no value from the file is embedded
beyond a short, cut excerpt.
"""

from __future__ import annotations

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
MAX_PICKLE_BYTES = 256 << 20  # the pickle of a torch.save archive (its tensors are separate records)

_Base: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser where libyaml is installed
_MERGE = "tag:yaml.org,2002:merge"


class BoundedLoadError(ValueError):
    """A YAML or JSON text over a limit, malformed, or (YAML) with a duplicated key."""


class _StrictLoader(_Base):  # type: ignore[misc, valid-type]
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


_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})


def pickle_depth(data: bytes, limit: int = MAX_PICKLE_DEPTH) -> int:
    """The container nesting depth a pickle builds, found without building anything: one linear pass
    over its opcodes (``pickletools.genops``) with a stack of depths in place of objects. ValueError
    past ``limit`` (or for a malformed pickle)."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    deepest = 0
    for op, arg, _ in pickletools.genops(data):
        name, before = op.name, op.stack_before
        if name == "MARK":
            marks.append(len(stack))
            continue
        if name in _MEMO_PUT:
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1] if stack else 0
            continue
        if name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, 0))
            continue
        if name == "DUP":
            stack.append(stack[-1] if stack else 0)
            continue
        popped: list[int] = []
        if pickletools.markobject in before:
            if not marks:
                raise ValueError("pickle: MARK missing")
            m = marks.pop()
            popped, stack = stack[m:], stack[:m]
            below = before.index(pickletools.markobject)
        else:
            below = len(before)
        under = [stack.pop() if stack else 0 for _ in range(below)][::-1]
        if not op.stack_after:
            continue
        if name in _IN_PLACE:  # the container below the items, grown in place
            container, items = (under[0] if under else 0), under[1:] + popped
            depth = max([container] + [1 + d for d in items])
        elif under or popped:
            depth = 1 + max(under + popped)
        else:
            depth = 1 if name.startswith("EMPTY_") else 0
        if depth > limit:
            raise ValueError(f"containers nested deeper than {limit} levels")
        deepest = max(deepest, depth)
        stack.extend([depth] * len(op.stack_after))
    return deepest


def check_torch_archive(stream: BinaryIO, where: str) -> None:
    """Refuse a ``torch.save`` archive whose pickle nests deeper than :data:`MAX_PICKLE_DEPTH` (or is
    not a zip archive with one ``data.pkl`` of at most :data:`MAX_PICKLE_BYTES`); ``stream`` is left at
    its start. BoundedLoadError naming ``where``."""
    try:
        with zipfile.ZipFile(stream) as z:
            names = [i for i in z.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(names) != 1:
                raise ValueError("not a torch.save archive (no single data.pkl)")
            if names[0].file_size > MAX_PICKLE_BYTES:
                raise ValueError(f"a pickle of {names[0].file_size:,} bytes, more than {MAX_PICKLE_BYTES:,}")
            pickle_depth(z.read(names[0]))
    except (ValueError, zipfile.BadZipFile, EOFError, KeyError, OSError, RecursionError) as exc:
        raise _refuse(where, f"refused ({one_line(exc, 160)})") from None
    finally:
        stream.seek(0)


def open_checked_torch_archive(path: Any, where: str | None = None) -> BinaryIO:
    """``path`` opened for ``torch.load`` after :func:`check_torch_archive` (the caller closes it)."""
    f = open(path, "rb")  # noqa: SIM115 -- returned open
    try:
        check_torch_archive(f, where or str(path))
    except BaseException:
        f.close()
        raise
    return f


__all__ = ["MAX_JSON_CHARS", "MAX_PICKLE_DEPTH", "MAX_YAML_CHARS", "MAX_YAML_DEPTH", "MAX_YAML_NODES",
           "BoundedLoadError", "check_torch_archive", "load_json", "load_yaml", "open_checked_torch_archive",
           "pickle_depth"]
