"""``AdamW``, ``Adam``, ``SGD``, ``Muon`` with torch.optim's signatures and defaults, and ``Lion``::

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)      # before
    opt = optstack.optim.AdamW(model.parameters(), lr=3e-4)   # after: optstack's kernels, masters, state format

``foreach`` / ``fused`` choose optstack's kernel (``optim._base.impl_of``); ``capturable`` and ``differentiable``
are refused (README: "It is a torch.optim.Optimizer").
"""

from __future__ import annotations

from typing import Any

import torch

from optstack.algorithms import adamw as adamw_algorithm
from optstack.algorithms import lion as lion_algorithm
from optstack.algorithms import sgd as sgd_algorithm
from optstack.optim._base import TorchStyleOptimizer, check_lr, impl_of, refuse_unsupported, with_group_defaults

__all__ = ["SGD", "Adam", "AdamW", "Lion", "Muon"]


def _check_adam(owner: str, lr: Any, betas: Any, eps: float, weight_decay: float, foreach: bool | None) -> None:
    """torch.optim.Adam(W)'s checks, with its messages and exception types."""
    check_lr(owner, lr, foreach=foreach)
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps} ({owner}: eps must be >= 0)")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"betas must be either both floats or both Tensors ({owner}: got {betas!r})")
    if isinstance(betas[0], torch.Tensor) and foreach:
        raise ValueError(f"betas[0] as a Tensor is not supported for capturable=False and foreach=True ({owner}: "
                         "pass float betas, or foreach=None)")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta} ({owner}: betas must be in [0, 1))")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} ({owner}: weight_decay must be >= 0)")


class _Adam(TorchStyleOptimizer):
    """The shell shared by ``Adam`` and ``AdamW`` (``decoupled`` weight decay or L2)."""

    def _build(self, params: Any, defaults: dict[str, Any], *, decoupled: bool) -> None:
        owner = f"optstack.optim.{type(self).__name__}"
        _check_adam(owner, defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"],
                    defaults["foreach"])
        refuse_unsupported(owner, capturable=defaults["capturable"], differentiable=defaults["differentiable"])
        impl = impl_of(owner, defaults["foreach"], defaults["fused"])
        make = with_group_defaults(adamw_algorithm.AdamW, lr=defaults["lr"], betas=defaults["betas"],
                                   eps=defaults["eps"], weight_decay=defaults["weight_decay"],
                                   amsgrad=defaults["amsgrad"], maximize=defaults["maximize"],
                                   decoupled=decoupled, impl=impl)
        super().__init__(params, defaults, make)


class AdamW(_Adam):
    """``torch.optim.AdamW``'s constructor over optstack's AdamW (bitwise equal to torch's fused AdamW in fp32;
    fp64 parameters keep fp64 moments; bf16/fp16 parameters are stepped through fp32 masters).

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts (per-group options honoured).
        lr: learning rate (a float or a 1-element tensor), >= 0.
        betas: (beta1, beta2) in [0, 1).
        eps, weight_decay: >= 0 (decoupled weight decay).
        amsgrad: keep the running maximum of the second moment (``max_exp_avg_sq``) and divide by it.
        maximize: ascend the objective.
        foreach: True: optstack's multi-tensor kernel; False: its single-tensor reference (torch's for-loop);
            None: ``fused`` where it exists (CPU, CUDA).
        fused: True: torch's fused kernel, back-to-back tensors stepped as one.
        capturable, differentiable: refused (``ValueError``) unless False.
    """

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        self._build(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                             "foreach": foreach, "maximize": maximize, "capturable": capturable,
                             "differentiable": differentiable, "fused": fused, "decoupled_weight_decay": True},
                    decoupled=True)


class Adam(_Adam):
    """``torch.optim.Adam``'s constructor over optstack's Adam (L2 weight decay, or decoupled with
    ``decoupled_weight_decay=True`` as torch's); arguments as ``AdamW``'s."""

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False) -> None:
        self._build(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                             "maximize": maximize, "foreach": foreach, "capturable": capturable,
                             "differentiable": differentiable, "fused": fused,
                             "decoupled_weight_decay": decoupled_weight_decay},
                    decoupled=bool(decoupled_weight_decay))


