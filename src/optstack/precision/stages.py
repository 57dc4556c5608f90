"""The precision stages: FP32 (gradients used as they are) and mixed precision (fp32 master weights).

Each stage wraps one inner ``torch.optim.Optimizer`` and implements the ``Stage`` phases the chained
optimizer sequences: make the inner optimizer's ``.grad`` ready (copy to masters, unscale, one fused
non-finite check agreed over the model-parallel group), report this stage's share of the global grad norm,
scale for clipping, step, and publish the result to the model parameters.

Where gradients come from is injected (``grad_of``): ``p.grad`` by default, a grad-buffer view when a
data-parallel wrapper owns the gradients. The stage never knows whether it sees whole parameters or shards.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from optstack.clip import AllReduce, reduced_norm_pow, reduced_zero_count
from optstack.distributed.comm import Comm, NullComm
from optstack.param_shards import Held, load_into, shards_of
from optstack.precision.state_checks import check_masters, check_optimizer_state
from optstack.protocol import MakeOptimizer, ParamShard, Stage, phase

__all__ = ["FP32Stage", "MixedPrecisionStage", "GradOf"]

GradOf = Callable[[torch.Tensor], "torch.Tensor | None"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _grad_attr(param: torch.Tensor) -> torch.Tensor | None:
    return param.grad


def _copy_groups(param_groups: Sequence[dict[str, Any]], owner: str) -> list[dict[str, Any]]:
    """Shallow copies of the caller's groups (torch.optim writes defaults into the dicts it is given),
    after checking every group has a list of distinct floating-point tensors."""
    if isinstance(param_groups, dict) or not isinstance(param_groups, Sequence):
        raise ValueError(
            f"{owner}: param_groups must be a list of group dicts, got {type(param_groups).__name__}"
        )
    seen: set[int] = set()
    copies = []
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(
                f"{owner}: param group {index} must be a dict with a 'params' list, got {group!r:.80}"
            )
        params = list(group["params"])
        names = group.get("param_names")
        if names is not None and len(names) != len(params):
            raise ValueError(
                f"{owner}: param group {index} has {len(params)} params but {len(names)} param_names"
            )
        for position, param in enumerate(params):
            name = names[position] if names is not None else f"group {index} param {position}"
            if not isinstance(param, torch.Tensor) or not param.is_floating_point():
                raise ValueError(
                    f"{owner}: parameter {name!r} must be a floating-point tensor, got {param!r:.80}"
                )
            if id(param) in seen:
                raise ValueError(
                    f"{owner}: parameter {name!r} appears twice in param_groups; give each param once"
                )
            seen.add(id(param))
        copies.append({**group, "params": params})
    return copies


def _check_and_unscale(
    grads: list[torch.Tensor], inv_scale: float, comm: Comm | NullComm, device: torch.device
) -> bool:
    """Multiply ``grads`` in place by ``inv_scale`` and say whether any element is non-finite, agreed over
    ``comm`` (every rank calls the all-reduce, even with no gradients)."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        buckets.setdefault((grad.device, grad.dtype), []).append(grad)
    for (grad_device, _), bucket in buckets.items():
        flag = torch.zeros(1, dtype=torch.float32, device=grad_device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=grad_device)
        torch._amp_foreach_non_finite_check_and_unscale_(bucket, flag, inv)
        found = torch.maximum(found, flag.to(device))
    comm.all_reduce(found, op="max")
    return bool(found.item() > 0)


def _clear_grads(tensors: Sequence[torch.Tensor], set_to_none: bool) -> None:
    with_grad = [t for t in tensors if t.grad is not None]
    if set_to_none:
        for tensor in with_grad:
            tensor.grad = None
        return
    for tensor in with_grad:
        if tensor.grad.grad_fn is not None:
            tensor.grad.detach_()
        else:
            tensor.grad.requires_grad_(False)
    if with_grad:
        torch._foreach_zero_([t.grad for t in with_grad])


