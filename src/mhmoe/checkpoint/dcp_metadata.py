"""The restricted reader of DCP ``.metadata`` files: ``torch.distributed.checkpoint`` (DCP) checkpoints
are read without executing anything they contain (items: :mod:`mhmoe.checkpoint.dcp_reader`).

A DCP checkpoint directory holds ``.metadata`` (a pickle of
:class:`~torch.distributed.checkpoint.metadata.Metadata`) and ``__<rank>_<n>.distcp`` files with one
``torch.save`` archive per item. Torch's :class:`~torch.distributed.checkpoint.FileSystemReader`
unpickles ``.metadata`` with :func:`pickle.load` and its ``DefaultLoadPlanner`` loads non-tensor
("bytes") items with ``torch.load(weights_only=False)``: either runs arbitrary code from a crafted
checkpoint. Checkpoints are downloaded and shared, so mhmoe reads DCP checkpoints only through this
module, in which nothing from a checkpoint is unpickled except by the two restricted unpicklers below.

Approach, and why: a **restricted reader of the existing format**, not a new format. Every DCP
checkpoint already written (by mhmoe or by plain ``dcp.save``) stays loadable, ``dcp.load``'s
resharding planner keeps working for the multi-process resume, and the writer stays torch's own. A
code-free format (say safetensors shards + JSON index) would need our own sharded writer and
resharding loader and would still leave the old checkpoints to read safely. The DCP ``.metadata``
vocabulary is small and fixed, which makes an allow-list practical:

* ``.metadata`` is read by :class:`_MetadataUnpickler`, a subclass of the pure-Python unpickler whose
  ``find_class`` admits only the names in :data:`ALLOWED_GLOBALS` (the DCP metadata dataclasses,
  ``torch.Size``, torch dtypes / layouts / memory formats and path names) and refuses everything
  else; object-building opcodes are restricted too: ``REDUCE`` may call only ``torch.Size``, the
  memory-format enum, the layout look-up and pure paths; ``NEWOBJ`` and ``BUILD`` apply only to
  instances of the metadata dataclasses (never to a class, so no attribute of a class can be set);
  ``INST`` / ``OBJ`` (protocols 0-1 object creation) are refused; list and dict opcodes apply only to
  real lists and dicts, and sets (which DCP metadata never holds) are refused. Cost: the file is walked
  once before anything is built (:func:`mhmoe.runtime.bounded.scan_pickle`: nesting, and at most
  ``MAX_PICKLE_COST_FACTOR`` bytes of objects per byte), dict keys must be strings or ``MetadataIndex``
  and at most :data:`MAX_SAME_HASH` of them may share a hash (integer keys ``k * (2**61 - 1)`` all
  collide in CPython), so time and memory stay linear in the file. The result is then type-checked field by field
  (:func:`check_metadata`), including every item's file name (a bare name inside the directory) and
  byte range.
* Items are loaded with ``torch.load(..., weights_only=True)`` (torch's own allow-list unpickler:
  tensors and plain containers / numbers / strings) from a window of exactly the recorded bytes.
  Bytes items (optimizer hyper-parameters such as ``betas``) are decoded that way too and handed to
  the planner re-serialised from the decoded plain values, so even torch's ``DefaultLoadPlanner``
  (which unpickles them with ``weights_only=False``) only ever sees bytes that we produced. Stream
  transforms (compression extensions), which mhmoe never writes, are refused.

Everything refused raises :class:`mhmoe.errors.CheckpointError` with a one-line message. These modules
import nothing from mhmoe but :mod:`mhmoe.errors` and :mod:`mhmoe.runtime`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from mhmoe.errors import MAX_CHARS, CheckpointError, bounded_repr, one_line
from mhmoe.runtime.bounded import MAX_PICKLE_DEPTH, BoundedLoadError, scan_pickle
from mhmoe.runtime.reading import read_bytes

__all__ = ["ALLOWED_GLOBALS", "check_file_name", "check_metadata", "read_metadata"]

METADATA_FILE = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"

# ---- limits: memory and time within a small multiple of the file's size ---------------------------------------
MAX_METADATA_BYTES = 32 << 20  # ~185 bytes per tensor chunk: 2,000 tensors take 0.4 MB
MAX_SAME_HASH = 8  # keys of one dict with the same hash (a real metadata has none: str keys, distinct indices)
MAX_HASH_DEPTH = 16  # nesting of tuples / frozensets / metadata objects (what hashing a dict key walks)
MAX_DIMS = 64  # elements of a torch.Size
MAX_PATH_PARTS, MAX_PATH_CHARS = 64, 4096  # a checkpoint_id path
MAX_ARGS = 8  # arguments of NEWOBJ / NEWOBJ_EX (the dataclasses take none)
MAX_STATE = 32  # entries of a BUILD state (the dataclasses have at most 6 fields)
MAX_KEY_PATH = 64  # parts of a planner_data key path (the nesting of a state dict)

# the dataclasses of a DCP Metadata pickle: the only types created with NEWOBJ and filled in with BUILD
_DATACLASSES: tuple[type, ...] = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                                  TensorProperties, MetadataIndex, StorageMeta, _StorageInfo)
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout`` (how a torch.layout pickles): a fixed table."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


# (module, name) -> the object the unpickler gets for it. Everything else is refused.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_MD, c.__name__): c for c in _DATACLASSES if c is not _StorageInfo},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    (_MD, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    **{("torch", k): v for k, v in vars(torch).items() if isinstance(v, (torch.dtype, torch.memory_format))},
    # StorageMeta.checkpoint_id is the writer's path: read as a pure path (no file system access)
    **{(m, n): pure for m in ("pathlib", "pathlib._local")
       for n, pure in (("PosixPath", PurePosixPath), ("PurePosixPath", PurePosixPath),
                       ("WindowsPath", PureWindowsPath), ("PureWindowsPath", PureWindowsPath))},
}
# what REDUCE (call a global with arguments) may call: value constructors only (compared by identity)
_FACTORY_IDS = frozenset(map(id, (torch.Size, _MEM_FORMAT_ENCODING, _layout, PurePosixPath, PureWindowsPath)))
_DATACLASS_IDS = frozenset(map(id, _DATACLASSES))
_FIELDS = {c: frozenset(f.name for f in dataclasses.fields(c)) for c in _DATACLASSES}


def _factory_args_ok(func: Any, args: Any) -> bool:
    """The arguments of a REDUCE are what the value's own pickling produces, within the limits: a
    torch.Size of at most MAX_DIMS int64 values, a path of at most MAX_PATH_PARTS strings and
    MAX_PATH_CHARS characters, one short name or number for a layout or memory format. (A memoised
    argument may be reused any number of times at no cost in file size: each use must stay small.)"""
    if type(args) is not tuple:
        return False
    if func is torch.Size:
        dims: Any = args[0] if len(args) == 1 else None
        return (type(dims) in (tuple, list) and len(dims) <= MAX_DIMS
                and all(type(x) is int and -(2**63) <= x < 2**63 for x in dims))
    if func in (PurePosixPath, PureWindowsPath):
        return (len(args) <= MAX_PATH_PARTS and all(type(a) is str for a in args)
                and sum(map(len, args)) <= MAX_PATH_CHARS)
    return len(args) == 1 and type(args[0]) in (int, str) and len(str(args[0])[:65]) <= 64


#: the pure-Python unpickler's opcode methods and stacks (not in its typeshed stub)
_PyUnpickler: Any = pickle._Unpickler


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be restricted
    """Unpickles a DCP ``Metadata`` and nothing else (see the module docstring)."""

    dispatch = dict(_PyUnpickler.dispatch)
    stack: list[Any]
    metastack: list[list[Any]]

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        # nesting of every tuple, frozenset and dataclass instance built, kept alive so that ids stay unique:
        # hashing walks these (a dict key, a set item), without a recursion check in C
        self._depth: dict[int, int] = {}
        self._keep: list[Any] = []
        self._hashes: dict[int, dict[int, int]] = {}  # id of a dict being filled -> {key hash: keys}

    def depth(self, obj: Any) -> int:
        return self._depth.get(id(obj), 0)

    def _track(self, obj: Any, children: Any) -> None:
        d = 1 + max((self.depth(c) for c in children), default=0)
        if d > MAX_HASH_DEPTH:
            self._over(f"nesting deeper than {MAX_HASH_DEPTH} levels")
        self._depth[id(obj)] = max(d, self.depth(obj))
        self._keep.append(obj)

    def _hashable(self, items: Any, what: str) -> None:  # before they are hashed
        for k in items:
            if self.depth(k) >= MAX_HASH_DEPTH:
                self._over(f"{what} nested deeper than {MAX_HASH_DEPTH} levels")

    def _keys(self, target: dict, keys: Any) -> None:
        """Before ``keys`` go into the dict ``target``: each a string or a MetadataIndex (what DCP
        metadata keys are; ints hash to themselves, so ``k * (2**61 - 1)`` all collide), and at most
        :data:`MAX_SAME_HASH` of one hash in one dict (a MetadataIndex hashes its offsets: crafted ones
        can collide), so filling a dict costs linear time, never quadratic."""
        counts = self._hashes.get(id(target))
        if counts is None:
            counts = self._hashes[id(target)] = {}
            self._keep.append(target)  # its id stays unique while counted
        for k in keys:
            if type(k) is not str and type(k) is not MetadataIndex:
                self._over(f"a dict key of type {type(k).__name__} (DCP metadata keys are strings and MetadataIndex)")
            h = hash(k)
            n = counts.get(h, 0) + 1
            if n > MAX_SAME_HASH:
                self._over(f"more than {MAX_SAME_HASH} dict keys with one hash (colliding keys)")
            counts[h] = n

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise pickle.UnpicklingError(f"refused global {str(module)[:80]}.{str(name)[:80]} (not a DCP metadata "
                                         "class)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id")

    def _refuse(self, what: str) -> None:
        raise pickle.UnpicklingError(f"refused pickle opcode {what}")

    def _over(self, what: str) -> None:
        raise pickle.UnpicklingError(f"refused: {what}")

    def _load_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if id(func) not in _FACTORY_IDS:
            self._refuse(f"REDUCE on {type(func).__name__}")
        if not _factory_args_ok(func, args):
            self._over(f"{getattr(func, '__name__', 'a factory')} with arguments beyond the limits (at most "
                       f"{MAX_DIMS} sizes, {MAX_PATH_PARTS} path parts of {MAX_PATH_CHARS} characters)")
        _PyUnpickler.load_reduce(self)

    def _load_newobj(self) -> None:
        if id(self.stack[-2]) not in _DATACLASS_IDS:
            self._refuse("NEWOBJ on a non-metadata class")
        if type(self.stack[-1]) is not tuple or len(self.stack[-1]) > MAX_ARGS:
            self._over(f"NEWOBJ with more than {MAX_ARGS} arguments")
        _PyUnpickler.load_newobj(self)

    def _load_newobj_ex(self) -> None:
        if id(self.stack[-3]) not in _DATACLASS_IDS:
            self._refuse("NEWOBJ_EX on a non-metadata class")
        args, kwargs = self.stack[-2], self.stack[-1]
        if type(args) is not tuple or type(kwargs) is not dict or len(args) > MAX_ARGS or len(kwargs) > MAX_ARGS:
            self._over(f"NEWOBJ_EX with more than {MAX_ARGS} arguments")
        _PyUnpickler.load_newobj_ex(self)

    def _load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        kind = type(inst)
        if id(kind) not in _DATACLASS_IDS:  # an instance of one (a class is of type `type`)
            self._refuse(f"BUILD on {kind.__name__}")
        if kind is TensorProperties:  # its own __setstate__ takes a 5-tuple
            ok = type(state) is tuple and len(state) == 5
        else:  # field values only: no slot state, no dunder names (an instance __setstate__ would be called);
            # names of fields a newer torch may have added are accepted
            ok = type(state) is dict and (state.keys() <= _FIELDS[kind] or all(
                type(k) is str and not k.startswith("__") for k in state))
        if not ok or len(state) > MAX_STATE:
            self._refuse(f"BUILD of {type(inst).__name__} with a {type(state).__name__} state")
        _PyUnpickler.load_build(self)
        self._track(inst, state if type(state) is tuple else state.values())

    def _require(self, obj: Any, kind: type, what: str) -> None:
        if type(obj) is not kind:
            self._refuse(f"{what} on {type(obj).__name__}")

    def _marked(self) -> Any:  # the object below the MARK (what APPENDS / SETITEMS / ADDITEMS fill)
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    def _load_append(self) -> None:
        self._require(self.stack[-2], list, "APPEND")
        _PyUnpickler.load_append(self)

    def _load_appends(self) -> None:
        self._require(self._marked(), list, "APPENDS")
        _PyUnpickler.load_appends(self)

    def _load_setitem(self) -> None:
        self._require(self.stack[-3], dict, "SETITEM")
        self._hashable(self.stack[-2:-1], "a dict key")
        self._keys(self.stack[-3], self.stack[-2:-1])
        _PyUnpickler.load_setitem(self)

    def _load_setitems(self) -> None:
        self._require(self._marked(), dict, "SETITEMS")
        self._hashable(self.stack[::2], "a dict key")
        self._keys(self._marked(), self.stack[::2])
        _PyUnpickler.load_setitems(self)

    def _load_dict(self) -> None:
        self._hashable(self.stack[::2], "a dict key")
        self._keys({}, self.stack[::2])
        _PyUnpickler.load_dict(self)

    def _load_set(self) -> None:  # EMPTY_SET, ADDITEMS, FROZENSET: DCP metadata holds no sets
        self._over("a set (DCP metadata holds none)")

    def _tuple(self, load: Any) -> None:
        load(self)
        self._track(self.stack[-1], self.stack[-1])

    def _load_tuple(self) -> None:
        self._tuple(_PyUnpickler.load_tuple)

    def _load_tuple1(self) -> None:
        self._tuple(_PyUnpickler.load_tuple1)

    def _load_tuple2(self) -> None:
        self._tuple(_PyUnpickler.load_tuple2)

    def _load_tuple3(self) -> None:
        self._tuple(_PyUnpickler.load_tuple3)

    def _load_inst(self) -> None:
        self._refuse("INST")

    def _load_obj(self) -> None:
        self._refuse("OBJ")


for _op, _fn in ((pickle.REDUCE, "_load_reduce"), (pickle.NEWOBJ, "_load_newobj"),
                 (pickle.NEWOBJ_EX, "_load_newobj_ex"), (pickle.BUILD, "_load_build"),
                 (pickle.APPEND, "_load_append"), (pickle.APPENDS, "_load_appends"),
                 (pickle.SETITEM, "_load_setitem"), (pickle.SETITEMS, "_load_setitems"),
                 (pickle.ADDITEMS, "_load_set"), (pickle.EMPTY_SET, "_load_set"), (pickle.FROZENSET, "_load_set"),
                 (pickle.INST, "_load_inst"), (pickle.OBJ, "_load_obj"), (pickle.DICT, "_load_dict"),
                 (pickle.TUPLE, "_load_tuple"),
                 (pickle.TUPLE1, "_load_tuple1"), (pickle.TUPLE2, "_load_tuple2"), (pickle.TUPLE3, "_load_tuple3")):
    _MetadataUnpickler.dispatch[_op[0]] = getattr(_MetadataUnpickler, _fn)


# ---- checking the unpickled metadata ---------------------------------------------------------------------
def error(msg: str) -> CheckpointError:
    """A one-line CheckpointError of bounded length: names from the checkpoint may be long or hold
    newlines or control characters."""
    msg = msg[:2 * MAX_CHARS]
    return CheckpointError(one_line("".join(c if c.isprintable() else ascii(c)[1:-1] for c in msg), MAX_CHARS))


def fail(where: str, msg: str) -> CheckpointError:
    return error(f"{where}: refused DCP metadata ({msg})")


def is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _size(v: Any, what: str, where: str, ndim: int | None = None) -> tuple[int, ...]:
    if type(v) is not torch.Size or not all(is_count(x) for x in v) or (ndim is not None and len(v) != ndim):
        raise fail(where, f"{what} is not a torch.Size of {ndim if ndim is not None else 'n'} non-negative ints")
    return tuple(v)


def check_file_name(name: Any, where: str) -> str:
    """A data file name from the metadata: a bare file name (no directory part, no ``..``)."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or not name.isprintable() or PureWindowsPath(name).drive):
        raise fail(where, f"data file name {bounded_repr(name, 80)} is not a plain file name inside the checkpoint")
    return name


