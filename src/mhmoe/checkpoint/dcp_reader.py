"""Reading the items of a DCP checkpoint without executing anything in them: torch's
``FileSystemReader`` with the restricted ``.metadata`` reader of :mod:`mhmoe.checkpoint.dcp_metadata`
and every item loaded with ``torch.load(weights_only=True)`` from exactly its recorded bytes
(:class:`SafeFileSystemReader`, usable with ``dcp.load``), and the whole checkpoint gathered into full
tensors in one process, without a process group (:func:`read_dcp_full`, :func:`read_dcp`).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.futures import Future

from mhmoe.checkpoint.dcp_metadata import METADATA_FILE, check_file_name, check_metadata, error, fail, read_metadata
from mhmoe.checkpoint.layout import DCP_DIR
from mhmoe.errors import CheckpointError, one_line
from mhmoe.runtime.bounded import check_torch_archive

__all__ = ["DCP_DIR", "SafeFileSystemReader", "load_item", "read_dcp", "read_dcp_full"]


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable stream (no copy)."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


def load_item(stream: Any, where: str) -> Any:
    """One DCP item (a ``torch.save`` archive) with ``torch.load(weights_only=True)``: tensors and plain
    values only; anything else raises CheckpointError."""
    try:
        check_torch_archive(stream, where)  # nesting first (mhmoe.runtime.bounded)
        return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch raises UnpicklingError, RuntimeError, ...
        raise error(f"{where}: refused DCP item ({exc.__class__.__name__}: {one_line(exc)})") from None


class SafeFileSystemReader(FileSystemReader):
    """A :class:`~torch.distributed.checkpoint.FileSystemReader` that never unpickles arbitrary objects:
    ``dcp.load(state_dict, storage_reader=SafeFileSystemReader(path))``. See the module docstring."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{int(rank)}{METADATA_FILE}"
        md = read_metadata(Path(self.path) / name)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # not super(): its signature differs between torch versions, and read_data below is our own
        self.storage_data = check_metadata(metadata, str(self.path)).storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _data_file(self, name: str) -> Path:
        root = Path(self.path)
        check_file_name(name, str(root))
        f = root / name
        real = Path(os.path.realpath(f))
        if real.parent != Path(os.path.realpath(root)) or not real.is_file():
            raise error(f"{root}: refused DCP data file {name!r} (missing, or a link out of the directory)")
        return f

    def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
        per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]] = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if type(info) is not _StorageInfo:
                raise error(f"{self.path}: DCP metadata has no data for {req.storage_index.fqn!r}")
            per_file.setdefault(info.relative_path, []).append((req, info))
        for name, reqs in per_file.items():
            path = self._data_file(name)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                for req, info in reqs:
                    where = f"{path} [{req.storage_index.fqn}]"
                    if info.transform_descriptors:
                        raise error(f"{where}: refused DCP item (stream transforms are not supported)")
                    if info.offset + info.length > size:
                        raise error(f"{where}: DCP item lies beyond the end of the file (truncated?)")
                    value = load_item(_Window(f, info.offset, info.length), where)
                    if req.type == LoadItemType.BYTE_IO:
                        buf = io.BytesIO()  # plain values re-serialised by us: safe for any planner
                        torch.save(value, buf)
                        buf.seek(0)
                        planner.load_bytes(req, buf)
                        continue
                    if not isinstance(value, torch.Tensor):
                        raise error(f"{where}: refused DCP item (a {type(value).__name__}, not a tensor)")
                    try:
                        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                            value = value.narrow(dim, start, length)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != value.size():
                            raise ValueError(f"size {tuple(value.size())}, expected {tuple(target.size())}")
                        target.copy_(value)
                    except (RuntimeError, ValueError, IndexError) as exc:
                        raise error(f"{where}: DCP item does not fit ({one_line(exc)})") from None
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


