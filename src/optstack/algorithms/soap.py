"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024, arXiv:2409.11321), for 2-D
weights, as NVIDIA Emerging-Optimizers' ``SOAP`` (which Megatron's ``optimizer='soap'`` builds) defines it.

Per ``(m, n)`` parameter ``p`` with gradient ``G``, step ``k`` (0-based), Kronecker factors ``L`` ``(m, m)`` and
``R`` ``(n, n)``, their eigenbases ``QL``, ``QR``, and Adam's moments ``M``, ``V`` (``(m, n)``, both kept in the
eigenbasis)::

    b   = 1 - (1 - shampoo_beta) / (1 - shampoo_beta**(k + 1))  if correct_bias else shampoo_beta
    L   = b * L + (1 - b) * G G^T;   R = b * R + (1 - b) * G^T G
    k == 0:  Q = eigh(factor) eigenvectors, largest eigenvalue first; no update (see below)
    k > 0 and k % precondition_frequency == 0:            # refresh the eigenbases
        M0  = QL M QR^T                                   # momentum back to the parameter's basis
        Q   = Q[:, order], order: the estimated eigenvalues diag(Q^T F Q) largest first (V's rows / columns
              permuted alike), then power_iter_steps times Q = qr(F Q).Q   (power iteration + QR)
        M   = QL^T M0 QR                                  # into the new basis
    p   = p * (1 - lr * weight_decay)                     # decoupled weight decay
    g   = QL^T G QR
    M   = beta1 * M + (1 - beta1) * g;   V = beta2 * V + (1 - beta2) * g**2
    u   = (M / (1 - beta1**k)) / (sqrt(V / (1 - beta2**k)) + eps)      # without correct_bias: M / (sqrt(V) + eps)
    p   = p - lr * QL u QR^T

The first step only fills the factors and computes their eigenbases, as the SOAP paper's code does: in the basis
of the gradient's own factors the projected gradient is diagonal but for round-off, and Adam's sign-like first
update would turn that round-off into unit-size steps.

Options for NVIDIA Emerging-Optimizers' variant (what Megatron's ``optimizer='soap'`` builds; all off by default):

