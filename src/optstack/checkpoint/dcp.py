"""torch.distributed.checkpoint (DCP) for optstack optimizers: a ``Stateful`` to put beside the model.

    dcp.save({"model": model.state_dict(), "optim": OptimizerState(model, optimizer, scheduler)}, checkpoint_id=d)
    dcp.load({"model": model.state_dict(), "optim": OptimizerState(model, optimizer, scheduler)},
             storage_reader=SafeFileSystemReader(d), planner=DefaultLoadPlanner(flatten_sharded_tensors=False))

It goes through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (state keyed by parameter
name; a fresh optimizer's state is made first, so ``dcp.load`` has a tensor to read each entry into), and adds
what they leave out: the loss scaler and, if given, the scheduler. Replicated, ZeRO-1 and layer-wise state
loads at another data-parallel size (ZeRO-1 and layer-wise state are ``ShardedTensor``s: ``stage/sharded.py``).
State held whole (one process, layer-wise, Muon's owner ranks on DTensor models) keeps the parameter's shape,
as FSDP2's DTensor state does, so it moves between those; ZeRO-1's is flat: between other placements, use
``optstack.checkpoint.save_checkpoint`` / ``load_checkpoint``. With torch 2.13, load ZeRO-1 and layer-wise
state with ``DefaultLoadPlanner(flatten_sharded_tensors=False)``: the default planner's flattening (meant for
FSDP's nested ShardedTensors) fails on ranks that hold no part of some parameter.

DCP's own ``FileSystemReader`` (``checkpoint_id=d``) unpickles ``.metadata`` with ``pickle.load`` and bytes
items with ``torch.load(weights_only=False)``: loading a checkpoint from anyone else can run their code.
``SafeFileSystemReader`` (from ``optstack.checkpoint``; ``safe.py``) deserialises data only and refuses anything
else with a ``ValueError`` naming the file (inside torch's ``CheckpointException``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from optstack.checkpoint.save import check_optimizer
from optstack.optimizer import ChainedOptimizer
from optstack.schedule import Scheduler

__all__ = ["OptimizerState"]


class OptimizerState:
    """The optimizer's state, loss scaler and scheduler as one DCP ``Stateful``.

    Args:
        model: the module the optimizer was built over (as passed to ``build_optimizer``; names come from it).
        optimizer: ``build_optimizer(...).optimizer``.
        scheduler: an optstack ``Scheduler`` saved and loaded with it (None: none).
    """

    def __init__(self, model: nn.Module, optimizer: ChainedOptimizer, scheduler: Scheduler | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"OptimizerState.model must be the nn.Module the optimizer was built over, got "
                             f"{type(model).__name__}")
        self.model, self.optimizer, self.scheduler = model, check_optimizer(optimizer), scheduler

    def state_dict(self) -> dict[str, Any]:
        out = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer),
               "scaler": self.optimizer.scaler.state_dict()}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        wanted = ("optimizer", "scaler") + (("scheduler",) if self.scheduler is not None else ())
        missing = [k for k in wanted if k not in state_dict]
        if missing:
            raise ValueError(f"the checkpoint's optimizer entry has no {missing}; was it saved by OptimizerState "
                             f"{'with a scheduler' if 'scheduler' in missing else ''}?")
        self.optimizer.scaler.validate_state_dict(state_dict["scaler"])
        set_optimizer_state_dict(self.model, self.optimizer, state_dict["optimizer"])
        self.optimizer.scaler.load_state_dict(state_dict["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
