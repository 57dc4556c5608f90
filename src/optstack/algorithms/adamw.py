"""AdamW and Adam: the single-tensor reference kernel (the test oracle) and the optimizer with its fast paths.

``decoupled=True`` is AdamW (``p *= 1 - lr * wd``), ``decoupled=False`` Adam with L2 weight decay added to the
gradient. The state has torch.optim's layout (``step`` a 0-d fp32 tensor, ``exp_avg``, ``exp_avg_sq``), so state
dicts move between optstack and torch. Paths (``impl``), all with the same math: ``fused`` (torch's
``_fused_adamw_`` / ``_fused_adam_``, ~5x foreach on CPU; back-to-back tensors are stepped as one flat tensor),
``foreach`` (``torch._foreach_*``), ``reference`` (per tensor), ``auto`` (fused on CPU and CUDA, else foreach).

Low-precision moments (bf16 / fp16 ``exp_avg_dtype`` / ``exp_avg_sq_dtype``) are updated in fp32 through a
reused scratch buffer (``_staging.py``). fp16 cannot hold the second moment: ``v ~ (1 - beta2) g**2`` underflows
fp16's smallest subnormal (6e-8) for ``|g| < 8e-3`` and the update ``m / (sqrt(v) + eps)`` explodes. So an fp16
second moment is stored as ``grad_rms = sqrt(v / (1 - beta2**step))`` (key ``grad_rms``, no ``exp_avg_sq``),
which has the range of ``|g|``; loading converts between the forms with the saved step and the group's beta2.
An fp16 ``exp_avg`` keeps ``|g|`` down to 6e-5 at full precision; prefer bf16 for tiny gradients.

8-bit moments (``torch.uint8``: block-quantized, ``_quant8.py``; 1 B per element + 4 B per ``block_size``
block) are held as ``exp_avg_codes`` / ``exp_avg_scales`` and ``exp_avg_sq_sqrt_codes`` /
``exp_avg_sq_sqrt_scales`` (the codes of ``sqrt(v)``), dequantized into the fp32 scratch for the step and
quantized back. ``exported_state`` gives them as fp32 ``exp_avg`` / ``exp_avg_sq`` (what checkpoints hold,
so they reshard and load into any moment dtype); ``load_state_dict`` takes either form.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch

from optstack.algorithms._common import Impl, PerDeviceOptimizer, coalesce, copies_in_runs, resolve_impl, zeros_in_runs
from optstack.algorithms._quant8 import DEFAULT_BLOCK, Q8, blocks_of, dequantize_, infer_block, quantize_, zeros_q8
from optstack.algorithms._staging import rms_to_v, run_staged, v_to_rms

__all__ = ["AdamW", "adamw_reference", "kwargs_from_config"]

_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)
_RMS_KEY = "grad_rms"
#: the keys of an 8-bit moment (codes, scales) and whether its codes encode the square root
_Q8_KEYS = {"exp_avg": ("exp_avg_codes", "exp_avg_scales", False),
            "exp_avg_sq": ("exp_avg_sq_sqrt_codes", "exp_avg_sq_sqrt_scales", True)}


def adamw_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    decoupled: bool, max_exp_avg_sq: torch.Tensor | None = None, maximize: bool = False) -> None:
    """One Adam(W) step on single tensors, in place: the oracle the fast paths are tested against.

    Math runs in fp32 (fp64 for fp64 params) whatever the storage dtypes; in fp32 it equals
    ``torch.optim.AdamW`` / ``Adam`` bit for bit.

    Args:
        param, grad, exp_avg, exp_avg_sq: tensors of one shape; ``grad`` is only read.
        step: the step count including this step (1 on the first step), for bias correction.
        lr, beta1, beta2, eps, weight_decay: the hyperparameters.
        decoupled: True for AdamW (decay the weights), False for Adam (add ``weight_decay * param`` to grad).
        max_exp_avg_sq: AMSGrad's running maximum of ``exp_avg_sq`` (same shape), or None for plain Adam: the
            denominator then uses the maximum.
        maximize: ascend the objective (the gradient's sign flipped first, as torch's ``maximize``).
    """
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    p, g, m, v = (t if t.dtype == dtype else t.to(dtype) for t in (param, grad, exp_avg, exp_avg_sq))
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    top = v
    if max_exp_avg_sq is not None:
        top = max_exp_avg_sq if max_exp_avg_sq.dtype == dtype else max_exp_avg_sq.to(dtype)
        torch.maximum(top, v, out=top)
    denom = (top.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    pairs = [(p, param), (m, exp_avg), (v, exp_avg_sq)]
    if max_exp_avg_sq is not None:
        pairs.append((top, max_exp_avg_sq))
    for result, storage in pairs:
        if result is not storage:
            storage.copy_(result)


def kwargs_from_config(config: Any) -> dict[str, Any]:
    """``AdamW``'s kwargs from an ``OptimizerConfig``'s ``adam`` section (the registry adds the base ones)."""
    adam = config.adam
    exp_avg_dtype, exp_avg_sq_dtype = adam.state_dtypes
    kwargs = {"betas": (adam.beta1, adam.beta2), "eps": adam.eps,
              "exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype}
    masters = getattr(config, "masters", None)
    if masters is not None and masters.stochastic_rounding:
        kwargs["stochastic_rounding"] = True
    if torch.uint8 in (exp_avg_dtype, exp_avg_sq_dtype):
        kwargs["block_size"] = adam.block_size
    return kwargs


class AdamW(PerDeviceOptimizer):
    """AdamW (decoupled weight decay) or Adam (L2), equal to ``torch.optim.AdamW`` / ``torch.optim.Adam``.

    Works on any leaf tensors with ``.grad`` set (fp32 masters, flat shard views); tensors whose grad is None
    are skipped. Groups may override ``lr``, ``betas``, ``eps``, ``weight_decay`` and carry extra keys.

    Args:
        params: tensors or param-group dicts.
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0 (> 0 recommended: with 0, a zero gradient history divides by 0).
        weight_decay: >= 0; decoupled (AdamW) or L2 (Adam), see ``decoupled``.
        amsgrad: AMSGrad (the denominator uses the running maximum of ``exp_avg_sq``, kept as
            ``max_exp_avg_sq``); a per-group key. Needs fp32 / fp64 moments.
        maximize: ascend the objective instead of descending; a per-group key.
        decoupled: True: AdamW; False: Adam with L2 weight decay.
        exp_avg_dtype, exp_avg_sq_dtype: storage dtype of the moments (fp32, bf16, fp16, fp64, or uint8:
            8-bit block-quantized); math is fp32. fp64 parameters keep fp64 moments (and math) under fp32.
        impl: "auto", "fused", "foreach" or "reference" (see the module docstring).
        stochastic_rounding: round results into bf16 parameters stochastically (fused/foreach paths; the
            reference rounds to nearest).
        block_size: elements per quantization block of 8-bit moments (a power of two in [16, 4096]).
    """

    _checked = ("lr", "betas", "eps", "weight_decay")
    _folds_grad_scale = True

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, *,
                 amsgrad: bool = False, maximize: bool = False, decoupled: bool = True,
                 exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, impl: Impl = "auto",
                 stochastic_rounding: bool = False, block_size: int = DEFAULT_BLOCK) -> None:
        self._name = "AdamW" if decoupled else "Adam"
        for field, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in _STATE_DTYPES:
                raise ValueError(f"{self._name}: {field} must be one of torch.float32, torch.bfloat16, "
                                 f"torch.float16, torch.float64, torch.uint8 (8-bit block-quantized); got {dtype!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not (
                16 <= block_size <= 4096 and block_size & (block_size - 1) == 0):
            raise ValueError(f"{self._name}: block_size must be a power of two in [16, 4096], got {block_size!r}")
        self.block_size = block_size
        self._quantized = {"exp_avg": exp_avg_dtype == torch.uint8, "exp_avg_sq": exp_avg_sq_dtype == torch.uint8}
        self.decoupled = decoupled
        self.stochastic_rounding = bool(stochastic_rounding)
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self._sq_key = _RMS_KEY if exp_avg_sq_dtype == torch.float16 else "exp_avg_sq"
        # fp32 scratch for low-precision tensors, by (math dtype, device): reused, not part of the state
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": amsgrad, "maximize": maximize}, impl)

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        super()._check_group(index, group)
        if group.get("amsgrad") and (any(self._quantized.values()) or self._sq_key == _RMS_KEY
                                     or self.exp_avg_sq_dtype not in (torch.float32, torch.float64)):
            raise ValueError(f"{self._name} param group {index}: amsgrad keeps a running maximum of the second "
                             f"moment in its storage dtype and needs fp32 / fp64 moments (exp_avg_sq_dtype is "
                             f"{self.exp_avg_sq_dtype}); use fp32 moments or amsgrad=False")

    def _moment_dtype(self, dtype: torch.dtype, param: torch.Tensor) -> torch.dtype:
        """The storage dtype of a moment of ``param``: fp64 for an fp64 parameter under fp32 (so its math and
        state are fp64, as torch's), else ``dtype``."""
        return torch.float64 if dtype == torch.float32 and param.dtype == torch.float64 else dtype

    def _step_device(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     grad_scale: float = 1.0) -> None:
        impl = resolve_impl(self.impl, device, has_fused=True)
        # torch's fused CUDA kernel reads the step from device memory; elsewhere the step lives on the host.
        step_device = device if impl == "fused" and device.type != "cpu" else torch.device("cpu")
        states = [self.state[p] for p in params]
        fresh = [i for i, state in enumerate(states) if not state]
        if fresh:  # back-to-back state for back-to-back params; the steps: views of one buffer (_advance_steps)
            new = [params[i] for i in fresh]
            zero_steps = torch.zeros(len(fresh), dtype=torch.float32, device=step_device).unbind()
            for i, step in zip(fresh, zero_steps, strict=True):
                states[i]["step"] = step
            for which, key, dtype in (("exp_avg", "exp_avg", self.exp_avg_dtype),
                                      ("exp_avg_sq", self._sq_key, self.exp_avg_sq_dtype)):
                if self._quantized[which]:
                    self._check_quantizable(new)
                    codes, scales, sqrt = _Q8_KEYS[which]
                    for i, p in zip(fresh, new, strict=True):
                        q = zeros_q8(p, self.block_size, sqrt=sqrt)
                        states[i].update({codes: q.codes, scales: q.scales})
                else:
                    for wanted in dict.fromkeys(self._moment_dtype(dtype, p) for p in new):
                        picked = [k for k, p in enumerate(new) if self._moment_dtype(dtype, p) == wanted]
                        made = zeros_in_runs([new[k] for k in picked], wanted)
                        for k, tensor in zip(picked, made, strict=True):
                            states[fresh[k]][key] = tensor
        amsgrad, maximize = bool(group.get("amsgrad", False)), bool(group.get("maximize", False))
        if amsgrad:  # (a state loaded without it, e.g. from a run without amsgrad, starts its maximum at zero)
            lacking = [i for i, state in enumerate(states) if "max_exp_avg_sq" not in state]
            for i, tensor in zip(lacking, zeros_in_runs([params[i] for i in lacking],
                                                        states[lacking[0]][self._sq_key].dtype
                                                        if lacking else None), strict=True):
                states[i]["max_exp_avg_sq"] = tensor
        steps, values = _advance_steps(states, step_device)
        grads = [p.grad for p in params]
        if grad_scale != 1.0 and impl != "fused":
            torch._foreach_mul_(grads, grad_scale)
        exp_avgs = [self._moment(state, "exp_avg", "exp_avg") for state in states]
        exp_avg_sqs = [self._moment(state, "exp_avg_sq", self._sq_key) for state in states]
        beta1, beta2 = (float(b) for b in group["betas"])
        hyper: dict[str, Any] = {"lr": float(group["lr"]), "beta1": beta1, "beta2": beta2, "eps": float(group["eps"]),
                                 "weight_decay": float(group["weight_decay"]), "decoupled": self.decoupled,
                                 "maximize": maximize}
        as_rms = self._sq_key == _RMS_KEY
        maxes = [state["max_exp_avg_sq"] for state in states] if amsgrad else [None] * len(params)
        # AMSGrad's maximum is not staged: tensors the kernels cannot take as they are take the reference path
        native = [p.dtype in (torch.float32, torch.float64) and g.dtype == p.dtype and p.is_contiguous()
                  and g.is_contiguous() and all(isinstance(t, torch.Tensor) and t.dtype == p.dtype
                                                for t in (m, v, x) if t is not None)
                  for p, g, m, v, x in zip(params, grads, exp_avgs, exp_avg_sqs, maxes, strict=True)]
        by_reference = range(len(params)) if impl == "reference" else [
            i for i in range(len(params)) if amsgrad and not native[i]]
        for i in by_reference:
            p, g, m, v, step = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], values[i]
            if impl == "fused" and grad_scale != 1.0:  # (scaled above on the other paths)
                g.mul_(grad_scale)
            m_math, v_math = (_dequantized(t).view(p.shape) if isinstance(t, Q8) else t for t in (m, v))
            v_math = rms_to_v(v, step - 1, beta2) if as_rms else v_math
            adamw_reference(p, g, m_math, v_math, step=int(step), max_exp_avg_sq=maxes[i], **hyper)
            if as_rms:
                v.copy_(v_to_rms(v_math, step, beta2))
            for stored, math in ((m, m_math), (v, v_math)):
                if isinstance(stored, Q8):
                    quantize_(stored, math._base)
        if impl == "reference" or len(by_reference) == len(params):
            return
        # torch's fused kernel divides the gradients by its grad_scale (and writes them back unscaled)
        hyper["grad_scale"] = torch.tensor(1.0 / grad_scale, device=device) if grad_scale != 1.0 else None
        kernel = _fused if impl == "fused" else _foreach
        # The moments are ours (contiguous, in their storage dtypes): an fp32 / fp64 parameter whose gradient and
        # moments share its dtype goes native; batches by param dtype on it; None: staged through fp32 scratch.
        batches: dict[torch.dtype | None, list[int]] = {}
        skipped = set(by_reference)
        for i, p in enumerate(params):
            if i not in skipped:
                batches.setdefault(p.dtype if native[i] else None, []).append(i)
        quantized = any(self._quantized.values())
        for dtype, picked in batches.items():
            operands = (params, grads, exp_avgs, exp_avg_sqs) + ((maxes,) if amsgrad else ())
            lists = [[ts[i] for i in picked] for ts in operands]
            # 8-bit moments are blocked per tensor: their tensors are stepped one by one (not merged in runs)
            merged, firsts = (lists, list(range(len(picked)))) if quantized else coalesce(
                lists, keys=[values[i] for i in picked])
            run_steps, run_values = [steps[picked[f]] for f in firsts], [values[picked[f]] for f in firsts]
            if dtype is not None:
                kernel(*merged[:4], run_steps, run_values, {**hyper, "max_exp_avg_sqs": merged[4] if amsgrad else []})
            else:
                run_staged(kernel, list(zip(*merged, strict=True)), run_steps, run_values, as_rms=as_rms,
                           hyper=hyper, scratch=self._scratch, stochastic=self.stochastic_rounding)

    def _moment(self, state: dict[str, Any], which: str, key: str) -> torch.Tensor | Q8:
        """The stored moment ``which`` of one tensor's ``state``: its tensor, or its 8-bit form."""
        if not self._quantized[which]:
            return state[key]
        codes, scales, sqrt = _Q8_KEYS[which]
        return Q8(state[codes], state[scales], self.block_size, sqrt)

    def _check_quantizable(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p.dtype == torch.float64:
                names = {id(q): n for g in self.param_groups for q, n in zip(g["params"], g.get("param_names") or [],
                                                                           strict=False)}
                raise ValueError(f"{self._name}: 8-bit moments (adam.exp_avg_dtype / exp_avg_sq_dtype '8bit') are "
                                 f"updated in fp32, but parameter {names.get(id(p), tuple(p.shape))!r} is "
                                 "torch.float64; make it fp32/bf16 or keep fp32 moments (e.g. a rule routing it to "
                                 "another optimizer)")

    def exported_state(self, tensor: torch.Tensor) -> dict[str, Any]:
        """``state[tensor]`` with 8-bit moments dequantized into fresh fp32 ``exp_avg`` / ``exp_avg_sq`` (the
        portable form checkpoints hold; ``load_state_dict`` takes it into any moment dtype); the live state
        itself when nothing is quantized (empty when the tensor has no state)."""
        state = self.state.get(tensor)
        if not state or not any(self._quantized.values()):
            return state if state is not None else {}
        keys = {k for which, quantized in self._quantized.items() if quantized for k in _Q8_KEYS[which][:2]}
        out = {k: v for k, v in state.items() if k not in keys}
        for which, quantized in self._quantized.items():
            if quantized:
                out[which] = _dequantized(self._moment(state, which, which)).view(tensor.shape).clone()
        return out

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The reused fp32 staging buffers (not state: each step writes them before reading them)."""
        return list(self._scratch.values())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from this class or from ``torch.optim.AdamW`` / ``Adam``.

        The moments keep this optimizer's storage dtypes (torch.optim would cast them to the param dtype), an
        fp16 second moment is converted to or from its ``grad_rms`` form, and back-to-back params get
        back-to-back state again. Shapes and keys are checked first; on an error nothing changes.
        """
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        beta2s = [float(g.get("betas", self.defaults["betas"])[1])
                  for g in state_dict["param_groups"] for _ in g["params"]]
        restored: dict[int, dict[str, Any]] = {}
        if len(saved_ids) == len(params):  # otherwise torch's own check below names the mismatch
            for position, (pid, p) in enumerate(zip(saved_ids, params, strict=True)):
                if state_dict["state"].get(pid):
                    restored[position] = self._restore(position, p, state_dict["state"][pid], beta2s[position])
            # torch's load casts each state value after scanning the groups' parameter lists (quadratic: minutes
            # for 50,000 parameters); the state is restored here, so it gets only the groups.
            state_dict = {**state_dict, "state": {}}
        super().load_state_dict(state_dict)
        for position, state in restored.items():
            self.state[params[position]] = state
        plain = [key for which, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", self._sq_key))
                 if not self._quantized[which]]
        for group in self.param_groups:  # lay out back-to-back state for back-to-back params
            with_state = [p for p in group["params"] if self.state.get(p)]
            for key in plain:  # (each restored tensor is in our dtype already)
                laid_out = copies_in_runs(with_state, [self.state[p][key] for p in with_state])
                for p, tensor in zip(with_state, laid_out, strict=True):
                    self.state[p][key] = tensor

    def _restore(self, position: int, param: torch.Tensor, saved: dict[str, Any], beta2: float) -> dict[str, Any]:
        """This optimizer's form of one saved per-param state (checked, copied, in our dtypes)."""
        where = f"{self._name}.load_state_dict: state of parameter {position} (shape {tuple(param.shape)})"
        saved = dict(saved)
        for which, (codes, scales, sqrt) in _Q8_KEYS.items():  # a saved 8-bit moment: its fp32 values
            if codes in saved and which not in saved:
                if scales not in saved or saved[codes].shape != param.shape:
                    raise ValueError(f"{where}: saved {codes!r} needs shape {tuple(param.shape)} and {scales!r}")
                saved_codes, saved_scales = saved.pop(codes), saved.pop(scales)
                try:
                    block = infer_block(saved_codes.numel(), saved_scales.numel())
                except ValueError as error:
                    raise ValueError(f"{where}: {error}") from None
                saved[which] = _dequantized(Q8(saved_codes.to(param.device), saved_scales.to(param.device),
                                               block, sqrt)).view(param.shape)
        if "exp_avg" not in saved or ("exp_avg_sq" not in saved and _RMS_KEY not in saved):
            raise ValueError(f"{where} has keys {sorted(saved)}, not Adam's 'exp_avg' and 'exp_avg_sq'")
        for key in ("exp_avg", "exp_avg_sq", _RMS_KEY):
            if key in saved and tuple(saved[key].shape) != tuple(param.shape):
                raise ValueError(f"{where}: saved {key!r} has shape {tuple(saved[key].shape)}")
        step = float(saved.get("step", 0))
        if self._quantized["exp_avg_sq"]:
            second = (saved["exp_avg_sq"].to(param.device, torch.float32, copy=True) if "exp_avg_sq" in saved
                      else rms_to_v(saved[_RMS_KEY].to(param.device), step, beta2))
        elif self._sq_key in saved:
            wanted = self._moment_dtype(self.exp_avg_sq_dtype, param)
            second = saved[self._sq_key].to(param.device, wanted, copy=True)
        elif self._sq_key == _RMS_KEY:
            second = v_to_rms(saved["exp_avg_sq"].to(param.device, torch.float32, copy=True), step, beta2)
        else:
            second = rms_to_v(saved[_RMS_KEY].to(param.device), step, beta2)
        rest = {k: v for k, v in saved.items() if k not in ("step", "exp_avg", "exp_avg_sq", _RMS_KEY)}
        out = {"step": torch.tensor(step, dtype=torch.float32), **rest}
        for which, values, dtype in (("exp_avg", saved["exp_avg"], self.exp_avg_dtype),
                                     ("exp_avg_sq", second, self.exp_avg_sq_dtype)):
            if self._quantized[which]:
                self._check_quantizable([param])
                codes, scales, sqrt = _Q8_KEYS[which]
                q = zeros_q8(param, self.block_size, sqrt=sqrt)
                padded = torch.zeros(blocks_of(param.numel(), self.block_size) * self.block_size,
                                     dtype=torch.float32, device=param.device)
                padded[: param.numel()].copy_(values.reshape(-1))
                quantize_(q, padded)
                out.update({codes: q.codes, scales: q.scales})
            else:
                key = "exp_avg" if which == "exp_avg" else self._sq_key
                out[key] = values.to(param.device, self._moment_dtype(dtype, param), copy=True)
        return out


def _dequantized(state: Q8) -> torch.Tensor:
    """The fp32 values of ``state``, flat, in a fresh buffer padded to whole blocks (``._base`` is the buffer)."""
    buffer = torch.empty(blocks_of(state.codes.numel(), state.block) * state.block, dtype=torch.float32,
                         device=state.codes.device)
    return dequantize_(state, buffer)


def _advance_steps(states: list[dict[str, Any]], device: torch.device) -> tuple[list[torch.Tensor], list[float]]:
    """Add 1 to every state's step; return the step tensors and their new values.

    The steps of a group are 0-d views of one 1-D buffer, so the increment is one op instead of one per tensor
    (7 ms per step for 5000 tensors otherwise). Steps that are not (new params, loaded state) move into a fresh
    buffer first.
    """
    steps = [state["step"] for state in states]
    base = steps[0]._base if isinstance(steps[0], torch.Tensor) else None
    if (base is None or base.dim() != 1 or base.device != device or base.dtype != torch.float32
            or any(not isinstance(s, torch.Tensor) or s._base is not base for s in steps)):
        base = torch.tensor([float(s) for s in steps], dtype=torch.float32, device=device)
        steps = list(base.unbind())
        for state, step in zip(states, steps, strict=True):
            state["step"] = step
    if len(steps) == base.numel():  # every slot is here: one add, and usually one common value
        base.add_(1)
        all_values = base.tolist()
        if min(all_values) == max(all_values):
            return steps, [all_values[0]] * len(steps)
    slots = [s.storage_offset() - base.storage_offset() for s in steps]
    if len(steps) != base.numel():
        base.index_add_(0, torch.tensor(slots, device=device), torch.ones(len(slots), device=device))
        all_values = base.tolist()
    return steps, [all_values[i] for i in slots]


def _fused(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], values: list[float],
           hyper: dict[str, Any]) -> None:
    """torch's fused Adam(W) kernel over tensors of one dtype and device (it reads the steps itself)."""
    kernel = torch._fused_adamw_ if hyper["decoupled"] else torch._fused_adam_
    maxes = hyper.get("max_exp_avg_sqs") or []
    kernel(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, lr=hyper["lr"], beta1=hyper["beta1"],
           beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"], amsgrad=bool(maxes),
           maximize=hyper.get("maximize", False), grad_scale=hyper["grad_scale"])


def _foreach(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
             exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], values: list[float],
             hyper: dict[str, Any]) -> None:
    """``adamw_reference`` over lists with ``torch._foreach_*`` ops (the same ops, so the same bits)."""
    lr, beta1, beta2, wd = hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["weight_decay"]
    maxes = hyper.get("max_exp_avg_sqs") or []
    if hyper.get("maximize", False):
        grads = torch._foreach_neg(grads)
    if wd != 0:
        if hyper["decoupled"]:
            torch._foreach_mul_(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    if maxes:
        torch._foreach_maximum_(maxes, exp_avg_sqs)
    denom = torch._foreach_sqrt(maxes or exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - beta2**s) ** 0.5 for s in values])
    torch._foreach_add_(denom, hyper["eps"])
    torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / (1 - beta1**s) for s in values])
