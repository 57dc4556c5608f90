"""The ZeRO-1 stage: fp32 masters and optimizer state only for this rank's contiguous range of every bucket.

``DataParallel(shard_grads=True)`` reduces each bucket so that rank ``r`` holds the reduced gradient of
``[r * shard, (r + 1) * shard)`` of the bucket (the range plan of ``buffers.py``; the ranges cut across
parameters). ``ShardedStage`` builds, per model parameter, one 1-D *piece*: the part of the flattened
parameter inside this rank's range. The inner optimizer steps only these pieces:

- a bf16/fp16 parameter's piece is an fp32 master (views into one flat fp32 tensor per group, so runs of
  pieces are stepped by one kernel call);
- an fp32 parameter's piece is a view into the parameter buffer itself (Megatron's fp32-from-fp32 groups):
  the step writes the model parameter in place.

One step (the chained optimizer sequences the phases)::

    prepare_grads   owned grad slice -> piece.grad (a view when the dtypes agree, else an fp32 copy),
                    unscale, non-finite check agreed over every rank (max)
    grad_norm_sq    sum over the shards (data-parallel) and the model-parallel ranks
    scale_grads     clip
    step            inner step on the pieces -> masters rounded into the parameter buffer ->
                    per-bucket gather of the parameter buffer (waited for at once, or just before the
                    first module that uses the bucket runs, with ``overlap_param_gather``)

Expert (MoE) parameters get their own stage (``expert=True``) over the expert data-parallel group; its norm
and non-finite check also reduce over the expert-parallel group, whose ranks hold different experts.

The gathers themselves (whole buckets, or only this stage's pieces of a bucket shared with another stage;
all-gather or broadcasts; the forward pre-hooks) are ``param_gather.py``'s; the loops behind the
name-keyed state (``param_shards``) are ``param_shards.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from optstack.algorithms._common import zeros_in_runs
from optstack.clip import reduced_norm_pow, reduced_zero_count
from optstack.distributed.buffers import ParamAndGradBuffer
from optstack.distributed.comm import Comm, NullComm
from optstack.distributed.ddp import DataParallel
from optstack.distributed.parallel import ComposedComm
from optstack.distributed.param_gather import (
    BucketGather,
    gather_via,
    plan_bucket_gathers,
    register_wait_hooks,
)
from optstack.param_shards import Held, load_into, shards_of
from optstack.protocol import MakeOptimizer, ParamShard, Stage, phase

# ComposedComm lives in parallel.py; it is re-exported for existing imports.
__all__ = ["ShardedStage", "ComposedComm"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class _Piece:
    """This rank's part of one model parameter and the tensors the stage moves it between."""

    name: str
    param: nn.Parameter  # the model parameter (its attributes decide norm counting)
    start: int  # [start, end) of the flattened parameter
    end: int
    inner: torch.Tensor  # what the inner optimizer steps: an fp32 master, or a view of the param buffer
    model_view: torch.Tensor  # the same elements in the parameter buffer
    grad_view: torch.Tensor  # the same elements in the gradient buffer

    @property
    def has_master(self) -> bool:
        return self.inner is not self.model_view


