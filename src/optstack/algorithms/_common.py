"""Shared by the algorithm shells: the per-device step template, hyperparameter checks, the fast-path choice and
flat runs. The kernels are element-wise, so tensors lying back to back in one storage (the flat shard views the
distributed layer hands in) are stepped as one flat tensor: one kernel call instead of one per tensor, whose few
microseconds of overhead dominate for small tensors. ``coalesce`` finds such runs; ``zeros_in_runs`` lays out
new state so that its runs are adjacent too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from itertools import pairwise
from typing import Any, Literal

import torch

__all__ = ["FUSED_DEVICE_TYPES", "Impl", "PerDeviceOptimizer", "check_betas", "check_min", "coalesce", "resolve_impl",
           "copies_in_runs", "is_number", "require", "zeros_in_runs"]

Impl = Literal["auto", "fused", "foreach", "reference"]

# Device types whose fused kernels "auto" calls. On CPU the fused AdamW kernel is ~5x faster than foreach
# (benchmarks/bench_adamw.py); on CUDA it is torch's recommended path. Elsewhere: foreach.
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")


class PerDeviceOptimizer(torch.optim.Optimizer):
    """The shell of AdamW, SGD and Lion: check each group, then step its tensors with a grad, per device.

    Groups are checked when added and again each step (a scheduler may have written them): the ``_checked``
    keys must be numbers >= 0 (``"betas"`` a pair in [0, 1)); subclasses add checks in ``_check_group``.
    Subclasses implement ``_step_device``.
    """

    _name = ""  #: the owner named in errors
    _checked: tuple[str, ...] = ()
    #: ``step(grad_scale=f)`` multiplies every gradient by ``f`` as it is read (the loss-scale and clip
    #: factor of optstack's stages): folded into the kernel where it takes one, else one multiply pass.
    takes_grad_scale = True
    #: the subclass's ``_step_device`` takes ``grad_scale`` itself (its kernel applies it)
    _folds_grad_scale = False

    def __init__(self, params: Any, defaults: dict[str, Any], impl: str,
                 impls: Sequence[str] = ("auto", "fused", "foreach", "reference")) -> None:
        if impl not in impls:
            raise ValueError(f"{self._name}: impl must be one of {', '.join(map(repr, impls))}, got {impl!r}")
        self.impl = impl
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch.optim semantics) and validate its hyperparameters."""
        super().add_param_group(param_group)
        self._check_group(len(self.param_groups) - 1, self.param_groups[-1])

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        for key in self._checked:
            if key == "betas":
                check_betas(self._name, index, group)
            else:
                check_min(self._name, index, group, key)

    def _step_device(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device) -> None:
        """Step ``params`` (all on ``device``, all with a grad) with ``group``'s hyperparameters."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float = 1.0) -> Any:  # type: ignore[override]
        """One step over every tensor with a grad, the gradients multiplied by ``grad_scale``.

        Returns:
            The closure's loss (None without a closure).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.device, []).append(p)
            for device, params in by_device.items():
                if self._folds_grad_scale:
                    self._step_device(group, params, device, grad_scale=grad_scale)  # type: ignore[call-arg]
                    continue
                if grad_scale != 1.0:
                    torch._foreach_mul_([p.grad for p in params], grad_scale)
                self._step_device(group, params, device)
        return loss


def resolve_impl(impl: str, device: torch.device, has_fused: bool) -> str:
    """The concrete path for ``device``: "auto" is "fused" where a fused kernel exists, else "foreach"."""
    if impl != "auto":
        return impl
    return "fused" if has_fused and device.type in FUSED_DEVICE_TYPES else "foreach"


def add_checked_group(optimizer: torch.optim.Optimizer, add: Callable[[dict[str, Any]], None],
                      param_group: dict[str, Any], check: Callable[[dict[str, Any], int], None]) -> None:
    """``add`` (the base class's ``add_param_group``) a copy of ``param_group`` (torch fills defaults into the dict
    it is given; the caller's is theirs), then ``check(group, index)`` it; a group that fails is taken off again,
    so a refused group leaves the optimizer as it was."""
    add(dict(param_group))
    try:
        check(optimizer.param_groups[-1], len(optimizer.param_groups) - 1)
    except ValueError:
        optimizer.param_groups.pop()
        raise