- ``update_first_step``: step 0 goes on to an update in the eigenbases it just computed (Adam's ``t`` is ``k + 1``).
- ``use_eigh``: every refresh is an ``eigh`` of the factor (largest first; ``V`` left as it is, its entries
  already in eigenvalue order) instead of power iteration + QR.
- ``use_kl_shampoo``: KL-Shampoo's factors (Lin et al. 2025, arXiv:2509.03378) from the second step, when both
  sides are preconditioned: ``L`` from ``G R^-1 G^T / n`` and ``R`` from ``G^T L^-1 G / m``, each inverse taken in
  its factor's current eigenbasis (``Q diag(1 / max(diag(Q^T F Q), eps)) Q^T``), both from the factors before this
  step's EMA; ``b`` as above (with ``correct_bias`` the factors are bias-corrected, which rescales the inverses).
  A matrix with one side preconditioned keeps the plain update (only that factor's eigenvectors matter).

A side longer than ``max_precond_dim`` is not preconditioned (its ``Q`` is the identity, its factor not kept).
The first eigenbases come from ``eigh``; later refreshes cost one product ``F Q`` per side (it gives both the
estimated eigenvalues and the first power iteration) and a QR. A factor's null space (the long side of a matrix
before enough steps have filled it) has no preferred basis: there SOAP's update follows round-off, so runs whose
gradients differ in the last bits may differ along it (a property of SOAP, not of a placement); the equality tests
use factors of full rank.

State per parameter: ``"exp_avg"``, ``"exp_avg_sq"`` (the parameter's shape, in the eigenbasis), ``"step"``, and
``"GG_left"``, ``"GG_right"``, ``"Q_left"``, ``"Q_right"`` (square, per preconditioned side). Checkpoints key
state by parameter name and reshard element-wise state, so the square matrices are exported as pages shaped like
the parameter (``exported_state``: ``"GG_left.0"``, ... each a chunk of the flattened matrix, zero-padded), which
the owner of the whole matrix folds back on its next step; SOAP always steps whole matrices (its capabilities),
so each owner reads all of a matrix's pages.

The step batches the matrices of a group by shape and step count: one ``bmm`` per product, one batched ``eigh``
or ``qr`` per refresh, the state of a batch laid out as one stack (copied once into it, then updated in place),
equal to ``soap_reference`` to fp32 round-off. Scalars ride in the BLAS calls (the factors' EMA is ``baddbmm``'s
beta and alpha; lr and Adam's first-moment correction the last product's alpha), so an ordinary step is its six
products (``G G^T``, ``G^T G``, two into the eigenbasis, two back) and a few element-wise passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from optstack.algorithms._common import add_checked_group, check_betas, check_min, is_number, require

__all__ = ["SOAP", "kwargs_from_config", "soap_reference", "MATRIX_KEYS"]

#: the square state of each side: Kronecker factor and its eigenbasis
MATRIX_KEYS: tuple[str, ...] = ("GG_left", "GG_right", "Q_left", "Q_right")
_OPTIONS = ("use_kl_shampoo", "update_first_step", "use_eigh")  # Emerging-Optimizers' variant (module docstring)


def _eigh_descending(factor: Tensor) -> Tensor:
    """Eigenvectors of the symmetric ``factor`` (or a stack), largest eigenvalue first."""
    return torch.linalg.eigh(factor).eigenvectors.flip(-1)


def _estimated_eigenvalues(factor: Tensor, q: Tensor) -> Tensor:
    """``diag(Q^T F Q)``: the eigenvalues of ``factor`` as its (possibly stale) basis ``q`` sees them."""
    return (q * (factor @ q)).sum(-2)


def _kl_factor_update(grad: Tensor, left: Tensor, right: Tensor, ql: Tensor, qr: Tensor, b: float,
                      eps: float) -> None:
    """KL-Shampoo's factor EMA in place (module docstring): ``L = b L + (1 - b) G R^-1 G^T / n`` and
    ``R = b R + (1 - b) G^T L^-1 G / m``, the inverses in the current bases, both read before either changes."""
    m, n = grad.shape[-2:]
    inv_r = _estimated_eigenvalues(right, qr).clamp_min_(eps).reciprocal_().unsqueeze(-2)
    inv_l = _estimated_eigenvalues(left, ql).clamp_min_(eps).reciprocal_().unsqueeze(-2)
    gr, gl = grad @ qr, ql.mT @ grad  # G R^-1 G^T = (G QR) diag(1 / lambda_R) (G QR)^T; alike on the left
    _addmm_(left, gr * inv_r, gr.mT, beta=b, alpha=(1 - b) / n)
    _addmm_(right, gl.mT * inv_l, gl, beta=b, alpha=(1 - b) / m)


def _refresh(factor: Tensor, q: Tensor, v: Tensor, dim: int, power_iter_steps: int) -> tuple[Tensor, Tensor]:
    """One QR refresh of the eigenbasis ``q`` of ``factor`` (a matrix or stack): columns sorted by their estimated
    eigenvalues (largest first, ``v`` permuted alike along ``dim``), then power iteration + QR. Returns the new
    ``(q, v)``."""
    fq = factor @ q  # one product serves the estimate and the first power iteration
    estimated = (q * fq).sum(-2)  # diag(Q^T F Q)
    order = torch.argsort(estimated, dim=-1, descending=True, stable=True)
    index = order.unsqueeze(-1) if dim == -2 else order.unsqueeze(-2)  # V's rows (left) or columns (right)
    v = v.gather(dim, index.expand_as(v))
    columns = order.unsqueeze(-2).expand_as(q)
    q = torch.linalg.qr(fq.gather(-1, columns)).Q  # F Q[:, order] = (F Q)[:, order]
    for _ in range(power_iter_steps - 1):
        q = torch.linalg.qr(factor @ q).Q
    return q, v


def _addmm_(out: Tensor, a: Tensor, b: Tensor, *, beta: float, alpha: float) -> Tensor:
    """``out = beta * out + alpha * a @ b`` in place (matrices or stacks): the scalars ride in the BLAS call instead
    of a temporary and passes over it (``beta=0``: ``out``'s values are ignored)."""
    return (out.addmm_ if out.ndim == 2 else out.baddbmm_)(a, b, beta=beta, alpha=alpha)


def _to_basis(x: Tensor, ql: Tensor | None, qr: Tensor | None) -> Tensor:
    """``QL^T x QR`` (a missing side: the identity)."""
    if ql is not None:
        x = ql.mT @ x
    return x @ qr if qr is not None else x


def _from_basis(x: Tensor, ql: Tensor | None, qr: Tensor | None, scale: float = 1.0) -> Tensor:
    """``scale * QL x QR^T`` (a missing side: the identity), the scale applied by the last product."""
    if ql is None and qr is None:
        return x * scale
    if qr is None:
        return _addmm_(torch.empty_like(x), ql, x, beta=0, alpha=scale)
    x = x if ql is None else ql @ x
    return _addmm_(torch.empty_like(x), x, qr.mT, beta=0, alpha=scale)


def _soap_math(grad: Tensor, state: dict[str, Any], *, lr: float, beta1: float, beta2: float, eps: float,
               shampoo_beta: float, precondition_frequency: int, correct_bias: bool, power_iter_steps: int,
               use_kl_shampoo: bool = False, update_first_step: bool = False,
               use_eigh: bool = False) -> Tensor | None:
    """The module docstring's formulas on one matrix or a stack (leading batch dimension), state updated in place;
    returns ``lr * QL u QR^T`` (weight decay is the caller's), or None on a first step without an update."""
    k = int(state["step"])
    b = 1 - (1 - shampoo_beta) / (1 - shampoo_beta ** (k + 1)) if correct_bias else shampoo_beta
    left, right = state.get("GG_left"), state.get("GG_right")
    if use_kl_shampoo and k > 0 and left is not None and right is not None:
        _kl_factor_update(grad, left, right, state["Q_left"], state["Q_right"], b, eps)
    else:
        if left is not None:
            _addmm_(left, grad, grad.mT, beta=b, alpha=1 - b)
        if right is not None:
            _addmm_(right, grad.mT, grad, beta=b, alpha=1 - b)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    state["step"] = k + 1
    if k == 0:
        for side, factor in (("left", left), ("right", right)):
            if factor is not None:
                state[f"Q_{side}"].copy_(_eigh_descending(factor))
        if not update_first_step:
            return None
    elif k % precondition_frequency == 0:
        original = _from_basis(m, state.get("Q_left"), state.get("Q_right"))
        for side, factor, dim in (("left", left, -2), ("right", right, -1)):
            if factor is None:
                continue
            if use_eigh:  # eigenvalue order both times: V's entries stay with their eigenvalues' ranks
                state[f"Q_{side}"].copy_(_eigh_descending(factor))
            else:
                q, v_sorted = _refresh(factor, state[f"Q_{side}"], v, dim, power_iter_steps)
                state[f"Q_{side}"].copy_(q)
                v.copy_(v_sorted)
        m.copy_(_to_basis(original, state.get("Q_left"), state.get("Q_right")))
    g = _to_basis(grad, state.get("Q_left"), state.get("Q_right"))
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    # Adam's t counts its updates (the first step made none unless update_first_step); lr and M's correction go
    # into the last product
    t = k + 1 if update_first_step else k
    denom = v.sqrt()
    if correct_bias:
        denom.mul_(1 / math.sqrt(1 - beta2**t))
    u = torch.div(m, denom.add_(eps), out=denom)
    scale = lr / (1 - beta1**t) if correct_bias else lr
    return _from_basis(u, state.get("Q_left"), state.get("Q_right"), scale)


def soap_reference(param: Tensor, grad: Tensor, state: dict[str, Any], *, lr: float, betas: tuple[float, float],
                   eps: float, weight_decay: float, shampoo_beta: float, precondition_frequency: int,
                   max_precond_dim: int, correct_bias: bool, power_iter_steps: int = 1,
                   use_kl_shampoo: bool = False, update_first_step: bool = False, use_eigh: bool = False) -> None:
    """One SOAP step on one ``(m, n)`` parameter, in place (``param`` and ``state``, a dict that starts empty):
    the formulas of the module docstring, the test oracle."""
    if not state:
        state.update(_fresh_state(param, max_precond_dim))
    step = _soap_math(grad.float(), state, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, shampoo_beta=shampoo_beta,
                      precondition_frequency=precondition_frequency, correct_bias=correct_bias,
                      power_iter_steps=power_iter_steps, use_kl_shampoo=use_kl_shampoo,
                      update_first_step=update_first_step, use_eigh=use_eigh)
    if step is None:
        return
    param.mul_(1 - lr * weight_decay)
    param.sub_(step.to(param.dtype))


def _fresh_state(param: Tensor, max_precond_dim: int) -> dict[str, Any]:
    m, n = param.shape
    state: dict[str, Any] = {"step": 0, "exp_avg": torch.zeros_like(param, dtype=torch.float32),
                             "exp_avg_sq": torch.zeros_like(param, dtype=torch.float32)}
    for side, size in (("left", m), ("right", n)):
        if size <= max_precond_dim:
            state[f"GG_{side}"] = param.new_zeros(size, size, dtype=torch.float32)
            state[f"Q_{side}"] = param.new_zeros(size, size, dtype=torch.float32)
    return state


def kwargs_from_config(config: Any) -> dict[str, Any]:
    """``SOAP``'s kwargs from an ``OptimizerConfig``'s ``soap`` section (the registry adds lr and weight decay)."""
    s = config.soap
    return {"betas": (s.beta1, s.beta2), "eps": s.eps, "shampoo_beta": s.shampoo_beta,
            "precondition_frequency": s.precondition_frequency, "max_precond_dim": s.max_precond_dim,
            "correct_bias": s.correct_bias, "power_iter_steps": s.power_iter_steps,
            "use_kl_shampoo": s.use_kl_shampoo, "update_first_step": s.update_first_step, "use_eigh": s.use_eigh}


def export_pages(state: dict[str, Any], keys: tuple[str, ...], param: Tensor) -> dict[str, Any]:
    """A copy of ``state`` with each square matrix under ``keys`` flattened and cut into zero-padded pages shaped
    like ``param`` (``key.0``, ``key.1``, ...), the form name-keyed checkpoints shard and reshard."""
    state = dict(state)
    size = param.numel()
    for key in keys:
        matrix = state.pop(key, None)
        if matrix is not None:
            flat = matrix.reshape(-1)
            padded = flat.new_zeros(math.ceil(flat.numel() / size) * size)
            padded[: flat.numel()] = flat
            state.update({f"{key}.{i}": page.view(param.shape) for i, page in enumerate(padded.split(size))})
    return state


def fold_matrix_pages(state: dict[str, Any], keys: tuple[str, ...], shape: tuple[int, ...]) -> None:
    """Fold the pages of each of ``keys`` (left, right, left, ... sides of a ``shape`` matrix) in ``state`` back
    into its square matrix: state loaded from a checkpoint."""
    for i, key in enumerate(keys):
        size, pages = shape[i % 2], []
        while f"{key}.{len(pages)}" in state:
            pages.append(state.pop(f"{key}.{len(pages)}"))
        if pages:
            state[key] = torch.cat([p.reshape(-1) for p in pages])[: size * size].view(size, size).float().clone()


class SOAP(torch.optim.Optimizer):
    """SOAP for 2-D parameters (see the module docstring). Vectors, 3-D and higher tensors, embeddings and the
    output layer belong to a scalar optimizer (AdamW): the default rules route them there.

    Args:
        params: parameters or param-group dicts (``param_names`` in a group is used in error messages).
        lr: learning rate, >= 0.
        betas: Adam's (beta1, beta2) in the eigenbasis, each in [0, 1).
        eps: added to Adam's denominator, >= 0.
        weight_decay: decoupled weight decay, >= 0.
        shampoo_beta: EMA coefficient of the Kronecker factors, in [0, 1).
        precondition_frequency: refresh the eigenbases every this many steps (>= 1).
        max_precond_dim: a side longer than this is not preconditioned (>= 1).
        correct_bias: Adam's bias correction, and the factors' (Emerging-Optimizers ties the two).
        power_iter_steps: power iterations before the QR of each refresh (>= 1).
        use_kl_shampoo: KL-Shampoo's factor updates from the second step (module docstring; needs eps > 0, the
            eigenvalue floor).
        update_first_step: update on the first step too, in the eigenbases it computes.
        use_eigh: refresh the eigenbases by ``eigh`` instead of power iteration + QR.

    Every argument is also a per-group key.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.01, *,
                 shampoo_beta: float = 0.95, precondition_frequency: int = 10, max_precond_dim: int = 8192,
                 correct_bias: bool = True, power_iter_steps: int = 1, use_kl_shampoo: bool = False,
                 update_first_step: bool = False, use_eigh: bool = False) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      shampoo_beta=shampoo_beta, precondition_frequency=precondition_frequency,
                                      max_precond_dim=max_precond_dim, correct_bias=correct_bias,
                                      power_iter_steps=power_iter_steps, use_kl_shampoo=use_kl_shampoo,
                                      update_first_step=update_first_step, use_eigh=use_eigh))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (defaults fill missing keys) after checking its settings and parameters.

        Raises:
            ValueError: a bad setting or a parameter SOAP cannot take; the group is not added.
        """
        add_checked_group(self, super().add_param_group, param_group, _validate_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a state dict saved before these options existed (as torch's classes do)
            for key in _OPTIONS:
                group.setdefault(key, self.defaults[key])

    def exported_state(self, param: Tensor) -> dict[str, Any]:
        """``self.state[param]`` with each square matrix as pages shaped like ``param`` (``export_pages``)."""
        return export_pages(self.state.get(param, {}), MATRIX_KEYS, param)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One SOAP step over every parameter that has a gradient; returns the closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            _validate_settings(group, index)  # a scheduler may have written them
            self._step_group(group)
        return loss

    def _init_group(self, group: dict[str, Any], skip_non_grad_params: bool = True) -> None:
        """Create the state of the group's parameters that have none (those with a gradient unless
        ``skip_non_grad_params``: Megatron's checkpoint formats want every parameter's state before a step)."""
        for p in group["params"]:
            if (p.grad is not None or not skip_non_grad_params) and "exp_avg" not in self.state[p]:
                self.state[p].update(_fresh_state(p, int(group["max_precond_dim"])))

    def _step_group(self, group: dict[str, Any]) -> None:
        self._init_group(group)
        params = [p for p in group["params"] if p.grad is not None]
        batches: dict[tuple[Any, ...], list[Tensor]] = {}
        for p in params:
            state = self.state[p]
            fold_matrix_pages(state, MATRIX_KEYS, tuple(p.shape))
            sides = tuple(key in state for key in MATRIX_KEYS)
            batches.setdefault((p.shape, p.device, int(state["step"]), sides), []).append(p)
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
        settings = dict(lr=lr, beta1=float(group["betas"][0]), beta2=float(group["betas"][1]), eps=float(group["eps"]),
                        shampoo_beta=float(group["shampoo_beta"]),
                        precondition_frequency=int(group["precondition_frequency"]),
                        correct_bias=bool(group["correct_bias"]), power_iter_steps=int(group["power_iter_steps"]),
                        use_kl_shampoo=bool(group["use_kl_shampoo"]),
                        update_first_step=bool(group["update_first_step"]), use_eigh=bool(group["use_eigh"]))
        for (_, _, step, _), members in batches.items():
            states = [self.state[p] for p in members]
            stacked: dict[str, Any] = {"step": step}
            for key in ("exp_avg", "exp_avg_sq", *MATRIX_KEYS):
                if key in states[0]:
                    stacked[key] = _stack_state(states, key)
            grads = torch.stack([p.grad.float() for p in members])
            update = _soap_math(grads, stacked, **settings)
            for state in states:
                state["step"] = step + 1
            if update is None:
                continue
            if weight_decay != 0:
                torch._foreach_mul_(members, 1 - lr * weight_decay)
            torch._foreach_sub_(members, [u.to(p.dtype) for u, p in zip(update.unbind(0), members, strict=True)])


def _stack_state(states: list[dict[str, Any]], key: str) -> Tensor:
    """The ``key`` tensors of ``states`` as one ``(len(states), ...)`` stack whose slices they are: a view when
    they already are consecutive slices of one buffer, else a new buffer they are copied into and replaced by
    views of (so the next step stacks them without a copy)."""
    tensors = [s[key] for s in states]
    first = tensors[0]
    numel = first.numel()
    if all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and t.storage_offset() == first.storage_offset() + i * numel and t.shape == first.shape
           for i, t in enumerate(tensors)):
        return first.as_strided((len(tensors), *first.shape), (numel, *first.stride()), first.storage_offset())
    stack = torch.stack(tensors)
    for s, view in zip(states, stack.unbind(0), strict=True):
        s[key] = view
    return stack


def _validate_settings(group: dict[str, Any], index: int) -> None:
    where = f"SOAP param group {index}"
    check_min("SOAP", index, group, "lr")
    check_min("SOAP", index, group, "weight_decay")
    check_min("SOAP", index, group, "eps")
    check_betas("SOAP", index, group)
    beta = group["shampoo_beta"]
    require(is_number(beta) and 0.0 <= beta < 1.0, f"{where}: shampoo_beta must be in [0, 1), got {beta!r}")
    for key in ("precondition_frequency", "max_precond_dim", "power_iter_steps"):
        value = group[key]
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{where}: {key} must be an integer >= 1, got {value!r}")
    for key in ("correct_bias", "use_kl_shampoo", "update_first_step", "use_eigh"):
        require(isinstance(group[key], bool), f"{where}: {key} must be True or False, got {group[key]!r}")
    require(not group["use_kl_shampoo"] or group["eps"] > 0,
            f"{where}: use_kl_shampoo needs eps > 0 (it floors the factors' eigenvalues), got eps={group['eps']!r}")


def _validate_group(group: dict[str, Any], index: int) -> None:
    """Raise a ValueError naming the group, the field or parameter, and the fix."""
    _validate_settings(group, index)
    names = group.get("param_names")
    for i, p in enumerate(group["params"]):
        name = names[i] if names is not None and i < len(names) else None
        what = f"param {i}" if name is None else f"param {name!r} (index {i})"
        rule = 'Rule(Ndim(lt=2), algorithm="adamw")' if p.ndim < 2 else f'Rule(Name("{name}"), algorithm="adamw")'
        require(p.ndim == 2, f"SOAP needs 2-D parameters; {what} in group {index} has shape {tuple(p.shape)}. "
                f"Route it to AdamW with a rule, e.g. {rule}")