def check_metadata(md: Any, where: str = "DCP checkpoint") -> Metadata:
    """Type-check an unpickled DCP ``Metadata`` field by field; return it or raise CheckpointError.

    The work is linear in the file's size even when its objects are shared (a pickle may reference one
    list of chunks from every tensor at no cost): every chunk and bytes item needs a storage entry of its
    own, so the chunks checked are counted against ``len(storage_data)`` and the check stops beyond it;
    planner_data key paths have at most :data:`MAX_KEY_PATH` parts."""
    if type(md) is not Metadata:
        raise fail(where, f"a {type(md).__name__}, not a Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    storage_data = getattr(md, "storage_data", None)
    if type(sdm) is not dict:
        raise fail(where, "state_dict_metadata is not a dict")
    if type(storage_data) is not dict:
        raise fail(where, "storage_data is not a dict")
    budget = len(storage_data)  # one storage entry per chunk / bytes item
    for fqn, item in sdm.items():
        if type(fqn) is not str:
            raise fail(where, f"key {bounded_repr(fqn, 80)} is not a string")
        budget -= 1 if type(item) is BytesStorageMetadata else len(getattr(item, "chunks", None) or ())
        if budget < 0:
            raise fail(where, f"more chunks and items than its {len(storage_data):,} storage entries (shared "
                              "entries?)")
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata:
            raise fail(where, f"{fqn}: a {type(item).__name__}")
        props = getattr(item, "properties", None)
        if (type(props) is not TensorProperties or type(getattr(props, "dtype", None)) is not torch.dtype
                or type(getattr(props, "layout", torch.strided)) is not torch.layout):
            raise fail(where, f"{fqn}: bad tensor properties")
        size = _size(getattr(item, "size", None), f"{fqn} size", where)
        chunks = getattr(item, "chunks", None)
        if type(chunks) is not list:
            raise fail(where, f"{fqn}: chunks is not a list")
        for c in chunks:
            if type(c) is not ChunkStorageMetadata:
                raise fail(where, f"{fqn}: a chunk is a {type(c).__name__}")
            off = _size(getattr(c, "offsets", None), f"{fqn} chunk offsets", where, len(size))
            ext = _size(getattr(c, "sizes", None), f"{fqn} chunk sizes", where, len(size))
            if any(o + n > s for o, n, s in zip(off, ext, size, strict=True)):
                raise fail(where, f"{fqn}: a chunk lies outside the tensor")
    planner_data = getattr(md, "planner_data", None)
    if planner_data is not None:
        if type(planner_data) is not dict:
            raise fail(where, "planner_data is not a dict")
        for k, path in planner_data.items():
            if (type(k) is not str or type(path) not in (tuple, list) or not path or len(path) > MAX_KEY_PATH
                    or not all(type(p) is str or is_count(p) for p in path)):
                raise fail(where, f"planner_data entry {bounded_repr(k, 80)} is not a key path of at most "
                                  f"{MAX_KEY_PATH} parts")
    for idx, info in storage_data.items():
        if (type(idx) is not MetadataIndex or type(getattr(idx, "fqn", None)) is not str
                or not (idx.offset is None or type(idx.offset) is torch.Size)
                or not (idx.index is None or type(idx.index) is int)):
            raise fail(where, f"storage key {bounded_repr(idx, 80)} is not a MetadataIndex")
        if type(info) is not _StorageInfo:
            raise fail(where, f"{idx.fqn}: storage info is a {type(info).__name__}")
        check_file_name(getattr(info, "relative_path", None), where)
        if not (is_count(getattr(info, "offset", None)) and is_count(getattr(info, "length", None))):
            raise fail(where, f"{idx.fqn}: byte range is not two non-negative ints")
        if getattr(info, "transform_descriptors", None):
            raise fail(where, f"{idx.fqn}: stream transforms {bounded_repr(info.transform_descriptors, 80)} are not "
                              "supported")
    version = getattr(md, "version", None)
    if version is not None and type(version) is not str:
        raise fail(where, "version is not a string")
    sm = getattr(md, "storage_meta", None)
    if sm is not None and type(sm) is not StorageMeta:
        raise fail(where, f"storage_meta is a {type(sm).__name__}")
    return md


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """Unpickle a DCP ``.metadata`` file with the restricted unpickler and type-check it."""
    where = str(path)
    try:  # a regular file within the size limit (fstat), its pickle walked once before anything is built
        data = read_bytes(path, MAX_METADATA_BYTES, what="DCP .metadata")
        scan_pickle(data, MAX_PICKLE_DEPTH)  # memory: at most MAX_PICKLE_COST_FACTOR x the file's size
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except BoundedLoadError as exc:
        raise fail(where, one_line(str(exc).removeprefix(f"{where}: "))) from None
    except OSError as exc:
        raise error(f"{where}: unreadable DCP metadata ({exc.__class__.__name__}: {exc.strerror})") from None
    except (Exception, RecursionError) as exc:  # noqa: BLE001 -- UnpicklingError, whatever a malformed pickle raises
        raise fail(where, f"{exc.__class__.__name__}: {one_line(exc)}") from None
    try:
        return check_metadata(md, where)
    except (RecursionError, MemoryError) as exc:  # not expected within the limits; never a traceback
        raise fail(where, exc.__class__.__name__) from None
