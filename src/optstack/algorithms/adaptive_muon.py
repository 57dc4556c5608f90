"""Adaptive Muon: Muon with a second moment of the orthogonalised update (NorMuon, AdaMuon), for the same
matrices as Muon (2-D weights, 3-D stacks of same-shaped matrices, each matrix on its own).

Per matrix ``p`` with gradient ``g``, momentum buffer ``m`` and second moment ``v`` (state ``"momentum_buffer"``
and ``"moment2_buffer"``, zeros at first), as Megatron's ``TensorParallelAdaptiveMuon`` (NVIDIA
Emerging-Optimizers' ``AdaptiveMuon``) and microsoft/dion's ``NorMuon``::

    m  = momentum * m + (1 - momentum) * g             # Muon's EMA, nesterov look-ahead as Muon
    u  = (1 - momentum) * g + momentum * m  if nesterov else m
    o  = NS(sign(u))  if adamuon and sign_stabilised else NS(u)
    v  = beta2 * v + (1 - beta2) * mean_row(o**2)      # normuon: one value per row, v shaped (rows, 1)
    v  = beta2 * v + (1 - beta2) * o**2                # adamuon: element-wise, v shaped like p
    n  = o / (sqrt(v) + eps)
    n  = n * ||o|| / max(||n||, eps)  if preserve_norm  # back to the orthogonalised update's RMS (dion)
    p  = p * (1 - lr * weight_decay)
    p  = p - lr * extra_scale_factor * scale(rows, cols) * n

``moment2_method="normuon"`` is dion's NorMuon (per-row second moment, Frobenius norm restored);
``"adamuon"`` is AdaMuon (arXiv:2507.11005: element-wise second moment of ``NS(sign(u))``, RMS-aligned).
With ``sign_stabilised=False`` and ``preserve_norm=False``, ``adamuon`` is Megatron's ``moment2_method="adamuon"``.
(Megatron's ``normuon`` averages over the longer dimension and divides by ``sqrt(max(v, eps))`` without the
norm restore; dion's per-row form is the one here.)

The step batches same-shaped matrices (one Newton-Schulz, one normalisation over the stack), equal to
``adaptive_muon_reference`` to fp32 round-off. QKV splitting and tensor-parallel ``blockwise`` / ``distributed``
modes are Muon's only (refused here: the normalisation would have to follow the blocks).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from optstack.algorithms._common import add_checked_group, is_number, require
from optstack.algorithms._orthogonal import MAX_STACK_ELEMENTS, NS_EPS, momentum_updates, stack_chunks
from optstack.algorithms.muon import Muon, ScaleMode, muon_scale_factor
from optstack.algorithms.muon import kwargs_from_config as muon_kwargs_from_config
from optstack.algorithms.newton_schulz import (
    Coefficients,
    MatmulPrecision,
    matmul_precision,
    newton_schulz,
    ns_matmul_dtype,
)

__all__ = ["AdaptiveMuon", "MOMENT2_METHODS", "Moment2Method", "adaptive_muon_reference", "kwargs_from_config"]

Moment2Method = Literal["normuon", "adamuon"]
MOMENT2_METHODS: tuple[str, ...] = ("normuon", "adamuon")
_MAX_STACK_ELEMENTS = MAX_STACK_ELEMENTS  # per module, so a test can make this module's stacks smaller


def _normalise(o: Tensor, v: Tensor, *, method: str, beta2: float, eps: float, preserve_norm: bool) -> Tensor:
    """Update ``v`` (in place) from the orthogonalised ``o`` (one matrix ``(rows, cols)`` or a stack
    ``(n, rows, cols)``) and return ``o`` normalised by it (a fresh tensor)."""
    square = o.square()
    v.lerp_(square.mean(dim=-1, keepdim=True) if method == "normuon" else square, 1 - beta2)
    n = o / v.sqrt().add_(eps)
    if preserve_norm:
        dims = (-2, -1)
        n.mul_(torch.linalg.vector_norm(o, dim=dims, keepdim=True)
               / torch.linalg.vector_norm(n, dim=dims, keepdim=True).clamp_min_(eps))
    return n


def adaptive_muon_reference(param: Tensor, grad: Tensor, momentum_buffer: Tensor, moment2_buffer: Tensor, *,
                            lr: float, momentum: float, nesterov: bool, weight_decay: float, ns_steps: int,
                            coefficients: Coefficients, scale_mode: ScaleMode, extra_scale_factor: float,
                            moment2_method: Moment2Method, beta2: float, eps: float, sign_stabilised: bool,
                            preserve_norm: bool, matmul_dtype: torch.dtype | None = None) -> None:
    """One adaptive Muon step on one ``(rows, cols)`` parameter, in place (``param`` and both buffers): the
    formula of the module docstring, the test oracle. ``moment2_buffer`` is ``(rows, 1)`` for ``normuon``, the
    parameter's shape for ``adamuon``. A ``(batch, rows, cols)`` stack is stepped one matrix at a time."""
    if param.ndim == 3:
        for p, g, m, v in zip(param, grad, momentum_buffer, moment2_buffer, strict=True):
            adaptive_muon_reference(p, g, m, v, lr=lr, momentum=momentum, nesterov=nesterov,
                                    weight_decay=weight_decay, ns_steps=ns_steps, coefficients=coefficients,
                                    scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                                    moment2_method=moment2_method, beta2=beta2, eps=eps,
                                    sign_stabilised=sign_stabilised, preserve_norm=preserve_norm,
                                    matmul_dtype=matmul_dtype)
        return
    momentum_buffer.mul_(momentum).add_(grad, alpha=1 - momentum)
    update = torch.add(grad * (1 - momentum), momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    if moment2_method == "adamuon" and sign_stabilised:
        update = update.sign()
    o = newton_schulz(update, steps=ns_steps, coefficients=coefficients, eps=NS_EPS, matmul_dtype=matmul_dtype)
    n = _normalise(o, moment2_buffer, method=moment2_method, beta2=beta2, eps=eps, preserve_norm=preserve_norm)
    param.mul_(1 - lr * weight_decay)
    param.add_(n, alpha=-lr * extra_scale_factor * muon_scale_factor(param.size(0), param.size(1), scale_mode))


def kwargs_from_config(config: Any) -> dict[str, Any]:
    """``AdaptiveMuon``'s kwargs from an ``OptimizerConfig``: Muon's from its ``muon`` section (momentum,
    Newton-Schulz, scale), the second moment's from its ``adaptive_muon`` section. The registry name fixes
    ``moment2_method`` (``normuon``, ``adamuon``); ``adaptive_muon`` takes it from the section."""
    a = config.adaptive_muon
    muon = {k: v for k, v in muon_kwargs_from_config(config).items() if k != "tp_mode"}  # Muon's only
    return muon | {"moment2_method": a.moment2_method, "beta2": a.beta2, "eps": a.eps,
                   "sign_stabilised": a.sign_stabilised, "preserve_norm": a.preserve_norm}


class AdaptiveMuon(Muon):
    """Muon with a second moment after Newton-Schulz: NorMuon (per row) or AdaMuon (per element).

    Takes Muon's arguments (``tp_mode`` only ``"duplicated"``, no ``qkv_split_shapes``) and, each also a
    per-group key:

    Args:
        moment2_method: ``"normuon"`` (``v`` per row, shape ``(rows, 1)``; ``(batch, rows, 1)`` for a stack) or
            ``"adamuon"`` (``v`` element-wise, the parameter's shape).
        beta2: EMA coefficient of the second moment, in [0, 1).
        eps: added to ``sqrt(v)``, > 0.
        sign_stabilised: ``adamuon`` orthogonalises ``sign(u)`` (AdaMuon's paper); ignored by ``normuon``.
        preserve_norm: rescale the normalised update to the Frobenius norm of ``NS(u)`` (so Muon's scale modes
            keep their meaning).

    State per parameter: ``"momentum_buffer"`` (the param's shape) and ``"moment2_buffer"`` (see above).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 0.02,
                 momentum: float = 0.95, nesterov: bool = False, weight_decay: float = 0.0, *,
                 moment2_method: Moment2Method = "normuon", beta2: float = 0.95, eps: float = 1e-8,
                 sign_stabilised: bool = True, preserve_norm: bool = True, ns_coefficients: Coefficients = "quintic",
                 ns_steps: int = 5, scale_mode: ScaleMode = "spectral", extra_scale_factor: float = 1.0,
                 matmul_precision: MatmulPrecision = "medium", tp_mode: str = "duplicated",
                 **muon: Any) -> None:
        self._adaptive = dict(moment2_method=moment2_method, beta2=beta2, eps=eps, sign_stabilised=sign_stabilised,
                              preserve_norm=preserve_norm)
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         ns_coefficients=ns_coefficients, ns_steps=ns_steps, scale_mode=scale_mode,
                         extra_scale_factor=extra_scale_factor, matmul_precision=matmul_precision,
                         tp_mode=tp_mode, **muon)  # type: ignore[arg-type]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (defaults fill missing keys) after checking Muon's settings and the second moment's.

        Raises:
            ValueError: a bad setting or parameter; the group is not added.
        """
        add_checked_group(self, super().add_param_group, {**self._adaptive, **param_group}, _validate_adaptive)

    def exported_state(self, param: Tensor) -> dict[str, Any]:
        """``self.state[param]`` with a per-row ``moment2_buffer`` spread over its row (element-wise, the
        parameter's shape), the form name-keyed checkpoints shard and reshard; the next step folds a loaded one
        back to one value per row."""
        state = dict(self.state.get(param, {}))
        v = state.get("moment2_buffer")
        if isinstance(v, Tensor) and v.shape != param.shape:
            state["moment2_buffer"] = v.expand(param.shape).contiguous()
        return state

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        method = group["moment2_method"]
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            v = state.get("moment2_buffer")
            if v is None:
                shape = p.shape if method == "adamuon" else (*p.shape[:-1], 1)
                state["moment2_buffer"] = p.new_zeros(shape)
            elif method == "normuon" and v.shape == p.shape:  # loaded in its exported (element-wise) form
                state["moment2_buffer"] = v[..., :1].contiguous()
        updates = momentum_updates([p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
                                   group["momentum"], group["nesterov"])
        if method == "adamuon" and group["sign_stabilised"]:
            updates = [u.sign() for u in updates]
        steps = _normalised_steps(updates, [self.state[p]["moment2_buffer"] for p in params], group)
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])  # a scheduler may write tensors
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_add_(params, steps, alpha=-lr)


