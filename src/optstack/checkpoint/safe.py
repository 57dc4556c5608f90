"""Reading a checkpoint deserialises data only: loading one never runs code from it.

torch.distributed.checkpoint stores each directory's index (``.metadata``) as a pickle, and its own
``FileSystemReader`` reads it with ``pickle.load``: a ``.metadata`` file from someone else could run anything.
``load_metadata`` admits only the classes DCP's metadata holds in torch 2.13 (``metadata.py``'s dataclasses, the
file system's ``_StorageInfo``, ``torch.Size``, dtypes, layouts, paths as pure paths) besides plain containers
and scalars, and sets state only on fresh instances of those dataclasses; the first global outside that list
is a ``ValueError`` naming the file, raised by the unpickler before it looks the global up, so nothing outside
the list is ever imported, built or called. The result is then checked field by field.
``SafeFileSystemReader`` is DCP's reader with that unpickler and every read bounded (``bounded.py``)::

    dcp.load(state, storage_reader=SafeFileSystemReader(d))
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Callable
from pathlib import PurePath, PurePosixPath, PureWindowsPath
from typing import IO, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from optstack.checkpoint.bounded import (
    CONTAINERS,
    BoundedUnpickler,
    Refused,
    check_key,
    check_record,
    check_tree,
    read_bounded,
    register_key,
)
from optstack.checkpoint.format import is_count

try:  # where torch 2.13 defines it; the name in the pickle is what matters
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover - another torch: no file can name it, so none loads
    _StorageInfo = None

__all__ = ["SafeFileSystemReader", "load_metadata", "load_metadata_file", "ALLOWED_GLOBALS", "METADATA"]

METADATA = ".metadata"  # the name DCP's FileSystemWriter gives a directory's metadata (with a process group or none)

_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout`` without its cache: a layout by its name, nothing else."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise ValueError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


def _allowed() -> dict[tuple[str, str], Any]:
    meta = "torch.distributed.checkpoint.metadata"
    out: dict[tuple[str, str], Any] = {
        (meta, c.__name__): c for c in (Metadata, MetadataIndex, TensorStorageMetadata, BytesStorageMetadata,
                                        ChunkStorageMetadata, TensorProperties, StorageMeta, _MEM_FORMAT_ENCODING)}
    if _StorageInfo is not None:
        out["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = _StorageInfo
    out["torch", "Size"] = torch.Size
    out |= {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    out["torch.serialization", "_get_layout"] = _layout
    # StorageMeta.checkpoint_id is a path: built as a pure path (no file system access, any OS's form).
    for module in ("pathlib", "pathlib._local"):
        out |= {(module, n): PurePosixPath for n in ("PosixPath", "PurePosixPath")}
        out |= {(module, n): PureWindowsPath for n in ("WindowsPath", "PureWindowsPath")}
    out |= CONTAINERS  # set, frozenset, OrderedDict: their members checked before they are hashed
    return out


#: (module, name) -> the object a ``.metadata`` pickle may reference; every other global is refused.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed()


# DCP's metadata objects: the only ones whose state a pickle may set (a class, function or shared singleton
# such as an enum member must never have attributes set by a file).
_BUILDABLE = frozenset(c for c in (Metadata, MetadataIndex, TensorStorageMetadata, BytesStorageMetadata,
                                   ChunkStorageMetadata, TensorProperties, StorageMeta, _StorageInfo) if c is not None)


def _check_index_key(index: MetadataIndex) -> None:
    """A ``MetadataIndex`` is hashed by its fields: flat ones only (a file sets them)."""
    fields = vars(index)
    if set(fields) - {"fqn", "offset", "index"} or not isinstance(fields.get("fqn"), str):
        raise Refused(f"a MetadataIndex key with fields {sorted(map(repr, fields))}")
    for name in ("offset", "index"):
        if fields.get(name) is not None:
            check_key(fields[name])


register_key(MetadataIndex, _check_index_key)


class _MetadataUnpickler(BoundedUnpickler):
    """The bounded unpickler (``bounded.py``), its globals limited to ``ALLOWED_GLOBALS`` and its BUILD to
    ``_BUILDABLE``."""

    dispatch = dict(BoundedUnpickler.dispatch)

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, ALLOWED_GLOBALS)

    def _load_build_metadata(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) not in _BUILDABLE:
            raise Refused(f"state to set on a {type(inst).__name__} object")
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
                raise Refused(f"special attributes {sorted(map(repr, part))[:8]} to set on a "
                               f"{type(inst).__name__}")
        BoundedUnpickler.dispatch[pickle.BUILD[0]](self)

    dispatch[pickle.BUILD[0]] = _load_build_metadata


def load_metadata(file: IO[bytes], where: str) -> Metadata:
    """DCP ``Metadata`` from the pickle in ``file``, admitting only ``ALLOWED_GLOBALS``; checked field by field.

    Raises:
        ValueError: naming ``where``: a global outside the list (refused before it is looked up), a damaged
            pickle, or a structure DCP does not write.
    """
    try:
        data = file.read()  # in memory: a length the pickle claims is then never allocated beyond the file
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        _check_metadata(metadata, len(data))
    except Refused as exc:
        raise ValueError(
            f"{where} holds {exc}, which DCP checkpoint metadata never does: refusing to load it (loading a "
            "checkpoint never runs code from it). The file was altered, or written by something other than "
            "torch.distributed.checkpoint; do not load it unless you trust its source.") from None
    except _Malformed as exc:
        raise ValueError(f"{where} is not DCP checkpoint metadata: {exc}") from None
    except Exception as exc:  # any damage the unpickler meets (truncation, wrong arity, bad state)
        raise ValueError(f"{where} is not readable DCP checkpoint metadata ({type(exc).__name__}: {exc}); the "
                         "file is corrupted or not a DCP .metadata file") from None
    return metadata


def load_metadata_file(path: str | PurePath) -> Metadata:
    """``load_metadata`` of the file at ``path`` (its name in the errors); ``ValueError`` when unreadable."""
    try:
        with open(path, "rb") as f:
            return load_metadata(f, str(path))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


class _Malformed(Exception):
    pass


_MIN_CHUNK_BYTES = 8  # a chunk's pickle (a ChunkStorageMetadata and its two sizes) takes more than this


def _expect(ok: bool, what: str, value: Any, expected: str) -> None:
    if not ok:
        raise _Malformed(f"{what} is a {type(value).__name__}, expected {expected}")


def _check_size(what: str, value: Any, ndim: int | None = None) -> None:
    _expect(isinstance(value, torch.Size) and (ndim is None or len(value) == ndim), what, value,
            "a torch.Size" + (f" of {ndim} dimensions" if ndim is not None else ""))


def _check_metadata(md: Any, size: int) -> None:
    """Raise ``_Malformed`` unless ``md`` has the shape DCP's ``FileSystemWriter`` gives its metadata.

    Linear in ``size``, the pickle's bytes: a pickle can alias one list of chunks from every entry (a few bytes
    each), so the chunks are counted and more than the file could hold as distinct objects is refused."""
    _expect(type(md) is Metadata, "the pickle", md, "DCP Metadata")
    entries = md.state_dict_metadata
    _expect(isinstance(entries, dict), "state_dict_metadata", entries, "a dict")
    seen_chunks = 0
    for key, entry in entries.items():
        _expect(isinstance(key, str), "a state_dict_metadata key", key, "a str")
        if type(entry) is BytesStorageMetadata:
            continue
        _expect(type(entry) is TensorStorageMetadata, f"state_dict_metadata[{key!r}]", entry,
                "TensorStorageMetadata or BytesStorageMetadata")
        _expect(type(entry.properties) is TensorProperties, f"{key!r}.properties", entry.properties,
                "TensorProperties")
        _expect(isinstance(entry.properties.dtype, torch.dtype), f"{key!r}.properties.dtype",
                entry.properties.dtype, "a torch.dtype")
        _check_size(f"{key!r}.size", entry.size)
        _expect(isinstance(entry.chunks, list), f"{key!r}.chunks", entry.chunks, "a list")
        seen_chunks += len(entry.chunks)
        if seen_chunks > size // _MIN_CHUNK_BYTES:
            raise _Malformed(f"state_dict_metadata lists more chunks ({seen_chunks} by {key!r}) than a "
                             f"{size}-byte file holds: the pickle repeats one list of chunks (aliasing)")
        for chunk in entry.chunks:
            _expect(type(chunk) is ChunkStorageMetadata, f"a chunk of {key!r}", chunk, "ChunkStorageMetadata")
            _check_size(f"a chunk offset of {key!r}", chunk.offsets, len(entry.size))
            _check_size(f"a chunk size of {key!r}", chunk.sizes, len(entry.size))
            # Inside the tensor: a read of the chunk is then bounded by the tensor the caller loads into.
            if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size,
                                                                   strict=True)):
                raise _Malformed(f"a chunk of {key!r} at {list(chunk.offsets)} of size {list(chunk.sizes)} "
                                 f"lies outside the tensor's size {list(entry.size)}")
    storage = md.storage_data
    _expect(isinstance(storage, dict), "storage_data", storage, "a dict")
    for index, info in storage.items():
        _expect(type(index) is MetadataIndex and isinstance(index.fqn, str), "a storage_data key", index,
                "a MetadataIndex")
        _expect(_StorageInfo is not None and type(info) is _StorageInfo, f"storage_data[{index.fqn!r}]", info,
                "a _StorageInfo")
        path = info.relative_path
        # Only a file beside the metadata: a path elsewhere would read a file the checkpoint does not hold.
        if not isinstance(path, str) or not path or "/" in path or "\\" in path or path in (".", ".."):
            raise _Malformed(f"storage_data[{index.fqn!r}] points at {path!r}, not a file in the directory")
        _expect(is_count(info.offset) and is_count(info.length), f"the offset/length of {index.fqn!r}",
                (info.offset, info.length), "ints >= 0")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None:
            _expect(isinstance(descriptors, list | tuple) and all(isinstance(d, str) for d in descriptors),
                    f"the transforms of {index.fqn!r}", descriptors, "a list of str")
    _expect(md.storage_meta is None or type(md.storage_meta) is StorageMeta, "storage_meta", md.storage_meta,
            "StorageMeta or None")
    check_tree(md.planner_data, "planner_data")
    check_tree(md.storage_meta, "storage_meta")


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that deserialises data only, within bounds; pass it as
    ``dcp.load(..., storage_reader=...)``.

    ``.metadata`` goes through ``load_metadata`` (DCP's metadata classes, containers and scalars only, keys
    checked before they are hashed, linear in the file). Each item is read within the file (its range checked
    against the file's size), through its transforms (e.g. zstd) at most to the bytes its metadata gives it
    (a tensor's elements times their size, plus the record's overhead; ``MAX_BYTES_ITEM`` for a bytes item),
    its ``torch.save`` record checked and dry-run (``bounded.check_record``) before ``torch.load(weights_only=True)``
    reads it; bytes items reach the planner only as a fresh serialisation of that load. A refused file is a
    ``ValueError`` naming it and the item; ``dcp.load`` reports it inside torch's ``CheckpointException``.

    Args:
        path: the DCP checkpoint directory (``checkpoint_id``).
    """

    #: The most bytes a bytes item (non-tensor state: numbers, strings, small containers) may hold decoded.
    MAX_BYTES_ITEM = 1 << 26
    #: A tensor's record holds its elements and at most this much more (the pickle, the archive's headers).
    RECORD_OVERHEAD = 1 << 16

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, str(path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # Each stored chunk's bytes, by (key, offsets): what a read of its item may produce at most.
        self._chunk_bytes: dict[tuple[str, tuple[int, ...]], int] = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                itemsize = entry.properties.dtype.itemsize
                for chunk in entry.chunks:
                    self._chunk_bytes[key, tuple(chunk.offsets)] = itemsize * math.prod(chunk.sizes)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``FileSystemReader.read_data`` (torch 2.13), every read bounded (class docstring)."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        checked = _DataOnlyBytes(planner, self._where)
        for relative_path, items in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                size = os.fstat(stream.fileno()).st_size if hasattr(stream, "fileno") else None
                for item in items:
                    data = self._read_item(stream, item, size)
                    if item.type == LoadItemType.BYTE_IO:
                        checked.load_bytes(item, io.BytesIO(data))
                        continue
                    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    if not isinstance(tensor, torch.Tensor):
                        raise ValueError(f"{path}: item {item.storage_index.fqn!r} is a "
                                         f"{type(tensor).__name__}, the metadata says a tensor")
                    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise ValueError(f"{path}: item {item.storage_index.fqn!r} holds {tuple(tensor.size())} "
                                         f"where the metadata says {tuple(target.size())}")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, stream: IO[bytes], item: ReadItem, size: int | None) -> bytes:
        """The item's record: inside the file, through its transforms, at most its bound, checked."""
        info, where = self.storage_data[item.storage_index], self._where(item)
        fqn = item.storage_index.fqn
        if size is not None and info.offset + info.length > size:
            raise ValueError(f"{where}: item {fqn!r} claims bytes [{info.offset}, {info.offset + info.length}) "
                             f"of a {size}-byte file: the metadata or the file is damaged")
        if item.type == LoadItemType.BYTE_IO:
            limit = self.MAX_BYTES_ITEM
        else:
            stored = self._chunk_bytes.get((fqn, tuple(item.storage_index.offset or ())))
            if stored is None:
                raise ValueError(f"{where}: item {fqn!r} at {item.storage_index.offset} is not a chunk the "
                                 "metadata lists")
            limit = stored + self.RECORD_OVERHEAD
        descriptors = info.transform_descriptors or ()
        if not descriptors and info.length > limit:
            raise ValueError(f"{where}: item {fqn!r} is {info.length} bytes, more than the {limit} its metadata "
                             "allows")
        try:
            raw = self._slice_file(stream, info)
            data = read_bounded(self.transforms.transform_load_stream(item, descriptors, raw), limit,
                                f"item {fqn!r}")
            check_record(data)
        except Refused as exc:
            raise ValueError(f"{where}: item {fqn!r} is not plain data ({exc}); refusing to load it (a load reads "
                             "data only, within the sizes the metadata gives)") from None
        return data

    def _where(self, item: ReadItem) -> str:
        info = self.storage_data.get(item.storage_index)
        return str(self.fs.concat_path(self.path, info.relative_path)) if info is not None else str(self.path)


class _DataOnlyBytes:
    """The caller's planner, but bytes items reach it only as a fresh serialisation of a ``weights_only`` load."""

    def __init__(self, planner: LoadPlanner, where: Callable[[ReadItem], str]) -> None:
        self._planner, self._where = planner, where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            # torch's message is long; its "WeightsUnpickler error:" line names what was refused.
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
            why = next((ln.split(". ")[0] for ln in lines if "WeightsUnpickler error" in ln), lines[0])
            raise ValueError(f"{self._where(read_item)}: item {read_item.storage_index.fqn!r} is not plain data "
                             f"({why}); refusing to load it (loading a checkpoint never runs code from it)"
                             ) from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