class SGD(TorchStyleOptimizer):
    """``torch.optim.SGD``'s constructor over optstack's SGD (momentum, dampening, nesterov, L2 weight decay,
    maximize). ``foreach`` / ``fused`` as ``AdamW``'s; ``differentiable`` refused unless False. Sparse
    gradients are stepped as their dense equals (same result as torch's; the memory of a dense gradient)."""

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None) -> None:
        owner = "optstack.optim.SGD"
        check_lr(owner, lr)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum} ({owner}: momentum must be >= 0)")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} ({owner}: weight_decay must be >= 0)")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"Nesterov momentum requires a momentum and zero dampening ({owner}: got "
                             f"momentum={momentum}, dampening={dampening})")
        refuse_unsupported(owner, differentiable=differentiable)
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov, "maximize": maximize, "foreach": foreach, "differentiable": differentiable,
                    "fused": fused}
        make = with_group_defaults(sgd_algorithm.SGD, lr=lr, momentum=momentum, dampening=dampening,
                                   weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                                   impl=impl_of(owner, foreach, fused))
        super().__init__(params, defaults, make)


class Lion(TorchStyleOptimizer):
    """Lion (Chen et al. 2023; torch has none) with the common ``Lion(params, lr, betas, weight_decay)``
    signature over optstack's Lion. ``foreach`` as ``AdamW``'s; ``fused`` is a hint (no fused Lion kernel:
    the multi-tensor one runs)."""

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, foreach: bool | None = None, fused: bool | None = None) -> None:
        owner = "optstack.optim.Lion"
        check_lr(owner, lr)
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta} ({owner}: betas must be in [0, 1))")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} ({owner}: weight_decay must be >= 0)")
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach, "fused": fused}
        make = with_group_defaults(lion_algorithm.Lion, lr=lr, betas=betas, weight_decay=weight_decay,
                                   impl=impl_of(owner, foreach, fused, has_fused=False))
        super().__init__(params, defaults, make)


#: torch.optim.Muon's ``adjust_lr_fn`` as optstack's (scale_mode, extra_scale_factor)
_ADJUST_LR = {None: ("shape_scaling", 1.0), "original": ("shape_scaling", 1.0), "match_rms_adamw": ("spectral", 0.2)}


class Muon(TorchStyleOptimizer):
    """``torch.optim.Muon``'s constructor over optstack's Muon (2-D parameters; Newton-Schulz with the given
    ``(a, b, c)`` coefficients and ``ns_steps``; ``adjust_lr_fn`` ``"original"`` / None scales the update by
    ``sqrt(max(1, rows / cols))``, ``"match_rms_adamw"`` by ``0.2 * sqrt(max(rows, cols))``, read per group at
    construction). Newton-Schulz runs in fp32 (torch's in bf16), so results agree with torch's to bf16
    precision, not bit for bit."""

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-07,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None) -> None:
        owner = "optstack.optim.Muon"
        check_lr(owner, lr, message="Learning rate should be >= 0 but is: {}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum} ({owner})")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay} ({owner})")
        if adjust_lr_fn not in _ADJUST_LR:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported ({owner}: use "
                             "'original', 'match_rms_adamw' or None)")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        if not isinstance(params, torch.Tensor):
            params = list(params)  # read once: checked here, then built
            for item in params:
                tensors = item["params"] if isinstance(item, dict) else [item]
                tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
                for param in tensors:
                    param = param[1] if isinstance(param, tuple) else param
                    if isinstance(param, torch.Tensor) and param.ndim != 2:
                        raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with "
                                         f"size: {param.size()} ({owner}: route it to optstack.optim.AdamW)")
        super().__init__(params, defaults, _make_muon)


def _make_muon(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """optstack's Muon over torch-style groups (``adjust_lr_fn`` and ``ns_coefficients`` translated)."""
    from optstack.algorithms.muon import Muon as MuonAlgorithm  # Newton-Schulz imports on first use

    inner = []
    for group in groups:
        scale_mode, extra = _ADJUST_LR[group.get("adjust_lr_fn")]
        inner.append({**group, "scale_mode": scale_mode, "extra_scale_factor": extra,
                      "ns_coefficients": [tuple(float(c) for c in group["ns_coefficients"])]})
    return MuonAlgorithm(inner, matmul_precision="highest")