class _InnerOptimizerStage(Stage):
    """What both precision stages share: the inner optimizer, the norm/zero/clip phases and state checks.

    ``self._model_params[i]`` is the model parameter behind the inner optimizer's i-th parameter (in group
    order); ``self._inner_params[i]`` is that inner parameter (the model param itself, or its fp32 master).
    """

    kind = "abstract"

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        make_optimizer: MakeOptimizer,
        *,
        grad_of: GradOf | None = None,
        norm_comm: AllReduce | None = None,
        tp_rank: int = 0,
        device: torch.device | None = None,
    ) -> None:
        owner = type(self).__name__
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
            raise ValueError(f"{owner}: tp_rank must be an int >= 0, got {tp_rank!r}")
        groups = _copy_groups(param_groups, owner)
        self._grad_of: GradOf = grad_of if grad_of is not None else _grad_attr
        self._comm = norm_comm if norm_comm is not None else NullComm()
        self._tp_rank = tp_rank
        self._model_params = [p for group in groups for p in group["params"]]
        self._names = [
            group["param_names"][j] if group.get("param_names") is not None else f"group {i} param {j}"
            for i, group in enumerate(groups)
            for j in range(len(group["params"]))
        ]
        inner_groups = self._make_inner_groups(groups)
        optimizer = make_optimizer(inner_groups)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"{owner}: make_optimizer must return a torch.optim.Optimizer, got {optimizer!r:.80}"
            )
        given = [[id(p) for p in g["params"]] for g in inner_groups]
        built = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
        if given != built:
            raise ValueError(
                f"{owner}: make_optimizer must build the optimizer over exactly the groups given, in order "
                f"(given {len(given)} groups of sizes {[len(g) for g in given]}, "
                f"built {len(built)} groups of sizes {[len(g) for g in built]})"
            )
        self._optimizer = optimizer
        self._inner_params = [p for group in optimizer.param_groups for p in group["params"]]
        # Where the flag and norm reductions run: the parameters' device, or ``device`` for a stage with no
        # parameters on this rank (NCCL cannot reduce CPU tensors; every rank takes part even when empty).
        fallback = device if device is not None else torch.device("cpu")
        self._device = self._model_params[0].device if self._model_params else fallback

    def _make_inner_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return groups

    def _publish(self) -> None:
        """Make the model parameters reflect the inner optimizer's parameters after a step."""

    # -- Stage protocol ------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (it only ever sees this stage's inner parameters)."""
        return self._optimizer

    def _ready_grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self._inner_params]

    def grad_norm_sq(self, norm_type: float) -> torch.Tensor:
        return reduced_norm_pow(self._model_params, self._ready_grads(), norm_type, tp_rank=self._tp_rank,
                                device=self._device, comm=self._comm)

    def count_zeros(self) -> int:
        return reduced_zero_count(self._model_params, self._ready_grads(), tp_rank=self._tp_rank,
                                  device=self._device, comm=self._comm)

    def scale_grads(self, factor: float) -> None:
        grads = [g for g in self._ready_grads() if g is not None]
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)

    def step_with_ready_grads(self) -> None:
        self._optimizer.step()
        with phase("publish_params"):
            self._publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        masters = [
            inner
            for model, inner in zip(self._model_params, self._inner_params, strict=True)
            if inner is not model
        ]
        _clear_grads(self._model_params, set_to_none)
        _clear_grads(masters, set_to_none)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"kind", "optimizer": the inner optimizer's state_dict}`` (tensors are references, as in
        torch.optim: ``torch.save`` or deep-copy it to keep a snapshot while training goes on)."""
        return {"kind": self.kind, "optimizer": self._optimizer.state_dict()}

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming what differs when ``state_dict`` does not fit this stage (group count,
        group sizes, parameter names, state shapes); change nothing."""
        check_optimizer_state(type(self).__name__, self.kind, state_dict, self._optimizer,
                              self._inner_params, self._names)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load after validating everything; on a mismatch raise ``ValueError`` and leave the stage as it was.
        The state is copied, so the caller's tensors are never aliased."""
        self.validate_state_dict(state_dict)
        self._load_validated(state_dict)

    def _load_validated(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(copy.deepcopy(state_dict["optimizer"]))

    # -- name-keyed state (checkpoints) ---------------------------------------------------------------
    def _held(self) -> list[Held]:
        return [Held(name, tuple(model.shape), 0, model.numel())
                for name, model in zip(self._names, self._model_params, strict=True)]

    def param_shards(self) -> dict[str, ParamShard]:
        """Every parameter whole (``start=0``, ``end=numel``): ``"param"`` is the fp32 master (the parameter
        itself when it is stepped directly), then each element-wise state tensor; the rest (``step``) as
        scalars. Tensors are flat views of the live ones."""
        return shards_of(self._optimizer, self._held())

    def load_param_shards(self, shards: Mapping[str, ParamShard]) -> None:
        """Load whole-parameter ``ParamShard``s (see ``Stage.load_param_shards``): the inner optimizer's state
        is replaced (created when it did not exist yet), ``"param"`` is copied into the masters (into the
        model parameters stepped directly) and the masters are rounded into the model parameters, as after
        a step. Everything is checked before anything changes."""
        load_into(type(self).__name__, self._optimizer, self._held(), shards)
        self._publish()


class FP32Stage(_InnerOptimizerStage):
    """The inner optimizer steps the model parameters themselves; gradients are used as they are.

    Args:
        param_groups: group dicts over model parameters (``params``, ``param_names``, any settings).
        make_optimizer: builds the inner optimizer over the groups it is given (copies of ``param_groups``).
        grad_of: the model gradient of a parameter (default ``p.grad``); when it returns another tensor
            (e.g. a grad-buffer view) that tensor becomes ``p.grad``.
        norm_comm: the model-parallel group the grad norm and the inf check are reduced over.
        tp_rank: this rank's tensor-parallel rank (tensor-parallel duplicates count on rank 0 only).
        device: where a stage with no parameters on this rank runs its reductions (default CPU; pass the
            model's device under NCCL).
    """

    kind = "fp32"

    def prepare_grads(self, inv_scale: float) -> bool:
        grads = []
        for param in self._model_params:
            grad = self._grad_of(param)
            if grad is not param.grad:
                param.grad = grad
            if grad is not None:
                grads.append(grad)
        return _check_and_unscale(grads, inv_scale, self._comm, self._device)


class MixedPrecisionStage(_InnerOptimizerStage):
    """bf16/fp16 model parameters stepped through fp32 master copies.

    Each bf16/fp16 model parameter gets an fp32 master (a new leaf tensor); the inner optimizer sees the
    masters, never the model parameters. fp32 model parameters in the groups are stepped directly (Megatron's
    fp32-from-fp32 groups). Gradients are copied into the masters' fp32 ``.grad`` and unscaled there; after
    the step the masters are rounded back into the model parameters in place (their storage is kept, so
    views such as a parameter buffer stay valid).

    Args: as ``FP32Stage``; ``make_optimizer`` receives the groups with masters in place of bf16/fp16 params
        (all other group keys copied).
    """

    kind = "mixed"

    def _make_inner_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        def inner(param: torch.Tensor) -> torch.Tensor:
            return param.detach().to(torch.float32, copy=True) if param.dtype in _LOW_PRECISION else param

        return [{**group, "params": [inner(p) for p in group["params"]]} for group in groups]

    @functools.cached_property
    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, its fp32 master) for every bf16/fp16 model parameter, in group order."""
        return [(m, i) for m, i in zip(self._model_params, self._inner_params, strict=True) if m is not i]

    @functools.cached_property
    def _group_masters(self) -> list[list[torch.Tensor]]:
        """Per inner group, the masters it holds (fp32 model params stepped directly are not masters)."""
        masters = {id(i) for _, i in self._pairs}
        return [[p for p in g["params"] if id(p) in masters] for g in self._optimizer.param_groups]

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters, in group order (one per bf16/fp16 model parameter)."""
        return [inner for _, inner in self._pairs]

    def prepare_grads(self, inv_scale: float) -> bool:
        ready, copy_to, copy_from = [], [], []
        for model, inner in zip(self._model_params, self._inner_params, strict=True):
            grad = self._grad_of(model)
            if model is inner:  # an fp32 model parameter stepped directly
                if grad is not model.grad:
                    model.grad = grad
            elif grad is None:
                inner.grad = None
            else:
                if inner.grad is None:
                    inner.grad = torch.empty_like(inner)
                copy_to.append(inner.grad)
                copy_from.append(grad)
                grad = inner.grad
            if grad is not None:
                ready.append(grad)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)
        return _check_and_unscale(ready, inv_scale, self._comm, self._device)

    def _publish(self) -> None:
        if self._pairs:
            with torch.no_grad():
                torch._foreach_copy_([m for m, _ in self._pairs], [i for _, i in self._pairs])

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus ``fp32_masters``: per group, the masters of that group's bf16/fp16
        parameters in order (references; ``torch.save`` or deep-copy to snapshot)."""
        return {**super().state_dict(), "fp32_masters": [list(masters) for masters in self._group_masters]}

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().validate_state_dict(state_dict)
        check_masters("MixedPrecisionStage", state_dict.get("fp32_masters"), self._group_masters)

    def _load_validated(self, state_dict: dict[str, Any]) -> None:
        super()._load_validated(state_dict)
        with torch.no_grad():
            for theirs, mine in zip(state_dict["fp32_masters"], self._group_masters, strict=True):
                for value, master in zip(theirs, mine, strict=True):
                    master.copy_(value)
