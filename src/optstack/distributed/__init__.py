"""optstack.distributed: communication (``comm.py``, the only caller of torch.distributed), process groups, and
the data-parallel wrapper, which owns all parameter and gradient communication (buffers, reductions, gathers)."""

from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ComposedComm, ParallelGroups, RankLayout

__all__ = ["Comm", "ComposedComm", "DataParallel", "NullComm", "ParallelGroups", "RankLayout", "world_comm"]
