"""The shell of the torch-style constructors: torch.optim's ``params`` argument (tensors, ``(name, tensor)``
pairs or param-group dicts) read with torch's checks and messages into the groups of one replicated stage. Each
class adds its constructor: its hyperparameters checked as torch checks them, its ``defaults``, and ``make``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from optstack.optimizer import ChainedOptimizer
from optstack.protocol import MakeOptimizer, StepResult
from optstack.stage import replicated_stage
from optstack.torch_state import is_placeholder_name

__all__ = ["TorchStyleOptimizer", "check_lr", "impl_of", "refuse_unsupported", "with_group_defaults"]


def impl_of(owner: str, foreach: bool | None, fused: bool | None, *, has_fused: bool = True) -> str:
    """optstack's kernel choice for torch's ``foreach`` / ``fused`` flags: ``fused=True`` the fused kernel
    (where the algorithm has one; else the hint falls back to ``auto``), ``foreach=True`` the multi-tensor path,
    ``foreach=False`` the single-tensor reference (torch's for-loop), neither ``auto`` (fused on CPU and CUDA).

    Raises:
        RuntimeError: both True (torch's error).
    """
    if fused and foreach:
        raise RuntimeError(f"{owner}: `fused` and `foreach` cannot be `True` together; pass one of them")
    if fused:
        return "fused" if has_fused else "auto"
    if foreach:
        return "foreach"
    return "reference" if foreach is False else "auto"


def check_lr(owner: str, lr: Any, *, foreach: bool | None = None, message: str = "Invalid learning rate: {}") -> None:
    """torch's checks of ``lr`` (a number, or a 1-element tensor) with torch's messages and types."""
    if isinstance(lr, torch.Tensor):
        if foreach:
            raise ValueError(f"{owner}: lr as a Tensor is not supported for capturable=False and foreach=True "
                             "(as in torch); pass a float lr, or foreach=None")
        if lr.numel() != 1:
            raise ValueError(f"{owner}: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    if not 0.0 <= lr:
        raise ValueError(f"{message.format(lr)} ({owner}: lr must be >= 0)")


def refuse_unsupported(owner: str, *, capturable: bool = False, differentiable: bool = False) -> None:
    """optstack refuses torch's CUDA-graph and autograd-through-the-step modes (README: what differs)."""
    if capturable:
        raise ValueError(f"{owner}: capturable=True is not supported: optstack's step reads the step count and "
                         "the global grad norm on the host (CUDA graphs cannot capture it); pass capturable=False")
    if differentiable:
        raise ValueError(f"{owner}: differentiable=True is not supported: optstack steps parameters in place under "
                         "no_grad (masters, fused kernels); pass differentiable=False, or use torch.optim's class "
                         "to differentiate through the step")


def _groups(params: Any, owner: str) -> list[dict[str, Any]]:
    """torch.optim's reading of ``params``: one group dict per group (copies), ``param_names`` from
    ``(name, tensor)`` pairs; torch's errors and duplicate warning."""
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable) or isinstance(params, (str, Mapping)):
        raise TypeError(f"params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)} ({owner}: pass [tensor] or model.parameters())")
    given = list(params)
    if not given:
        raise ValueError(f"optimizer got an empty parameter list ({owner}: pass model.parameters())")
    if not isinstance(given[0], dict):
        given = [{"params": given}]
    return [dict(group) for group in given]


class TorchStyleOptimizer(ChainedOptimizer):
    """A ``ChainedOptimizer`` of one replicated stage built from torch.optim's arguments.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts (any key of ``defaults`` per group).
        defaults: torch's ``defaults`` of the class (filled into each group that lacks a key).
        make: builds the inner optstack algorithm over the stage's groups.
    """

    def __init__(self, params: Any, defaults: dict[str, Any], make: MakeOptimizer) -> None:
        owner = f"optstack.optim.{type(self).__name__}"
        groups: list[dict[str, Any]] = []
        named: list[bool] = []
        seen: set[int] = set()
        for given in _groups(params, owner):
            group, is_named = _torch_group(given, defaults, named, sum(len(g["params"]) for g in groups), seen, owner)
            groups.append(group)
            named.append(is_named)
        super().__init__([replicated_stage(groups, make)], defaults=defaults)

    __repr__ = torch.optim.Optimizer.__repr__  # torch's: the class and each group's settings

    def _step(self) -> StepResult:
        if self.defaults.get("fused"):  # torch's check, before anything reads the gradients
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

            supported = _get_fused_kernels_supported_devices()
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None and (param.device.type not in supported
                                                   or not param.is_floating_point()):
                        raise RuntimeError(
                            "`fused=True` requires all the params to be floating point Tensors of supported "
                            f"devices: {list(supported)} but got {param.device.type} / {param.dtype} "
                            f"(optstack.optim.{type(self).__name__}: move the model there, e.g. "
                            "model.to_empty(device=...) for a meta model, or pass fused=None)")
        if any(stage.device.type == "meta" for stage in self._stages):
            # a model built on the meta device: no numbers to step (torch's optimizers skip the step too when no
            # parameter has a gradient; with gradients on meta tensors there is nothing to compute)
            if any(p.grad is not None for g in self.param_groups for p in g["params"]):
                raise RuntimeError(f"optstack.optim.{type(self).__name__}: the parameters are on the meta device "
                                   "(no values to step); materialise the model (model.to_empty(device=...)) and "
                                   "build the optimizer over its parameters")
            return StepResult(applied=False, grad_norm=None, num_zeros=None, loss_scale=self._scaler.scale)
        return super()._step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``: its checks and defaults, then optstack's (the new parameters join the
        one stage)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
        owner = f"optstack.optim.{type(self).__name__}"
        named = [not all(is_placeholder_name(n) for n in g.get("param_names") or []) for g in self.param_groups]
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        start = sum(len(g["params"]) for g in self.param_groups)
        group, _ = _torch_group(param_group, self.defaults, named, start, seen, owner)
        super().add_param_group(group)


