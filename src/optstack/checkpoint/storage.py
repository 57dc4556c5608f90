"""torch.distributed.checkpoint (DCP) as the storage engine: per rank a DCP directory of 1-D chunks at offsets.

A read of a range reads only the overlapping stored items. DCP runs without a process group (``no_dist``): the
coordination goes over ``Comm``, so collectives stay in ``distributed/comm.py``. Reads deserialise data only
(``safe.py``): the metadata through the restricted unpickler, the tensors ``weights_only``, no bytes items.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from optstack.checkpoint.safe import METADATA, SafeFileSystemReader, load_metadata_file

__all__ = ["Chunk", "write_chunks", "read_chunks", "rank_dir_name"]


@dataclass(frozen=True)
class Chunk:
    """Elements ``[start, start + tensor.numel())`` of the flat tensor ``key`` of ``size`` elements."""

    key: str
    tensor: torch.Tensor  # 1-D: the data to write, or the destination to read into
    start: int
    size: int

    def meta(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.start]), sizes=torch.Size([self.tensor.numel()]))


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank:05d}"


class _Chunks:
    def __init__(self, chunks: list[Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)  # type: ignore[call-arg]
        self._chunks = {c.key: c for c in chunks}


class _ChunkSavePlanner(_Chunks, DefaultSavePlanner):
    """Writes each ``Chunk`` as a shard of its flat tensor (DCP chunk metadata: offset and length)."""

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([WriteItem(
            index=MetadataIndex(c.key, torch.Size([c.start])), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=c.meta(), properties=TensorProperties.create_from_tensor(c.tensor),
                                        size=torch.Size([c.size])),
        ) for c in self._chunks.values()])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._chunks[index.fqn].tensor


class _ChunkLoadPlanner(_Chunks, DefaultLoadPlanner):
    """Reads ranges of flat tensors into the given destinations (only the stored items that overlap)."""

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:  # DCP sets it before planning
            raise ValueError("DCP gave the load planner no metadata")
        items = []
        for chunk in self._chunks.values():
            stored = self.metadata.state_dict_metadata.get(chunk.key)
            if stored is None:
                raise ValueError(f"{chunk.key!r} is not in this DCP directory")
            if not isinstance(stored, TensorStorageMetadata):
                raise ValueError(f"{chunk.key!r} is stored as {type(stored).__name__}, not as a tensor")
            items += create_read_items_for_chunk_list(chunk.key, stored, [chunk.meta()])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._chunks[index.fqn].tensor

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise ValueError(f"{read_item.dest_index.fqn!r} is a bytes item; optstack checkpoints hold only tensors")


class _Reader(SafeFileSystemReader):
    """The data-only reader, given the metadata already read (once, and refused outside DCP's error wrapping)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _dcp(run: Any, **kwargs: Any) -> None:
    # DCP warns that it runs without a process group: that is the design here (module docstring).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        run({}, no_dist=True, **kwargs)


def write_chunks(directory: Path, chunks: list[Chunk]) -> None:
    """Write ``chunks`` as one DCP checkpoint in ``directory`` (created), every file flushed to disk."""
    _dcp(dcp.save, storage_writer=dcp.FileSystemWriter(directory, sync_files=True, overwrite=False),
         planner=_ChunkSavePlanner([c for c in chunks if c.tensor.numel() > 0]))


def read_chunks(checkpoint: Path, by_rank: Mapping[int, list[Chunk]],
                known: MutableMapping[Path, Metadata] | None = None) -> None:
    """Fill each chunk's destination with its range, from the DCP directory in ``checkpoint`` of its rank.

    ``known``: DCP metadata already read and checked, by path (each file is checked once per load); what this
    reads is added."""
    known = {} if known is None else known
    for rank, chunks in sorted(by_rank.items()):
        if wanted := [c for c in chunks if c.tensor.numel() > 0]:
            directory = checkpoint / rank_dir_name(rank)
            metadata = known.get(directory / METADATA)
            if metadata is None:
                metadata = known[directory / METADATA] = load_metadata_file(directory / METADATA)
            for index, info in metadata.storage_data.items():
                if descriptors := getattr(info, "transform_descriptors", None):  # optstack writes none
                    raise ValueError(f"{directory / METADATA}: item {index.fqn!r} has transforms {descriptors}; "
                                     "optstack checkpoints hold plain items only (the file was altered or "
                                     "written by something else)")
            reader = _Reader(directory, metadata)
            try:
                _dcp(dcp.load, storage_reader=reader, planner=_ChunkLoadPlanner(wanted))
            except CheckpointException as exc:  # a BaseException: as a ValueError, with DCP's causes
                causes = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values())
                raise ValueError(f"reading {directory} failed: {causes}") from exc