def _normalised_steps(updates: list[Tensor], moments: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
    """Each update's scaled, normalised orthogonalisation (``v`` updated in place), the same-shaped matrices of
    the group (2-D updates and the matrices of 3-D ones alike) batched into stacks."""
    by_kind: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = defaultdict(list)
    for i, u in enumerate(updates):
        by_kind[(u.shape[-2:], u.dtype, u.device)].append(i)
    out: list[Tensor] = [torch.empty(0)] * len(updates)
    precision = group["matmul_precision"]
    settings = dict(method=group["moment2_method"], beta2=float(group["beta2"]), eps=float(group["eps"]),
                    preserve_norm=group["preserve_norm"])
    for (shape, _, device), indices in by_kind.items():
        scale = group["extra_scale_factor"] * muon_scale_factor(shape[0], shape[1], group["scale_mode"])
        matmul_dtype = ns_matmul_dtype(precision, device)
        limit = max(1, _MAX_STACK_ELEMENTS // max(1, shape.numel()))
        for chunk in stack_chunks([(i, updates[i]) for i in indices], limit):
            lone = len(chunk) == 1 and chunk[0][1].ndim == 2  # a lone matrix: exactly the reference's kernel
            x = chunk[0][1] if lone else torch.cat([m if m.ndim == 3 else m.unsqueeze(0) for _, m in chunk])
            with matmul_precision(precision, device):
                o = newton_schulz(x, steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=NS_EPS,
                                  matmul_dtype=matmul_dtype)
            # the chunk's second moments, stacked like its matrices (a 3-D update split into parts: their rows)
            counts = [1 if m.ndim == 2 else m.size(0) for _, m in chunk]
            vs = [_part(moments[i], updates[i], m) for i, m in chunk]
            v = vs[0] if lone else torch.cat([t if t.ndim == 3 else t.unsqueeze(0) for t in vs])
            n = _normalise(o, v, **settings).mul_(scale)
            if lone:
                out[chunk[0][0]] = n
                continue
            offset = 0
            for (i, m), target, count in zip(chunk, vs, counts, strict=True):
                piece = n[offset : offset + count] if m.ndim == 3 else n[offset]
                target.copy_(v[offset : offset + count] if m.ndim == 3 else v[offset])
                out[i] = piece if out[i].numel() == 0 else torch.cat([out[i], piece])
                offset += count
    return out


def _part(moment: Tensor, update: Tensor, part: Tensor) -> Tensor:
    """The rows of ``moment`` (a 3-D update's) that go with ``part``, a view of ``update`` split along its batch
    dimension by ``stack_chunks``; the whole ``moment`` for a 2-D update or an unsplit stack."""
    if part.ndim == 2 or part.size(0) == update.size(0):
        return moment
    start = (part.data_ptr() - update.data_ptr()) // (update.stride(0) * update.element_size())
    return moment[start : start + part.size(0)]


def _validate_adaptive(group: dict[str, Any], index: int) -> None:
    """Raise a ValueError naming the group, the field and the allowed values for a bad second-moment setting."""
    where = f"AdaptiveMuon param group {index}"
    method, beta2, eps = group["moment2_method"], group["beta2"], group["eps"]
    require(method in MOMENT2_METHODS, f"{where}: moment2_method must be one of {list(MOMENT2_METHODS)}, "
             f"got {method!r}")
    require(is_number(beta2) and 0.0 <= beta2 < 1.0, f"{where}: beta2 must be in [0, 1), got {beta2!r}")
    require(is_number(eps) and eps > 0, f"{where}: eps must be a number > 0, got {eps!r}")
    for key in ("sign_stabilised", "preserve_norm"):
        require(isinstance(group[key], bool), f"{where}: {key} must be True or False, got {group[key]!r}")
    require(group["qkv_split_shapes"] is None, f"{where}: qkv_split_shapes is Muon's only (the second moment "
             "would have to follow the q/k/v blocks); use algorithm='muon' for fused QKV weights, or leave it None")
    require(group.get("tp_mode", "duplicated") == "duplicated", f"{where}: tp_mode={group.get('tp_mode')!r} is "
             "Muon's only; adaptive Muon orthogonalises whole matrices (tp_mode='duplicated')")
