"""Megatron's separate gradient-norm groups (current main): multi-token-prediction (MTP) gradients clipped by
their own norm.

A parameter whose ``grad_norm_group`` attribute names a registered group (``'mtp'``) is left out of the main
gradient norm (the one ``step()`` returns and the skip threshold reads) and clipped by its group's norm alone.
``GradNormGroups`` carries Megatron's methods for this over ``get_parameters()``, ``config`` and
``get_grad_stats_parallel_group()``; optimizers over core stages hand the groups to the core chain instead
(``norm_group_kwargs``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from optstack.clip import clip_coefficient, counts_toward_norm, norm_pows
from optstack.distributed.comm import Comm, NullComm

__all__ = ["MTP_GRAD_NORM_GROUP", "GRAD_NORM_GROUP_ATTR", "SEPARATE_GRAD_NORM_GROUPS", "GradNormGroups",
           "grad_norm", "clip_by_norm", "clip_by_groups", "norm_group_kwargs", "separate_group_of"]

MTP_GRAD_NORM_GROUP = "mtp"
GRAD_NORM_GROUP_ATTR = "grad_norm_group"
#: The groups with a norm of their own (Megatron's registry; a parameter naming another group is an error).
SEPARATE_GRAD_NORM_GROUPS: tuple[str, ...] = (MTP_GRAD_NORM_GROUP,)


def _get_param_grad_norm_group(param: torch.Tensor) -> str | None:
    return getattr(param, GRAD_NORM_GROUP_ATTR, None)


def _validate_grad_norm_group(grad_norm_group: str) -> None:
    if grad_norm_group not in SEPARATE_GRAD_NORM_GROUPS:
        raise ValueError(f"Unknown grad_norm_group '{grad_norm_group}'. Register it in SEPARATE_GRAD_NORM_GROUPS "
                         f"({list(SEPARATE_GRAD_NORM_GROUPS)}) before tagging parameters with it.")


def _comm(group: Any) -> Comm | NullComm:
    """None (Megatron's model-parallel group, one rank without tensor or pipeline parallelism): this rank."""
    return NullComm() if group is None or group.size() == 1 else Comm(group, name="grad_stats")


def grad_norm(grads: Sequence[torch.Tensor], group: Any) -> float:
    """The L2 norm of ``grads`` across ``group`` (fp32), Megatron's ``get_grad_norm_fp32``."""
    device = grads[0].device if grads else torch.device("cpu")
    total = norm_pows(list(grads), 2.0, device).sum().reshape(1)  # [0.] without gradients
    return math.sqrt(float(_comm(group).all_reduce(total).item()))


def clip_by_norm(params: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale the parameters' gradients by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    grads = [p.grad for p in params if p.grad is not None]
    coeff = clip_coefficient(total_norm, max_norm)
    if grads and coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


def clip_by_groups(params: Iterable[torch.Tensor], clip_grad: float, main_norm: float,
                   norms_by_group: dict[str, float]) -> None:
    """Clip each parameter's gradient by its separate group's norm in ``norms_by_group`` (none there: left
    alone), or by ``main_norm`` outside a separate group."""
    by_group: dict[str | None, list[torch.Tensor]] = {}
    for p in params:
        by_group.setdefault(separate_group_of(p), []).append(p)
    for group, members in by_group.items():
        total = main_norm if group is None else norms_by_group.get(group)
        if total is not None:
            clip_by_norm(members, clip_grad, total)


def separate_group_of(param: torch.Tensor) -> str | None:
    """The separate gradient-norm group of ``param`` (None: the main norm); an unregistered name is a
    ``ValueError``. The core chain's ``norm_group_of`` for Megatron models."""
    group = _get_param_grad_norm_group(param)
    if group is not None:
        _validate_grad_norm_group(group)
    return group


def norm_group_kwargs(params: Iterable[torch.Tensor]) -> dict[str, Any]:
    """The core ``ChainedOptimizer``'s norm-group arguments for ``params``: Megatron's registered groups when
    some parameter is tagged (tags are set when the model is built, the same on every data-parallel rank),
    else none (the step is the plain one)."""
    if any(separate_group_of(p) is not None for p in params):
        return {"norm_groups": SEPARATE_GRAD_NORM_GROUPS, "norm_group_of": separate_group_of}
    return {}


class GradNormGroups:
    """Megatron's gradient-norm methods over ``get_parameters()``, ``config`` and the grad-stats group.

    Attributes:
        grad_norms_by_group: ``{group: norm}`` of the last ``clip_grad_norm`` / chained step.
    """

    grad_norms_by_group: dict[str, float]
    get_parameters: Callable[[], list[torch.Tensor]]

    def get_grad_stats_parallel_group(self) -> Any:
        """The group gradient statistics are reduced over: ``grad_stats_parallel_group`` when set, else None
        (Megatron's model-parallel group: this rank alone, as optstack has no tensor or pipeline parallelism)."""
        return getattr(self, "grad_stats_parallel_group", None)

    def _filter_grads_for_norm(self, params: list[torch.Tensor],
                               param_filter: Callable[[torch.Tensor], bool] | None = None) -> list[torch.Tensor]:
        """The gradients that count toward a norm: present, passing ``param_filter``, not ``shared``."""
        return [p.grad for p in params if (param_filter is None or param_filter(p)) and p.grad is not None
                and counts_toward_norm(p, tp_rank=0)]

    def get_grads_for_grad_norm(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
        """The main norm's gradients (None: every parameter outside a separate group), or one group's."""
        if grad_norm_group is not None:
            _validate_grad_norm_group(grad_norm_group)
            return self._filter_grads_for_norm(
                self.get_parameters(), lambda p: _get_param_grad_norm_group(p) == grad_norm_group)
        return self._filter_grads_for_norm(self.get_parameters(), lambda p: separate_group_of(p) is None)

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any rank of the grad-stats group holds parameters of ``grad_norm_group`` (one reduction,
        then cached: tags are set when the model is built)."""
        _validate_grad_norm_group(grad_norm_group)
        cache = vars(self).setdefault("_has_grad_norm_group_cache", {})
        if grad_norm_group not in cache:
            local = any(separate_group_of(p) == grad_norm_group for p in self.get_parameters())
            flag = _comm(self.get_grad_stats_parallel_group()).all_reduce(torch.tensor([int(local)]), op="max")
            cache[grad_norm_group] = bool(flag.item() > 0)
        return cache[grad_norm_group]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The main gradient norm (separate groups left out)."""
        return grad_norm(self.get_grads_for_grad_norm(), self.get_grad_stats_parallel_group())

    @torch.no_grad()
    def _get_grad_norm_for_group(self, grad_norm_group: str) -> float:
        return grad_norm(self.get_grads_for_grad_norm(grad_norm_group), self.get_grad_stats_parallel_group())

    @torch.no_grad()
    def _compute_grad_norms_by_group(self) -> dict[str, float]:
        # not through _get_grad_norm_for_group: Megatron's tests copy this method onto mocks without that one
        self.grad_norms_by_group = {
            name: grad_norm(self.get_grads_for_grad_norm(name), self.get_grad_stats_parallel_group())
            for name in SEPARATE_GRAD_NORM_GROUPS if self.has_grad_norm_group(name)}
        return self.grad_norms_by_group

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the main gradients by the main norm and each separate group's by its own; returns the main norm."""
        self.grad_norms_by_group = {}
        params = self.get_parameters()
        norm = grad_norm(self.get_grads_for_grad_norm() if params else [], self.get_grad_stats_parallel_group())
        if clip_grad > 0.0 and params:
            clip_by_groups(params, clip_grad, norm, self._compute_grad_norms_by_group())
        return norm
