"""Muon: momentum SGD whose update is orthogonalised by Newton-Schulz (``newton_schulz.py``), for matrices: 2-D
weights, and 3-D stacks ``(batch, rows, cols)`` of same-shaped matrices (grouped experts, per-head blocks), each
matrix orthogonalised and scaled on its own (the stack is one batched Newton-Schulz).

Per parameter ``p`` with gradient ``g`` and momentum buffer ``m`` (state ``"momentum_buffer"``, zeros at first),
as Megatron Core / NVIDIA Emerging-Optimizers' ``OrthogonalizedOptimizer``::

    m  = momentum * m + (1 - momentum) * g             # EMA of the gradient
    u  = (1 - momentum) * g + momentum * m  if nesterov else m
    p  = p * (1 - lr * weight_decay)                   # decoupled weight decay
    p  = p - lr * extra_scale_factor * scale(rows, cols) * NS(u)

The EMA form differs from the classic ``m = momentum * m + g`` only by the factor ``1 - momentum``, which
Newton-Schulz's normalisation removes; it is kept so a momentum buffer means what it means in Megatron.

Scale modes (``rows, cols`` the matrix's shape): ``spectral`` ``sqrt(max(rows, cols))`` (Kimi / Moonlight; with
``extra_scale_factor=0.2`` the update RMS matches AdamW's), ``unit_rms_norm`` ``sqrt(rows / cols)`` (Scion),
``shape_scaling`` ``sqrt(max(1, rows / cols))`` (Keller Jordan's Muon); for a 3-D stack, the shape of one matrix.

QKV split (``qkv_split_shapes=(q, k, v)``, as Megatron's ``TensorParallelMuon``): a fused attention weight of
``num_groups`` blocks of ``q + k + v`` rows has its q, k and v rows orthogonalised as three matrices
``(num_groups * q, in)`` etc., each scaled by its own shape (in a 3-D stack, each matrix of the stack is split).
Tensor-parallel matrices (``tp_mode``, Megatron's ``muon_tp_mode``; ``tp_blocks`` names each parameter split by
tensor parallelism and how: ``{name: (dim, parts)}``, set by the placement that holds the whole matrix):
``duplicated`` orthogonalises the whole matrix; ``blockwise`` each of the ``parts`` equal blocks along ``dim`` as a
matrix of its own, scaled by its own shape (then its q, k, v rows when split); ``distributed`` the whole matrix by
Newton-Schulz over the blocks, their Gram products summed (Megatron's tensor-parallel all-reduce, here over the
blocks the owner holds; equal to ``duplicated`` to fp32 round-off).

The step batches same-shaped matrices into one Newton-Schulz (fewer, larger matmuls), equal to the reference to
fp32 round-off.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from optstack.algorithms._common import add_checked_group, check_min, is_number, require
from optstack.algorithms._orthogonal import MAX_STACK_ELEMENTS, NS_EPS, momentum_updates, stack_chunks
from optstack.algorithms.newton_schulz import (
    MATMUL_PRECISIONS,
    Coefficients,
    MatmulPrecision,
    coefficient_schedule,
    matmul_precision,
    newton_schulz,
    ns_matmul_dtype,
)

__all__ = ["Muon", "ScaleMode", "TP_MODES", "TpMode", "kwargs_from_config", "muon_reference", "muon_scale_factor",
           "newton_schulz_blocks", "SCALE_MODES"]

ScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
TpMode = Literal["duplicated", "blockwise", "distributed"]
TP_MODES: tuple[str, ...] = ("duplicated", "blockwise", "distributed")
_SCALES: dict[str, Callable[[int, int], float]] = {
    "spectral": lambda rows, cols: math.sqrt(max(rows, cols)),
    "unit_rms_norm": lambda rows, cols: math.sqrt(rows / cols),
    "shape_scaling": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
}
SCALE_MODES: tuple[str, ...] = tuple(_SCALES)
_MAX_STACK_ELEMENTS = MAX_STACK_ELEMENTS  # per module, so a test can make this module's stacks smaller


def muon_scale_factor(rows: int, cols: int, mode: ScaleMode) -> float:
    """The factor the orthogonalised ``(rows, cols)`` update is multiplied by (before ``extra_scale_factor``).

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in _SCALES:
        raise ValueError(f"unknown Muon scale_mode {mode!r}; expected one of {list(SCALE_MODES)}")
    return _SCALES[mode](rows, cols)


