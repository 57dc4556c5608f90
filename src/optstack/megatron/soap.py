"""SOAP as NVIDIA Emerging-Optimizers defines it, for the Megatron face (``optimizer='soap'``, Emerging-Optimizers'
``SOAP`` signature), registered as the algorithm ``megatron_soap``. It differs from the core ``soap``
(``optstack.algorithms.soap``, the SOAP paper's) in what Megatron's fields and tests expect: KL-Shampoo factors
(``soap_use_kl_shampoo``, Megatron's default) and an update from the first step (the core's first step only fills
the factors). Its square factors are checkpointed as the core's are, as parameter-shaped pages.

SOAP (Vyas et al. 2024, arXiv:2409.11321) is Adam run in the eigenbasis of Shampoo's preconditioner. Per matrix
``p`` (rows ``m``, cols ``n``) with gradient ``g``, at step ``t``::

    L = b_s L + (1 - b_s) g g^T         R = b_s R + (1 - b_s) g^T g          # Shampoo's factors
        (use_kl_shampoo, t > 1: L from g R^-1 g^T / n and R from g^T L^-1 g / m, the inverses in the
         factors' current eigenbases, eigenvalues floored at eps: KL-Shampoo, Lin et al. 2025)
    Q_L, Q_R = eigenvectors of L, R      every precondition_frequency steps (the first step included)
    m   = b1 m + (1 - b1) g                                                   # kept in the parameter's basis
    v   = b2 v + (1 - b2) (Q_L^T g Q_R)^2                                     # kept in the eigenbasis
    u   = Q_L [ (Q_L^T m Q_R / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) ] Q_R^T
    p   = p (1 - lr wd) - lr u                                                # decoupled weight decay

State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, ``L``, ``R``, ``Q_L``, ``Q_R`` (fp32). Only 2-D
parameters (route the rest to Adam, as Megatron's default overrides do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from optstack.algorithms.registry import Capabilities, algorithm_names, register
from optstack.algorithms.soap import export_pages, fold_matrix_pages

__all__ = ["SOAP", "register_megatron_soap"]


_MATRIX_KEYS = ("L", "R", "Q_L", "Q_R")  # square, one per side: checkpointed as parameter-shaped pages


def _eigenbasis(factor: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues and eigenvectors of a symmetric PSD factor (fp32; symmetrised against round-off)."""
    values, vectors = torch.linalg.eigh((factor + factor.mT) / 2)
    return values, vectors


class SOAP(torch.optim.Optimizer):
    """Emerging-Optimizers' ``SOAP`` arguments; see the module docstring. Every argument is also a group key.

    Args:
        params: 2-D parameters or param groups.
        lr: learning rate. betas: Adam's ``(b1, b2)``. shampoo_beta: EMA coefficient of Shampoo's factors.
        eps: Adam's denominator term (and KL-Shampoo's eigenvalue floor). weight_decay: decoupled.
        precondition_frequency: steps between eigenbasis refreshes (>= 1).
        use_kl_shampoo: KL-Shampoo's factor updates (module docstring).

    Raises:
        ValueError: a bad setting; a parameter that is not 2-D at its first step.
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95),
                 shampoo_beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 1, use_kl_shampoo: bool = False) -> None:
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0 and 0.0 <= shampoo_beta < 1.0):
            raise ValueError(f"SOAP: betas and shampoo_beta must be in [0, 1), got betas={betas}, "
                             f"shampoo_beta={shampoo_beta}")
        if lr < 0 or eps <= 0 or weight_decay < 0 or precondition_frequency < 1:
            raise ValueError(f"SOAP: need lr >= 0, eps > 0, weight_decay >= 0, precondition_frequency >= 1; got "
                             f"lr={lr}, eps={eps}, weight_decay={weight_decay}, "
                             f"precondition_frequency={precondition_frequency}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps,
                                      weight_decay=weight_decay, precondition_frequency=precondition_frequency,
                                      use_kl_shampoo=use_kl_shampoo))

    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = True) -> None:
        """Create the state of the group's parameters (those with a gradient unless ``skip_non_grad_params``)."""
        for p in group["params"]:
            if (p.grad is None and skip_non_grad_params) or self.state[p]:
                continue
            if p.dim() != 2:
                raise ValueError(f"SOAP needs 2-D parameters, got shape {tuple(p.shape)}; route it to Adam")
            m, n = p.shape
            f32 = dict(dtype=torch.float32, device=p.device)
            self.state[p].update(step=0, exp_avg=torch.zeros(m, n, **f32), exp_avg_sq=torch.zeros(m, n, **f32),
                                 L=torch.zeros(m, m, **f32), R=torch.zeros(n, n, **f32),
                                 Q_L=torch.eye(m, **f32), Q_R=torch.eye(n, **f32))

    def exported_state(self, param: Tensor) -> dict[str, Any]:
        """``self.state[param]`` with each square matrix as pages shaped like ``param`` (the core SOAP's form,
        ``optstack.algorithms.soap``), which name-keyed checkpoints shard and reshard."""
        return export_pages(self.state.get(param, {}), _MATRIX_KEYS, param)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One SOAP step over every parameter with a gradient; returns the closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_group(group)
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)
        return loss

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        state, g = self.state[p], p.grad.float()
        fold_matrix_pages(state, _MATRIX_KEYS, tuple(p.shape))
        (b1, b2), bs, eps = group["betas"], group["shampoo_beta"], group["eps"]
        state["step"] += 1
        t = state["step"]
        L, R, QL, QR = state["L"], state["R"], state["Q_L"], state["Q_R"]
        if group["use_kl_shampoo"] and t > 1:
            # the other factor's inverse in its eigenbasis (before this step's update of either)
            inv_r = QR @ torch.diag(1 / (QR.mT @ R @ QR).diagonal().clamp_min(eps)) @ QR.mT
            inv_l = QL @ torch.diag(1 / (QL.mT @ L @ QL).diagonal().clamp_min(eps)) @ QL.mT
            L.lerp_(g @ inv_r @ g.mT / g.size(1), 1 - bs)
            R.lerp_(g.mT @ inv_l @ g / g.size(0), 1 - bs)
        else:
            L.lerp_(g @ g.mT, 1 - bs)
            R.lerp_(g.mT @ g, 1 - bs)
        if (t - 1) % group["precondition_frequency"] == 0:
            QL.copy_(_eigenbasis(L)[1])
            QR.copy_(_eigenbasis(R)[1])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1 - b1)
        v.lerp_((QL.mT @ g @ QR).square(), 1 - b2)
        projected = (QL.mT @ m @ QR) / (1 - b1**t)
        update = QL @ (projected / ((v / (1 - b2**t)).sqrt() + eps)) @ QR.mT
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if wd != 0:
            p.mul_(1 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)


def register_megatron_soap() -> None:
    """Register ``SOAP`` as the ``megatron_soap`` algorithm (whole 2-D matrices: under sharding, owners step them
    whole)."""
    if "megatron_soap" not in algorithm_names():
        register("megatron_soap", SOAP, family="other", capabilities=Capabilities(
            elementwise=False, whole_matrices=True, matrix_ndims=(2,), state=("exp_avg", "exp_avg_sq"),
            matrix_state=_MATRIX_KEYS))
