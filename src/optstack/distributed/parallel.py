"""The process groups of a parallel layout: data, tensor, pipeline, expert, expert-data and model parallel.

Megatron's rank order, tensor-parallel fastest; expert parallelism splits the data-parallel dimension::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)     dp_rank = ep_rank + ep * expert_dp_rank

The model-parallel group (tensor x pipeline) is all ranks with one data-parallel rank.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from optstack.distributed.comm import Comm, NullComm, ProcessGroup, is_initialized, new_subgroups, world_size

__all__ = ["ComposedComm", "ParallelGroups", "RankLayout", "GroupKind"]

GroupKind = Literal["dp", "tp", "pp", "ep", "expert_dp", "mp"]
_NAMES: dict[str, str] = {"dp": "data-parallel", "tp": "tensor-parallel", "pp": "pipeline-parallel",
                          "ep": "expert-parallel", "expert_dp": "expert-data-parallel", "mp": "model-parallel"}
# A rank's digits, most significant first, are (pp, expert_dp, ep, tp); a group varies these of them.
_VARIES: dict[str, tuple[int, ...]] = {"pp": (0,), "expert_dp": (1,), "ep": (2,), "tp": (3,), "dp": (1, 2),
                                       "mp": (0, 3)}


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Which global ranks form each group, for a world of ``world_size`` ranks (see the module docstring)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for field_name in ("world_size", "tp", "pp", "ep"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"tp * pp = {self.tp} * {self.pp} must divide the world size {self.world_size}; "
                             f"choose sizes whose product divides {self.world_size}")
        if self.dp % self.ep:
            raise ValueError(f"ep = {self.ep} must divide the data-parallel size {self.dp} (world {self.world_size} "
                             f"/ (tp {self.tp} * pp {self.pp})): expert parallelism splits it")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.dp // self.ep

    def groups(self, kind: GroupKind) -> list[list[int]]:
        """The rank lists of every group of ``kind`` (each ascending); together they cover the world once."""
        if kind not in _VARIES:
            raise ValueError(f"group kind must be one of {sorted(_NAMES)}, got {kind!r}")
        varied = _VARIES[kind]
        grid = torch.arange(self.world_size).view(self.pp, self.expert_dp, self.ep, self.tp)
        fixed = [d for d in range(4) if d not in varied]
        return grid.permute(*fixed, *varied).reshape(-1, math.prod(grid.shape[d] for d in varied)).tolist()


def _null(kind: str) -> Any:
    return field(default_factory=lambda: NullComm(_NAMES[kind]))


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """One communicator per parallel dimension (``NullComm`` for size 1); build with a ``from_*``, or from Comms."""

    dp: Comm | NullComm = _null("dp")
    tp: Comm | NullComm = _null("tp")
    pp: Comm | NullComm = _null("pp")
    ep: Comm | NullComm = _null("ep")
    expert_dp: Comm | NullComm = _null("expert_dp")
    mp: Comm | NullComm = _null("mp")

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process: every group is a NullComm."""
        return cls()

    @classmethod
    def from_world(cls, *, tp: int = 1, pp: int = 1, ep: int = 1,
                   timeout: datetime.timedelta | None = None) -> ParallelGroups:
        """Groups over the world in Megatron's rank order (module docstring); ``single()`` without torch.distributed.

        Collective: every rank calls it alike. With the defaults the world group itself is the data-parallel one.

        Raises:
            ValueError: tp * pp does not divide the world size, or ep does not divide the data-parallel size.
        """
        if not is_initialized():
            if (tp, pp, ep) != (1, 1, 1):
                raise ValueError(f"tp={tp}, pp={pp}, ep={ep} need an initialised torch.distributed world; "
                                 "call torch.distributed.init_process_group first")
            return cls.single()
        layout = RankLayout(world_size=world_size(), tp=tp, pp=pp, ep=ep)
        return cls(**{kind: new_subgroups(layout.groups(kind), name=name, timeout=timeout)  # type: ignore[arg-type]
                      for kind, name in _NAMES.items()})

    @classmethod
    def from_process_groups(cls, *, dp: ProcessGroup | None = None, tp: ProcessGroup | None = None,
                            pp: ProcessGroup | None = None, ep: ProcessGroup | None = None,
                            expert_dp: ProcessGroup | None = None, mp: ProcessGroup | None = None,
                            timeout: datetime.timedelta | None = None) -> ParallelGroups:
        """Wrap your torch process groups (None: size 1); ``expert_dp`` defaults to ``dp`` when ``ep`` is None."""
        if expert_dp is None and ep is None:
            expert_dp = dp
        given = {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "expert_dp": expert_dp, "mp": mp}
        return cls(**{kind: NullComm(_NAMES[kind]) if group is None
                      else Comm(group, name=_NAMES[kind], timeout=timeout) for kind, group in given.items()})

    @classmethod
    def from_device_mesh(cls, mesh: Any, *, timeout: datetime.timedelta | None = None) -> ParallelGroups:
        """Groups from a ``DeviceMesh`` with dimensions named from {"dp", "tp", "pp"} (missing: size 1; ep = 1,
        expert_dp = dp). Collective when the mesh has both "tp" and "pp" (the model-parallel group is created)."""
        names = tuple(mesh.mesh_dim_names or ())
        if not names or set(names) - {"dp", "tp", "pp"}:
            raise ValueError(f"from_device_mesh needs mesh_dim_names from ('dp', 'tp', 'pp'); got {names}. "
                             "Create the mesh with init_device_mesh(..., mesh_dim_names=('dp',)) or similar")
        comms: dict[str, Comm | NullComm] = {
            kind: Comm(mesh.get_group(kind), name=_NAMES[kind], timeout=timeout) if kind in names
            else NullComm(_NAMES[kind]) for kind in ("dp", "tp", "pp")
        }
        if "tp" in names and "pp" in names:
            ranks = mesh.mesh.movedim(names.index("dp"), 0) if "dp" in names else mesh.mesh.unsqueeze(0)
            rows = ranks.reshape(ranks.shape[0], -1).tolist()
            comms["mp"] = new_subgroups(rows, name=_NAMES["mp"], timeout=timeout)
        else:
            comms["mp"] = comms["tp"] if "tp" in names else comms["pp"]
        return cls(ep=NullComm(_NAMES["ep"]), expert_dp=comms["dp"], **comms)


class ComposedComm:
    """All-reduce over several orthogonal groups in turn: the reduction over their product (norms, finite checks)."""

    def __init__(self, comms: Sequence[Comm | NullComm]) -> None:
        self.comms = [c for c in comms if c.size > 1]
        self.name = " x ".join(c.name for c in comms) or "single-process"
        self.size = math.prod(c.size for c in self.comms)

    def __repr__(self) -> str:
        return f"ComposedComm({self.name!r}, size={self.size})"

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        for comm in self.comms:
            comm.all_reduce(tensor, op)
        return tensor