class ShardedStage(Stage):
    """ZeRO-1: this rank's range of every bucket is stepped here, then the parameters are gathered.

    Args:
        param_groups: group dicts (``params``, optional ``param_names``, any settings) over parameters of
            ``ddp``'s wrapped module, all dense or all expert (``expert``). Not modified.
        make_optimizer: builds the inner optimizer from the inner groups: the same dicts (all keys copied)
            with ``params`` = this rank's 1-D pieces (fp32), ``param_names`` = their parameters' names.
            Parameters this rank owns nothing of are left out; a group may be empty, so every rank has the
            same groups (a rank that owns nothing steps an optimizer of empty groups).
        ddp: the data-parallel wrapper whose buffers hold the parameters and (reduced) gradients; its
            ``shard_grads=True`` is what ZeRO-1 needs (``False`` works too, reducing more than needed).
        expert: the groups hold expert (MoE) parameters: shard over the expert data-parallel group.
        overlap_param_gather: start the parameter gathers after the step and wait for each bucket in a
            forward pre-hook of the first module that uses it, overlapping the next forward; otherwise the
            step waits for them.
        param_gather: how parameters are gathered: ``"all_gather"`` (one per bucket), ``"broadcast"`` (one
            per rank and bucket, in place), or ``"auto"``: the fastest for the backend (broadcast on gloo,
            all-gather elsewhere). Either can overlap the next forward; the numbers are the same either way.

    Raises:
        ValueError: a parameter is not a trainable parameter of ``ddp``'s module, is in the wrong kind of
            buffer (dense vs expert), appears twice, or ``make_optimizer`` returns something else.
    """

    kind = "sharded"

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        make_optimizer: MakeOptimizer,
        *,
        ddp: DataParallel,
        expert: bool = False,
        overlap_param_gather: bool = False,
        param_gather: Literal["auto", "all_gather", "broadcast"] = "auto",
    ) -> None:
        if not isinstance(ddp, DataParallel):
            raise ValueError(f"ShardedStage: ddp must be an optstack DataParallel, got {type(ddp).__name__}")
        groups = ddp.groups
        self._expert = bool(expert)
        self._comm = groups.expert_dp if expert else groups.dp
        # Norms and non-finite flags: sum over the shards, the expert-parallel ranks (different experts)
        # and the model-parallel ranks (different tensor/pipeline parts): every rank gets the global value.
        self._reduce = ComposedComm(
            [self._comm, groups.ep, groups.mp] if expert else [self._comm, groups.mp]
        )
        self._tp_rank = groups.tp.rank
        self._overlap = bool(overlap_param_gather)
        self._via = gather_via(param_gather, self._comm.backend, overlap=self._overlap)
        buffers = [b for b in ddp.param_and_grad_buffers if b.key.is_expert == self._expert]
        self._device = buffers[0].param_data.device if buffers else torch.device("cpu")

        located = self._locate(param_groups, ddp)
        inner_groups, self._pieces, self._group_masters = self._build_pieces(param_groups, located)
        optimizer = make_optimizer(inner_groups)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"ShardedStage: make_optimizer must return a torch.optim.Optimizer, got "
                             f"{optimizer!r:.80}")
        given = [[id(p) for p in g["params"]] for g in inner_groups]
        if given != [[id(p) for p in g["params"]] for g in optimizer.param_groups]:
            raise ValueError("ShardedStage: make_optimizer must build the optimizer over exactly the groups "
                             "given, in order")
        self._optimizer = optimizer
        # Per-step bookkeeping, fixed by the pieces: computed once here, not in every step.
        self._model_params = [p.param for p in self._pieces]
        self._copied = [p for p in self._pieces if p.grad_view.dtype != p.inner.dtype]
        self._piece_grads: list[torch.Tensor] | None = None  # each piece's .grad; built on the first step
        self._grad_copies: list[torch.Tensor] = []  # fp32 grads when the grad buffer is not fp32
        self._grads_by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}  # _piece_grads by dtype
        with_master = [p for p in self._pieces if p.has_master]
        self._publish_to = [p.model_view for p in with_master]
        self._publish_from = [p.inner for p in with_master]
        in_buckets: dict[tuple[int, int], tuple[ParamAndGradBuffer, int, set[str]]] = {}
        for members in located:
            for name, param, buffer in members:
                bucket = buffer.slot_of(param).bucket
                in_buckets.setdefault((id(buffer), bucket), (buffer, bucket, set()))[2].add(name)
        self._gathers = plan_bucket_gathers(list(in_buckets.values()), self._comm, self._via, ddp.module)
        self._pending: list[BucketGather] = []
        self._hooks = register_wait_hooks(ddp.module, self._gathers) if self._overlap else []

    # -- construction --------------------------------------------------------------------------------
    def _locate(
        self, param_groups: Sequence[dict[str, Any]], ddp: DataParallel
    ) -> list[list[tuple[str, nn.Parameter, ParamAndGradBuffer]]]:
        """Per group, (name, parameter, its buffer), after checking every parameter belongs here once."""
        if isinstance(param_groups, dict) or not isinstance(param_groups, Sequence):
            raise ValueError(f"ShardedStage: param_groups must be a list of group dicts, got "
                             f"{type(param_groups).__name__}")
        seen: set[int] = set()
        out = []
        for index, group in enumerate(param_groups):
            if not isinstance(group, dict) or "params" not in group:
                raise ValueError(f"ShardedStage: param group {index} must be a dict with a 'params' list")
            located = []
            for param in group["params"]:
                buffer = next((b for b in ddp.param_and_grad_buffers if param in b), None)
                if buffer is None:
                    raise ValueError(
                        f"ShardedStage: a parameter of shape {tuple(param.shape)} in param group {index} is "
                        "not a trainable parameter of the DataParallel-wrapped module; build the groups "
                        "from ddp.module.named_parameters()")
                name = buffer.name_of(param)
                if buffer.key.is_expert != self._expert:
                    kind = "an expert" if buffer.key.is_expert else "a dense"
                    raise ValueError(
                        f"ShardedStage(expert={self._expert}): {name!r} is {kind} parameter; put dense and "
                        "expert (allreduce=False) parameters in separate stages")
                if id(param) in seen:
                    raise ValueError(f"ShardedStage: parameter {name!r} appears twice in param_groups")
                seen.add(id(param))
                located.append((name, param, buffer))
            out.append(located)
        return out

    def _build_pieces(
        self, param_groups: Sequence[dict[str, Any]],
        located: list[list[tuple[str, nn.Parameter, ParamAndGradBuffer]]],
    ) -> tuple[list[dict[str, Any]], list[_Piece], list[list[torch.Tensor]]]:
        rank = self._comm.rank
        inner_groups, pieces, group_masters = [], [], []
        for group, members in zip(param_groups, located, strict=True):
            owned = []
            for name, param, buffer in members:
                slot = buffer.slot_of(param)
                parts = buffer.layout.owned_slices(slot.bucket, rank)
                part = next((s for s in parts if s.name == name), None)
                if part is not None:
                    at = slice(part.buffer_start, part.buffer_start + part.numel)
                    owned.append((name, param, part, buffer.param_data[at], buffer.grad_data[at]))
            # Masters of one group lie back to back, so the inner kernels step a run of them in one call.
            low = [o for o in owned if o[1].dtype in _LOW_PRECISION]
            flat = torch.empty(sum(o[2].numel for o in low), dtype=torch.float32, device=self._device)
            masters = list(flat.split([o[2].numel for o in low]))
            with torch.no_grad():
                for master, o in zip(masters, low, strict=True):
                    master.copy_(o[3])
            by_name = {o[0]: m for o, m in zip(low, masters, strict=True)}
            group_pieces = [
                _Piece(name, param, part.param_start, part.param_end, by_name.get(name, model_view),
                       model_view, grad_view)
                for name, param, part, model_view, grad_view in owned
            ]
            pieces += group_pieces
            group_masters.append(masters)
            inner_groups.append({**group, "params": [p.inner for p in group_pieces],
                                 "param_names": [p.name for p in group_pieces]})
        return inner_groups, pieces, group_masters

    # -- Stage protocol ------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (it only sees this rank's pieces)."""
        return self._optimizer

    @property
    def comm(self) -> Comm | NullComm:
        """The group the buckets are sharded over (data-parallel, or expert data-parallel)."""
        return self._comm

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters of this rank's pieces of bf16/fp16 parameters, in group order."""
        return [p.inner for p in self._pieces if p.has_master]

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight (the model then holds the full parameters)."""
        for gather in self._pending:
            gather.wait()
        self._pending = []

    def prepare_grads(self, inv_scale: float) -> bool:
        self.finish_param_sync()
        found = torch.zeros(1, dtype=torch.float32, device=self._device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=self._device)
        for grads in self._load_grads().values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        self._reduce.all_reduce(found, op="max")
        return bool(found.item() > 0)

    def _load_grads(self) -> dict[torch.dtype, list[torch.Tensor]]:
        """Point every piece's ``.grad`` at its owned gradient (copied to fp32 when the buffer is not);
        returns those gradients by dtype."""
        if self._piece_grads is None:  # the fp32 copies are allocated on first use
            # fp32 gradients lying back to back where the pieces do, so the inner kernels step runs
            self._grad_copies = zeros_in_runs([p.inner for p in self._copied])
            copies = iter(self._grad_copies)
            self._piece_grads = [next(copies) if p.grad_view.dtype != p.inner.dtype else p.grad_view
                                 for p in self._pieces]
            for grad in self._piece_grads:
                self._grads_by_dtype.setdefault(grad.dtype, []).append(grad)
        if self._copied:
            torch._foreach_copy_(self._grad_copies, [p.grad_view for p in self._copied])
        for piece, grad in zip(self._pieces, self._piece_grads, strict=True):
            piece.inner.grad = grad
        return self._grads_by_dtype

    def _ready_grads(self) -> list[torch.Tensor]:
        return [p.inner.grad for p in self._pieces if p.inner.grad is not None]

    def grad_norm_sq(self, norm_type: float) -> torch.Tensor:
        grads = [p.inner.grad for p in self._pieces]
        return reduced_norm_pow(self._model_params, grads, norm_type, tp_rank=self._tp_rank, device=self._device,
                                comm=self._reduce)

    def count_zeros(self) -> int:
        grads = [p.inner.grad for p in self._pieces]
        return reduced_zero_count(self._model_params, grads, tp_rank=self._tp_rank, device=self._device,
                                  comm=self._reduce)

    def scale_grads(self, factor: float) -> None:
        grads = self._ready_grads()
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)

    def step_with_ready_grads(self) -> None:
        self.finish_param_sync()
        self._optimizer.step()
        self._publish(wait=not self._overlap)

    def _publish(self, *, wait: bool) -> None:
        """Round the masters into the parameter buffer, then gather every rank's range to every rank
        (collective); without ``wait`` the gathers are left in flight (``finish_param_sync``)."""
        with phase("publish_params"):
            if self._publish_to:
                with torch.no_grad():
                    torch._foreach_copy_(self._publish_to, self._publish_from)
        with phase("param_gather"):
            for gather in self._gathers:
                gather.launch()
            self._pending = list(self._gathers)
            if wait:
                self.finish_param_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the pieces' gradients. The model's gradients live in ``ddp``'s buffers: zero them with
        ``ddp.zero_grad_buffer()``."""
        for piece in self._pieces:
            if set_to_none:
                piece.inner.grad = None
            elif piece.inner.grad is not None:
                piece.inner.grad.zero_()

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``{"kind", "shard": (rank, size), "optimizer": the inner optimizer's state
        dict (over the pieces), "fp32_masters": per group, the masters of its bf16/fp16 pieces}``. Tensors
        are references. It loads only into the same rank of the same layout; ``param_shards`` is the
        name-keyed form that can be resharded."""
        self.finish_param_sync()
        return {"kind": self.kind, "shard": (self._comm.rank, self._comm.size),
                "optimizer": self._optimizer.state_dict(),
                "fp32_masters": [list(masters) for masters in self._group_masters]}

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the difference when ``state_dict`` does not fit this rank's stage."""
        if not isinstance(state_dict, dict) or state_dict.get("kind") != self.kind:
            got = state_dict.get("kind") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"ShardedStage: state dict is for a {got!r} stage, this stage is {self.kind!r}")
        here = (self._comm.rank, self._comm.size)
        if tuple(state_dict.get("shard", ())) != here:
            raise ValueError(
                f"ShardedStage: state dict was saved by shard {state_dict.get('shard')} (rank, size), this "
                f"is {here}; load a different data-parallel size through a checkpoint (param_shards) instead")
        saved = state_dict.get("optimizer")
        if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
            raise ValueError("ShardedStage: state dict needs an 'optimizer' entry with 'state' and "
                             "'param_groups'")
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        ours = [len(g["params"]) for g in self._optimizer.param_groups]
        if sizes != ours:
            raise ValueError(f"ShardedStage: saved groups hold {sizes} pieces, this stage's {ours}")
        masters = state_dict.get("fp32_masters")
        shapes = [[tuple(m.shape) for m in group] for group in self._group_masters]
        if not isinstance(masters, list) or [[tuple(m.shape) for m in g] for g in masters] != shapes:
            raise ValueError(f"ShardedStage: 'fp32_masters' must have shapes {shapes} (per group)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned on this rank (masters and optimizer state; the model
        parameters are the model checkpoint's business)."""
        self.validate_state_dict(state_dict)
        self.finish_param_sync()
        self._optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for theirs, mine in zip(state_dict["fp32_masters"], self._group_masters, strict=True):
                for value, master in zip(theirs, mine, strict=True):
                    master.copy_(value)

    def _held(self) -> list[Held]:
        return [Held(p.name, tuple(p.param.shape), p.start, p.end) for p in self._pieces]

    def param_shards(self) -> dict[str, ParamShard]:
        """Per parameter name, this rank's range ``[start, end)`` of it: ``"param"`` (the fp32 master, or the
        fp32 parameter itself) and every element-wise optimizer state tensor (flat views, references);
        scalar state (e.g. ``"step"``) as it is. Parameters this rank owns nothing of are absent."""
        self.finish_param_sync()
        return shards_of(self._optimizer, self._held())

    def load_param_shards(self, shards: Mapping[str, ParamShard]) -> None:
        """Load name-keyed state (see ``Stage.load_param_shards``). Each shard must cover this rank's range
        of its parameter (a whole parameter always does); this rank's part is cut out and copied. Then, as
        after a step, the masters are rounded into the parameter buffer and the parameters are gathered
        (collective: every rank of the stage calls it, with shards that fit, as a checkpoint checks first),
        so every rank's model holds the loaded values.

        Raises:
            ValueError: a parameter this rank owns is missing, or a range does not cover this rank's part;
                nothing is changed then.
        """
        self.finish_param_sync()
        load_into("ShardedStage", self._optimizer, self._held(), shards)
        self._publish(wait=True)
