"""optstack.distributed: communication (``Comm``; ``comm.py`` is the only module that calls
torch.distributed), process groups, the data-parallel wrapper over contiguous gradient buffers, and the
ZeRO-1 (``ShardedStage``) and layer-wise (``LayerWiseStage``) distributed stages.

The names below are re-exports; each module owns one concept (see its docstring). The two stages are
imported on first use: they build on ``optstack.precision``, which itself imports ``comm.py`` from here.
"""

from __future__ import annotations

from typing import Any

from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ComposedComm, ParallelGroups, RankLayout

__all__ = [
    "Comm",
    "ComposedComm",
    "DataParallel",
    "LayerWiseStage",
    "NullComm",
    "ParallelGroups",
    "RankLayout",
    "ShardedStage",
    "world_comm",
]


def __getattr__(name: str) -> Any:
    if name == "ShardedStage":
        from optstack.distributed.sharded import ShardedStage

        return ShardedStage
    if name == "LayerWiseStage":
        from optstack.distributed.layerwise import LayerWiseStage

        return LayerWiseStage
    raise AttributeError(f"module 'optstack.distributed' has no attribute {name!r}")