# ---- whole checkpoint in one process -----------------------------------------------------------------------
class _Collect:
    """The planner side of :func:`read_dcp_full`: full tensors allocated up front, bytes items decoded."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.tensors, self.where = tensors, where
        self.values: dict[str, Any] = {}

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        t = self.tensors[req.dest_index.fqn]
        for dim, (start, length) in enumerate(zip(req.dest_offsets, req.lengths, strict=True)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        self.values[req.dest_index.fqn] = load_item(value, f"{self.where} [{req.dest_index.fqn}]")


def _unflatten(flat: dict[str, Any], mapping: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """DCP's flat ``{key: value}`` -> the saved nested state dict along ``planner_data`` key paths
    (as ``torch.distributed.checkpoint._traverse.set_element``; list indices are bounded)."""
    out: dict[str, Any] = {}
    limit = len(flat)
    slots = [2 * limit + 16]  # list slots all key paths may create together: linear in the items

    def child(container: Any, key: Any, default: Callable[[], Any]) -> Any:
        if isinstance(container, dict):
            return container.setdefault(key, default())
        if key >= limit:
            raise IndexError(f"list index {key}")
        slots[0] -= max(0, key + 1 - len(container))
        if slots[0] < 0:
            raise IndexError(f"list index {key}: more list slots than {2 * limit + 16} for {limit} items")
        container.extend([None] * (key + 1 - len(container)))
        if container[key] is None:
            container[key] = default()
        return container[key]

    try:
        for k, v in flat.items():
            path = (mapping or {}).get(k, (k,))
            cur: Any = out
            for key, nxt in zip(path, path[1:], strict=False):
                cur = child(cur, key, dict if type(nxt) is str else list)
            last = path[-1]
            if type(cur) is list:
                child(cur, last, lambda: None)
            elif type(cur) is not dict:
                raise TypeError(f"{k}: its parent is a {type(cur).__name__}")
            cur[last] = v
    except (TypeError, IndexError, KeyError, AttributeError, ValueError, RuntimeError) as exc:
        raise fail(where, f"inconsistent planner_data key paths ({exc.__class__.__name__}: {one_line(exc)})") from None
    return out


def _volume(shape: Iterable[int]) -> int:
    return math.prod(shape)


def _check_extents(reader: SafeFileSystemReader, md: Metadata, where: str) -> None:
    """Before allocating anything: every tensor chunk has an item of its own, within its file, holding at
    least the chunk's bytes, and no two items overlap. So the full tensors never need more memory than
    the data files' size, however the metadata aliases its entries."""
    sizes: dict[str, int] = {}
    used: set[int] = set()  # ids of the storage entries taken
    ranges: dict[str, list[tuple[int, int]]] = {}
    for fqn, item in md.state_dict_metadata.items():  # each one or the other exactly (check_metadata)
        if isinstance(item, BytesStorageMetadata):
            chunks: list[tuple[Any, int]] = [(None, 0)]
        else:
            chunks = [(c.offsets, _volume(c.sizes) * item.properties.dtype.itemsize) for c in item.chunks]
        for offsets, nbytes in chunks:
            info = md.storage_data.get(MetadataIndex(fqn, offsets))
            if info is None:
                raise fail(where, f"{fqn}: no data item for chunk {tuple(offsets or ())}")
            if id(info) in used:
                raise fail(where, f"{fqn}: two chunks share one data item")
            used.add(id(info))
            if info.relative_path not in sizes:
                sizes[info.relative_path] = reader._data_file(info.relative_path).stat().st_size
            if info.offset + info.length > sizes[info.relative_path] or info.length < nbytes:
                raise fail(where, f"{fqn}: data item out of range of {info.relative_path} (truncated?)")
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    for name, spans in ranges.items():
        spans.sort()
        for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
            if a + n > b:
                raise fail(where, f"data items overlap in {name} (bytes {b:,}..{a + n:,})")


def read_dcp_full(dcp_dir: str | os.PathLike[str], part: str | None = None) -> dict[str, Any]:
    """Every item of the DCP checkpoint in ``dcp_dir`` (the directory holding ``.metadata``) as full,
    unsharded tensors / plain values, nested as saved (e.g. ``{"model": {...}, "optim": {...}}``);
    ``part``: only the items under that top-level key (e.g. ``"model"``: the others are not read).
    One process, no process group, no temporary file; nothing is unpickled beyond the allow-lists."""
    where = str(dcp_dir)
    reader = SafeFileSystemReader(dcp_dir)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    _check_extents(reader, md, where)
    paths = md.planner_data or {}
    wanted = {fqn: item for fqn, item in md.state_dict_metadata.items()
              if part is None or paths.get(fqn, (fqn,))[0] == part}
    tensors: dict[str, torch.Tensor] = {}
    items: list[ReadItem] = []
    for fqn, item in wanted.items():
        if isinstance(item, BytesStorageMetadata):  # or a TensorStorageMetadata, exactly (check_metadata)
            zero = torch.Size([0])
            idx = MetadataIndex(fqn)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=idx, dest_offsets=zero, storage_index=idx,
                                  storage_offsets=zero, lengths=zero))
            continue
        if sum(_volume(c.sizes) for c in item.chunks) != _volume(item.size):
            raise fail(where, f"{fqn}: the chunks do not cover the tensor exactly")
        try:
            tensors[fqn] = torch.zeros(item.size, dtype=item.properties.dtype)
        except RuntimeError as exc:  # e.g. a size too large to allocate
            raise fail(where, f"{fqn}: cannot allocate {tuple(item.size)} ({one_line(exc)})") from None
        for c in item.chunks:
            idx = MetadataIndex(fqn, c.offsets)
            items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=idx, dest_offsets=c.offsets, storage_index=idx,
                                  storage_offsets=torch.Size([0] * len(c.offsets)), lengths=c.sizes))
    collect = _Collect(tensors, where)
    reader.read_data(LoadPlan(items), collect).wait()
    flat = {k: tensors[k] if k in tensors else collect.values[k] for k in wanted}
    return _unflatten(flat, md.planner_data, where)


def read_dcp(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The model and optimizer state of the DCP checkpoint directory ``path`` as full tensors in this
    process: ``{"model": {...}, "optim": {...}}`` (:func:`read_dcp_full` of ``path/dcp``)."""
    full = read_dcp_full(Path(path) / DCP_DIR)
    if not isinstance(full.get("model"), dict) or not isinstance(full.get("optim"), dict):
        raise CheckpointError(f"{path}: the DCP checkpoint holds no model and optimizer state")
    return full
