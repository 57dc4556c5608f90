"""Megatron's ``ProcessGroupCollection`` and ``to_parallel_groups``, its translation to optstack's
``ParallelGroups`` (the data-parallel group is ``dp_cp`` when set, since context-parallel ranks reduce gradients
together, else ``dp``).
"""

from __future__ import annotations

import sys
from typing import Any

from optstack.distributed.parallel import ParallelGroups

__all__ = ["ProcessGroupCollection", "to_parallel_groups", "check_optimizer_groups", "collection_group",
           "megatron_mpu_collection"]

#: The attributes Megatron's collection declares (others are an error, as in Megatron).
FIELDS = (
    "tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "hcp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat", "tp_dp_cp", "dp", "dp_cp", "dp_cp_gtp_remat", "expt_dp", "expt_dp_gtp_remat",
    "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt", "gtp_remat", "expt_gtp_remat",
)


class _CollectionType(type):
    """Megatron's own ``ProcessGroupCollection`` (a dataclass declaring the same fields, e.g. built by
    ``ProcessGroupCollection.use_mpu_process_groups()``) counts as an instance, so callers that keep Megatron's
    ``parallel_state`` can pass theirs."""

    def __instancecheck__(cls, obj: Any) -> bool:
        declared = getattr(type(obj), "__dataclass_fields__", {})
        return type.__instancecheck__(cls, obj) or {"tp", "dp", "expt_dp", "intra_dist_opt"} <= set(declared)


def is_set(pg_collection: Any, name: str) -> bool:
    """Whether ``name`` was given to the collection (even as None), for ours and Megatron's alike."""
    return name in vars(pg_collection)


class ProcessGroupCollection(metaclass=_CollectionType):
    """Megatron's collection of process groups: ``ProcessGroupCollection(tp=..., dp=...)`` or attributes set
    afterwards. A declared attribute never set reads as None (Megatron's current behaviour); ``is_set(name)``
    tells the two apart. ``isinstance(x, ProcessGroupCollection)`` also holds for Megatron's own class.

    Raises:
        ValueError: an attribute Megatron does not declare.
    """

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in FIELDS:
            raise ValueError(f"Unknown attribute: {name} (ProcessGroupCollection has {list(FIELDS)})")
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:  # only for attributes never set
        if name in FIELDS:
            return None
        raise AttributeError(f"'ProcessGroupCollection' object has no attribute '{name}'")

    def is_set(self, name: str) -> bool:
        """Whether ``name`` was given (even as None)."""
        return is_set(self, name)

    def __repr__(self) -> str:
        return f"ProcessGroupCollection({', '.join(k for k in FIELDS if self.is_set(k))})"


def collection_group(pg_collection: Any, name: str) -> Any:
    """The collection's group ``name``, None when unset (Megatron's own class before current main raises
    AttributeError for a declared attribute never set)."""
    return getattr(pg_collection, name, None)


def megatron_mpu_collection() -> Any | None:
    """The groups of Megatron's ``parallel_state`` when the program initialised it, as Megatron's own
    ``ProcessGroupCollection.use_mpu_process_groups()``: what Megatron's wrapper reduces over when given no
    ``pg_collection`` (data-parallel x context-parallel, not the world, once tensor or pipeline parallelism
    is on). None when Megatron is not loaded or its model parallelism is not initialised; Megatron is never
    imported here."""
    state = sys.modules.get("megatron.core.parallel_state")
    config = sys.modules.get("megatron.core.process_groups_config")
    if state is None or config is None or not state.model_parallel_is_initialized():
        return None
    return config.ProcessGroupCollection.use_mpu_process_groups()


def to_parallel_groups(pg_collection: ProcessGroupCollection) -> ParallelGroups:
    """optstack's ``ParallelGroups`` over the collection's groups (unset ones: size 1)."""
    g = {name: collection_group(pg_collection, name) for name in ("dp_cp", "dp", "tp", "pp", "ep", "expt_dp", "mp")}
    return ParallelGroups.from_process_groups(
        dp=g["dp_cp"] if g["dp_cp"] is not None else g["dp"], tp=g["tp"], pp=g["pp"], ep=g["ep"],
        expert_dp=g["expt_dp"], mp=g["mp"])


def check_optimizer_groups(pg_collection: ProcessGroupCollection, use_gloo_process_groups: bool) -> None:
    """Megatron's checks of a ``pg_collection`` given to ``get_megatron_optimizer``, with its messages."""
    for name in ("dp", "expt_dp", "intra_dist_opt", "mp", "tp_ep_pp"):
        if not is_set(pg_collection, name):
            raise ValueError(f"{name} process group is required when passing pg_collection "
                             f"(set pg_collection.{name}; None is allowed where the group is unused)")
    if pg_collection.dp is None:
        raise ValueError("dp process group is required when passing pg_collection (got None)")
    if use_gloo_process_groups:
        raise ValueError("Gloo process groups are not supported when pg_collection is provided; pass "
                         "use_gloo_process_groups=False")