def check_min(owner: str, index: int, group: dict[str, Any], key: str, low: float = 0.0) -> None:
    """Raise a ValueError naming ``owner``, the group and the field unless ``group[key] >= low``."""
    value = group[key]
    value = value.item() if isinstance(value, torch.Tensor) else value
    if not isinstance(value, int | float) or not value >= low:  # `not >=` also catches NaN
        raise ValueError(f"{owner} param group {index}: {key} must be a number >= {low}, got {value!r}")


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok`` (the group checks of the matrix algorithms)."""
    if not ok:
        raise ValueError(message)


def is_number(value: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_betas(owner: str, index: int, group: dict[str, Any]) -> None:
    """Raise a ValueError unless ``group["betas"]`` is a pair of numbers in [0, 1)."""
    betas = group["betas"]
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"{owner} param group {index}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        value = beta.item() if isinstance(beta, torch.Tensor) else beta
        if not isinstance(value, int | float) or not 0.0 <= value < 1.0:
            raise ValueError(f"{owner} param group {index}: betas[{i}] must be in [0, 1), got {beta!r}")


def coalesce(
    lists: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable] | None = None
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Merge runs of back-to-back tensors into flat views, across several aligned lists at once.

    Entries merge when, in every list, each tensor starts where the previous one ends (contiguous, one dtype, one
    storage) and their ``keys`` (e.g. step counts) are equal. Only element-wise kernels may run on the result.

    Args:
        lists: aligned lists (params, grads, state...), all of one length.
        keys: per entry; entries merge only when their keys are equal.

    Returns:
        The merged lists (a run becomes one 1-D view; a lone tensor is returned as it is) and, for each merged
        entry, the index of its first original entry (to pick its step or hyperparameters).
    """
    runs = _runs(lists, keys)
    if len(runs) == len(lists[0]):  # nothing merged: keep the caller's order
        return [list(ts) for ts in lists], list(range(len(runs)))
    merged: list[list[torch.Tensor]] = [[] for _ in lists]
    for run in runs:
        numel = sum(lists[0][i].numel() for i in run)
        for out, ts in zip(merged, lists, strict=True):
            first = ts[run[0]]
            out.append(first if len(run) == 1 else torch.as_strided(first, (numel,), (1,), first.storage_offset()))
    return merged, [run[0] for run in runs]


def zeros_in_runs(params: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Zero state tensors shaped like ``params`` (in ``dtype``, default each param's own); params lying back
    to back get back-to-back state, so ``coalesce`` finds the same runs in state, params and grads."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for run in _runs([params]):
        if len(run) == 1:
            out[run[0]] = torch.zeros_like(params[run[0]], dtype=dtype, memory_format=torch.preserve_format)
            continue
        sizes = [params[i].numel() for i in run]
        flat = params[run[0]].new_zeros(sum(sizes), dtype=dtype)
        for piece, i in zip(flat.split(sizes), run, strict=True):
            out[i] = piece.view(params[i].shape)
    return out


def copies_in_runs(params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (shaped like ``params``) laid out as ``zeros_in_runs`` lays out state: those of params in a
    back-to-back run are copied into one fresh buffer per run; a lone param's tensor is kept when its strides
    match the param's (a loaded copy already), else copied like it."""
    out = list(tensors)
    for run in _runs([params]):
        if len(run) == 1 and tensors[run[0]].stride() == params[run[0]].stride():
            continue
        members = [params[i] for i in run]
        for i, fresh in zip(run, zeros_in_runs(members, tensors[run[0]].dtype), strict=True):
            out[i] = fresh.copy_(tensors[i])
    return out


def _runs(lists: Sequence[Sequence[torch.Tensor]], keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Entry indices grouped into runs that are back to back in every list (see ``coalesce``)."""
    lead = lists[0]
    if len(lead) < 2:
        return [[i] for i in range(len(lead))]
    ptrs = [t.data_ptr() for t in lead]
    order = sorted(range(len(lead)), key=ptrs.__getitem__)
    # Candidates from the lead list's addresses alone (a tensor with no neighbour costs two reads), then
    # checked in full.
    candidates: list[list[int]] = [[order[0]]]
    for j, i in pairwise(order):
        if ptrs[j] + lead[j].nbytes == ptrs[i] and (keys is None or keys[i] == keys[j]):
            candidates[-1].append(i)
        else:
            candidates.append([i])
    return [run for c in candidates for run in (_split_run(c, lists) if len(c) > 1 else [c])]


def _split_run(candidate: list[int], lists: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
    """Split ``candidate`` where any list is not back to back, contiguous and of one dtype."""
    linked = [True] * (len(candidate) - 1)  # linked[k]: entry k+1 follows entry k in every list
    for ts in lists:
        members = [ts[i] for i in candidate]
        ptrs = [t.data_ptr() for t in members]
        dense = [t.is_contiguous() and t.dtype == members[0].dtype for t in members]
        linked = [linked[k] and dense[k] and dense[k + 1] and ptrs[k] + members[k].nbytes == ptrs[k + 1]
                  for k in range(len(linked))]
    runs = [[candidate[0]]]
    for k, i in enumerate(candidate[1:]):
        if linked[k]:
            runs[-1].append(i)
        else:
            runs.append([i])
    # Address arithmetic alone could step from one allocation into the next: a flat view must stay inside
    # one storage, which holds when the run's first and last tensors share it.
    out: list[list[int]] = []
    for run in runs:
        whole = len(run) == 1 or all(_storage(ts[run[0]]) == _storage(ts[run[-1]]) for ts in lists)
        out.extend([run] if whole else [[i] for i in run])
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