def _qkv_blocks(update: Tensor, shapes: Sequence[int]) -> list[Tensor]:
    """Split a fused ``(..., num_groups * (q + k + v), in)`` matrix (or stack) into its q, k and v matrices
    ``(..., num_groups * q, in)``, ... (copies: the rows of one block are strided across the groups)."""
    *lead, rows, cols = update.shape
    grouped = update.view(*lead, rows // sum(shapes), sum(shapes), cols)
    return [block.reshape(*lead, -1, cols) for block in torch.split(grouped, list(shapes), dim=-2)]


def _merge_qkv(blocks: Sequence[Tensor], shapes: Sequence[int], shape: torch.Size) -> Tensor:
    """Inverse of ``_qkv_blocks``: interleave the q, k, v matrices back into the fused layout."""
    *lead, rows, cols = shape
    return torch.cat([b.view(*lead, rows // sum(shapes), -1, cols) for b in blocks], dim=-2).view(shape)


def muon_reference(param: Tensor, grad: Tensor, momentum_buffer: Tensor, *, lr: float, momentum: float,
                   nesterov: bool, weight_decay: float, ns_steps: int, coefficients: Coefficients,
                   scale_mode: ScaleMode, extra_scale_factor: float,
                   qkv_split_shapes: Sequence[int] | None = None, matmul_dtype: torch.dtype | None = None) -> None:
    """One Muon step on one ``(rows, cols)`` parameter, in place (``momentum_buffer`` and ``param``): the plain
    formula of the module docstring, the test oracle. A ``(batch, rows, cols)`` stack is stepped one matrix at
    a time (views). ``matmul_dtype``: Newton-Schulz's (None: fp32)."""
    if param.ndim == 3:
        for p, g, m in zip(param, grad, momentum_buffer, strict=True):
            muon_reference(p, g, m, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                           ns_steps=ns_steps, coefficients=coefficients, scale_mode=scale_mode,
                           extra_scale_factor=extra_scale_factor, qkv_split_shapes=qkv_split_shapes,
                           matmul_dtype=matmul_dtype)
        return
    momentum_buffer.mul_(momentum).add_(grad, alpha=1 - momentum)
    update = torch.add(grad * (1 - momentum), momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    matrices = [update] if qkv_split_shapes is None else _qkv_blocks(update, qkv_split_shapes)
    orthogonalised = [newton_schulz(m, steps=ns_steps, coefficients=coefficients, eps=NS_EPS,
                                    matmul_dtype=matmul_dtype)
                      * (extra_scale_factor * muon_scale_factor(m.size(0), m.size(1), scale_mode)) for m in matrices]
    step = orthogonalised[0] if qkv_split_shapes is None else _merge_qkv(orthogonalised, qkv_split_shapes, update.shape)
    param.mul_(1 - lr * weight_decay)
    param.add_(step, alpha=-lr)


def kwargs_from_config(config: Any) -> dict[str, Any]:
    """``Muon``'s kwargs from an ``OptimizerConfig``'s ``muon`` section (the registry adds the base ones;
    ``scalar_algorithm`` is read by the routing rule, not by Muon)."""
    m = config.muon
    return {"momentum": m.momentum, "nesterov": m.nesterov, "ns_steps": m.ns_steps,
            "ns_coefficients": m.coefficients, "scale_mode": m.scale_mode,
            "extra_scale_factor": m.extra_scale_factor, "matmul_precision": m.matmul_precision, "tp_mode": m.tp_mode}


def newton_schulz_blocks(blocks: Sequence[Tensor], dim: int, *, steps: int, coefficients: Coefficients,
                         eps: float = NS_EPS, matmul_dtype: torch.dtype | None = None,
                         all_reduce: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """``newton_schulz`` of the matrix the ``(m, n)`` ``blocks`` make when joined along ``dim``, block by block:
    the norm and the Gram products are sums over the blocks (``A = sum X_i X_i^T`` for column blocks, the right
    Gram ``G = sum X_i^T X_i`` with ``X <- a X + X (b G + c G^2)`` for row blocks). Equal to ``newton_schulz`` of
    the joined matrix to round-off. Returns the blocks of the result, in ``blocks``' dtype.

    ``all_reduce``: the blocks are this rank's of a matrix whose other blocks other ranks hold (tensor
    parallelism); each sum over the local blocks is then summed over the ranks by it (one all-reduce per norm and
    per Gram product, in fp32: gloo sums bf16 poorly)."""
    schedule = coefficient_schedule(coefficients, steps)
    work = torch.float32 if matmul_dtype is None else matmul_dtype
    xs = [b.to(torch.float32) for b in blocks]
    norm_sq = torch.stack([torch.linalg.vector_norm(x) ** 2 for x in xs]).sum()
    if all_reduce is not None:
        norm_sq = all_reduce(norm_sq.reshape(1))[0]
    norm = norm_sq.sqrt().clamp_min(eps)
    xs = [(x / norm).to(work) for x in xs]
    for a, b, c in schedule:
        gram = sum(x @ x.mT for x in xs) if dim == 1 else sum(x.mT @ x for x in xs)
        if all_reduce is not None:
            gram = all_reduce(gram.float()).to(work)  # type: ignore[union-attr]
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        xs = [torch.addmm(x, poly, x, beta=a) if dim == 1 else torch.addmm(x, x, poly, beta=a) for x in xs]
    return [x.to(blk.dtype) for x, blk in zip(xs, blocks, strict=True)]


class Muon(torch.optim.Optimizer):
    """Muon for matrices: momentum, decoupled weight decay, Newton-Schulz-orthogonalised update.

    Takes 2-D parameters and 3-D stacks of matrices ``(batch, rows, cols)`` (grouped experts, per-head blocks;
    each matrix orthogonalised and scaled on its own). Defaults are Megatron Core's (``muon_momentum`` etc.).
    Vectors, 4-D and higher tensors (convolution kernels: reshape to 2-D first) and embedding / output weights
    belong to a scalar optimizer (AdamW): route them there with a rule. Every argument below is also a per-group
    key. State per parameter: ``"momentum_buffer"`` (the param's shape and dtype).

    Args:
        params: parameters or param-group dicts (``param_names`` in a group is used in error messages).
        lr: learning rate.
        momentum: EMA coefficient of the momentum buffer, in [0, 1).
        nesterov: use the Nesterov look-ahead ``(1 - momentum) g + momentum m`` instead of ``m``.
        weight_decay: decoupled weight decay: ``p *= 1 - lr * weight_decay`` each step.
        ns_coefficients: Newton-Schulz coefficient set (``"quintic"``, ``"simple"``, ``"polar_express"``) or a
            sequence of ``(a, b, c)`` triples.
        ns_steps: Newton-Schulz iterations (>= 1).
        scale_mode: ``"spectral"``, ``"unit_rms_norm"`` or ``"shape_scaling"`` (see the module docstring).
        extra_scale_factor: multiplies the scale (0.2 with ``"spectral"`` matches AdamW's update RMS).
        tp_mode: ``"duplicated"``, ``"blockwise"`` or ``"distributed"``: how a matrix in ``tp_blocks`` is
            orthogonalised (see the module docstring).
        tp_blocks: ``{param name: (dim, parts)}``: the parameters (by ``param_names``) split by tensor
            parallelism into ``parts`` equal blocks along ``dim`` (0 or 1), None for one split otherwise (only
            ``duplicated`` takes it); set by the DTensor owner placement.
        matmul_precision: the lowest precision Newton-Schulz's matmuls may use: ``"highest"`` (fp32), ``"high"``
            (TF32 on a CUDA GPU, else fp32) or ``"medium"`` (bf16 where the device has native bf16 matmul, else
            fp32; ``newton_schulz.ns_matmul_dtype``).
        qkv_split_shapes: ``(q, k, v)`` rows per attention group; set it only on a group of fused QKV weights.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 0.02, momentum: float = 0.95,
                 nesterov: bool = False, weight_decay: float = 0.0, *, ns_coefficients: Coefficients = "quintic",
                 ns_steps: int = 5, scale_mode: ScaleMode = "spectral", extra_scale_factor: float = 1.0,
                 matmul_precision: MatmulPrecision = "medium",
                 qkv_split_shapes: tuple[int, int, int] | None = None, tp_mode: TpMode = "duplicated",
                 tp_blocks: Mapping[str, tuple[int, int]] | None = None) -> None:
        super().__init__(params, dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_coefficients=ns_coefficients,
            ns_steps=ns_steps, scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
            matmul_precision=matmul_precision, qkv_split_shapes=qkv_split_shapes, tp_mode=tp_mode,
            tp_blocks=tp_blocks))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (defaults fill missing keys) after checking its settings and parameters.

        Raises:
            ValueError: a bad setting or a parameter Muon cannot take; the group is not added.
        """
        add_checked_group(self, super().add_param_group, param_group, _validate_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step over every parameter that has a gradient; returns the closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        names = group.get("param_names") or [None] * len(group["params"])
        named = [(p, n) for p, n in zip(group["params"], names, strict=True) if p.grad is not None]
        params = [p for p, _ in named]
        if not params:
            return
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # The same elementwise formulas as muon_reference, over the whole group at once.
        updates = momentum_updates([p.grad for p in params], [self.state[p]["momentum_buffer"] for p in params],
                                   group["momentum"], group["nesterov"])
        steps = _orthogonalise(updates, group, [n for _, n in named])
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])  # a scheduler may write tensors
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_add_(params, steps, alpha=-lr)


def _orthogonalise(updates: list[Tensor], group: dict[str, Any], names: Sequence[str | None] = ()) -> list[Tensor]:
    """Scaled Newton-Schulz of every matrix of every update (per tensor-parallel block when ``blockwise``, per
    q/k/v block when split), the same-shaped matrices of the group (2-D updates and the matrices of 3-D ones
    alike) batched into stacks; a ``distributed`` tensor-parallel matrix by ``newton_schulz_blocks``."""
    mode, split = group.get("tp_mode", "duplicated"), group.get("tp_blocks") or {}
    tp = [split.get(n) if mode != "duplicated" and n is not None else None for n in (names or [None] * len(updates))]
    if not any(tp):
        return _orthogonalise_matrices(updates, group)
    out: list[Tensor] = []
    for update, blocks in zip(updates, tp, strict=True):
        if blocks is None:
            out += _orthogonalise_matrices([update], group)
        elif mode == "blockwise":
            dim, parts = blocks
            out.append(torch.cat(_orthogonalise_matrices([b.contiguous() for b in update.chunk(parts, dim)], group),
                                 dim))
        else:
            out.append(_distributed(update, blocks, group))
    return out


def _distributed(update: Tensor, blocks: tuple[int, int], group: dict[str, Any]) -> Tensor:
    """``tp_mode="distributed"``: each matrix (q, k, v when split) by Newton-Schulz over its tensor-parallel
    blocks, scaled by the matrix's shape."""
    dim, parts = blocks
    shapes = group["qkv_split_shapes"]
    matrices = [update] if shapes is None else _qkv_blocks(update, shapes)
    precision, device = group["matmul_precision"], update.device
    results = []
    for m in matrices:
        with matmul_precision(precision, device):
            joined = newton_schulz_blocks(m.chunk(parts, dim), dim, steps=group["ns_steps"],
                                          coefficients=group["ns_coefficients"],
                                          matmul_dtype=ns_matmul_dtype(precision, device))
        scale = group["extra_scale_factor"] * muon_scale_factor(m.size(0), m.size(1), group["scale_mode"])
        results.append(torch.cat(joined, dim).mul_(scale))
    return results[0] if shapes is None else _merge_qkv(results, shapes, update.shape)


def _orthogonalise_matrices(updates: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
    """Scaled Newton-Schulz of every matrix of every update (per q/k/v block when split), the same-shaped
    matrices batched into stacks."""
    shapes = group["qkv_split_shapes"]
    matrices = [m for u in updates for m in ([u] if shapes is None else _qkv_blocks(u, shapes))]
    by_kind: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = defaultdict(list)
    for i, m in enumerate(matrices):
        by_kind[(m.shape[-2:], m.dtype, m.device)].append(i)
    precision = group["matmul_precision"]
    pieces: list[list[Tensor]] = [[] for _ in matrices]  # each matrix's result, in stack order
    for (shape, _, device), indices in by_kind.items():
        scale = group["extra_scale_factor"] * muon_scale_factor(shape[0], shape[1], group["scale_mode"])
        matmul_dtype = ns_matmul_dtype(precision, device)
        limit = max(1, _MAX_STACK_ELEMENTS // max(1, shape.numel()))
        for chunk in stack_chunks([(i, matrices[i]) for i in indices], limit):
            # One whole update is used as it is (no copy; a single 2-D one runs exactly the reference's kernel).
            x = chunk[0][1] if len(chunk) == 1 else torch.cat([m if m.ndim == 3 else m.unsqueeze(0) for _, m in chunk])
            with matmul_precision(precision, device):
                out = newton_schulz(x, steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=NS_EPS,
                                    matmul_dtype=matmul_dtype)
            out.mul_(scale)  # a fresh tensor: newton_schulz never returns its input
            if len(chunk) == 1:
                pieces[chunk[0][0]].append(out)
                continue
            offset = 0
            for i, m in chunk:
                count = m.size(0) if m.ndim == 3 else 1
                pieces[i].append(out[offset : offset + count] if m.ndim == 3 else out[offset])
                offset += count
    results = [p[0] if len(p) == 1 else torch.cat(p) for p in pieces]
    if shapes is None:
        return results
    n = len(shapes)
    return [_merge_qkv(results[k * n : (k + 1) * n], shapes, u.shape) for k, u in enumerate(updates)]


def _validate_group(group: dict[str, Any], index: int) -> None:
    """Raise a ValueError naming the group, the field and the allowed values for any bad setting."""
    where = f"Muon param group {index}"
    check_min("Muon", index, group, "lr")
    check_min("Muon", index, group, "weight_decay")
    momentum, shapes, extra = group["momentum"], group["qkv_split_shapes"], group["extra_scale_factor"]
    require(is_number(momentum) and 0.0 <= momentum < 1.0, f"{where}: momentum must be in [0, 1), got {momentum!r}")
    require(isinstance(group["nesterov"], bool), f"{where}: nesterov must be True or False, got {group['nesterov']!r}")
    try:
        coefficient_schedule(group["ns_coefficients"], group["ns_steps"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    require(group["scale_mode"] in SCALE_MODES,
             f"{where}: unknown scale_mode {group['scale_mode']!r}; expected one of {list(SCALE_MODES)}")
    require(is_number(extra) and math.isfinite(extra), f"{where}: extra_scale_factor must be a finite number, "
             f"got {extra!r}")
    require(group["matmul_precision"] in MATMUL_PRECISIONS, f"{where}: matmul_precision must be one of "
             f"{list(MATMUL_PRECISIONS)}, got {group['matmul_precision']!r}")
    require(shapes is None or (not isinstance(shapes, str) and isinstance(shapes, Sequence) and len(shapes) == 3
                                and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shapes)),
             f"{where}: qkv_split_shapes must be None or three positive ints (q, k, v), got {shapes!r}")
    mode, tp = group.get("tp_mode", "duplicated"), group.get("tp_blocks") or {}
    require(mode in TP_MODES, f"{where}: tp_mode must be one of {list(TP_MODES)}, got {mode!r}")
    for name, blocks in tp.items():
        require(blocks is None or (isinstance(blocks, tuple) and len(blocks) == 2 and blocks[0] in (0, 1)
                                    and isinstance(blocks[1], int) and blocks[1] >= 1),
                 f"{where}: tp_blocks[{name!r}] must be (dim 0 or 1, parts >= 1) or None, got {blocks!r}")
    names = group.get("param_names")
    for i, p in enumerate(group["params"]):
        name = names[i] if names is not None and i < len(names) else None
        what = f"param {i}" if name is None else f"param {name!r} (index {i})"
        rule = 'Rule(Ndim(lt=2), algorithm="adamw")' if p.ndim < 2 else 'Rule(Ndim(gt=3), algorithm="adamw")'
        require(p.ndim in (2, 3), f"Muon needs 2-D parameters or 3-D stacks of matrices; {what} in group {index} "
                 f"has shape {tuple(p.shape)}. Route it to AdamW with a rule, e.g. {rule}")
        require(shapes is None or p.size(-2) % sum(shapes) == 0,
                 f"{where}: qkv_split_shapes {tuple(shapes or ())} (q + k + v = {sum(shapes or ())} rows per "
                 f"attention group) do not divide the rows of {what}, shape {tuple(p.shape)}; a fused QKV weight "
                 "has num_groups * (q + k + v) rows. Fix the shapes or keep this parameter out of the QKV group.")
        if mode != "duplicated" and name in tp:
            require(tp[name] is not None, f"{where}: tp_mode {mode!r} takes a matrix split by tensor "
                     f"parallelism along one dim; {what} is split otherwise (over two tensor-parallel mesh dims, or a "
                     "3-D stack). Use tp_mode='duplicated' (the whole matrix)")
            dim, parts = tp[name]
            require(p.size(dim) % parts == 0, f"{where}: tp_mode {mode!r} needs {what}'s dim {dim} "
                     f"({p.size(dim)}) split evenly over its {parts} tensor-parallel ranks; use tp_mode='duplicated'")
            rows = p.size(0) // (parts if dim == 0 and mode == "blockwise" else 1)
            require(shapes is None or rows % sum(shapes) == 0,
                     f"{where}: each tensor-parallel block of {what} has {rows} rows, not a multiple of q + k + v = "
                     f"{sum(shapes or ())} (qkv_split_shapes {tuple(shapes or ())})")