def _torch_group(group: dict[str, Any], defaults: Mapping[str, Any], earlier_named: list[bool], start: int,
                 seen: set[int], owner: str) -> tuple[dict[str, Any], bool]:
    """One group as torch's ``add_param_group`` reads it (its checks, messages and warning) and whether its
    parameters are named; parameters listed twice are kept once, unnamed ones get placeholder names
    (``param.<position>``, ``start`` counting the parameters of earlier groups)."""
    params = group.get("params")
    if params is None:
        raise ValueError(f"{owner}: a param group must have 'params', got keys {sorted(group)}")
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    params = list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    names = [p[0] for p in params] if params and all(named) else None
    tensors = [p[1] for p in params] if names is not None else params
    if "param_names" in group and names is None:
        names = list(group["param_names"])
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is "
                            f"{torch.typename(tensor)}")
        if not (tensor.is_leaf or tensor.retains_grad):
            raise ValueError("can't optimize a non-leaf Tensor")
        if tensor.is_complex():
            raise ValueError(f"{owner}: a parameter is {tensor.dtype}; optstack steps real tensors only. Pass "
                             "torch.view_as_real(p) of a complex parameter (the same update, element-wise)")
    for other in earlier_named:
        if other != (names is not None):
            what = "with names" if names is not None else "without names"
            raise ValueError("all optimizer param groups should be with/without names. "
                             f"cannot add param group {what} to the optimizer")
    if len({id(t) for t in tensors}) != len(tensors):
        warnings.warn("optimizer contains a parameter group with duplicate parameters; in future, this will "
                      "cause an error; see github.com/pytorch/pytorch/issues/40967 for more information "
                      "(optstack keeps each parameter once)", UserWarning, stacklevel=4)
        keep = {id(t): i for i, t in reversed(list(enumerate(tensors)))}
        firsts = sorted(keep.values())
        tensors = [tensors[i] for i in firsts]
        names = [names[i] for i in firsts] if names is not None else None
    if any(id(t) in seen for t in tensors):
        raise ValueError("some parameters appear in more than one parameter group")
    seen.update(id(t) for t in tensors)
    out = {**defaults, **{k: v for k, v in group.items() if k not in ("params", "param_names")}}
    placeholders = [f"param.{start + i}" for i in range(len(tensors))]
    return out | {"params": tensors, "param_names": names if names is not None else placeholders}, names is not None


def with_group_defaults(make: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> MakeOptimizer:
    """A ``MakeOptimizer`` calling ``make(groups, **kwargs)``."""
    return lambda groups: make(groups, **kwargs)
