"""Megatron's ``ChainedOptimizer`` (and ``ProxyDict``, its view of the chained optimizers' state): the stages of
every optimizer given joined into one core chain, so they share one norm, one clip factor and one skip decision.
Objects implementing Megatron's optimizer protocol themselves are stepped through it, as Megatron steps them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from optstack.megatron.core_chain import _core_chain, _skip_threshold
from optstack.megatron.norm_groups import _validate_grad_norm_group, clip_by_groups, grad_norm, separate_group_of
from optstack.megatron.optimizers import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from optstack.precision.scaler import NoScaler
from optstack.stage import Stage

__all__ = ["ChainedOptimizer", "ProxyDict"]


_PROTOCOL = ("prepare_grads", "get_grad_norm", "step_with_ready_grads")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class ProxyDict(Mapping[tuple[int, Any], Any]):
    """Megatron's view of several optimizers' ``state`` as one mapping keyed ``(optimizer index, key)``."""

    def __init__(self, inner_dicts: Sequence[Any]) -> None:
        self._inner_dicts = list(inner_dicts)

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        index, inner_key = key
        return self._inner_dicts[index].get(inner_key)

    def __setitem__(self, key: tuple[int, Any], value: Any) -> None:
        index, inner_key = key
        self._inner_dicts[index][inner_key] = value

    def __len__(self) -> int:
        return sum(len(d) for d in self._inner_dicts)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return ((i, k) for i, d in enumerate(self._inner_dicts) for k in d)


class ChainedOptimizer(MegatronOptimizer):
    """Megatron's ``ChainedOptimizer``: several optimizers stepped as one (one global grad norm, one clip
    factor, one skip decision; dense and expert optimizers, or Muon and its scalar optimizer).

    Args:
        chained_optimizers: the optimizers: this module's (their stages join one core chain, with the first
            one's loss scaler and config), or plain ``torch.optim`` optimizers (stepped as an
            ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` by their dtype would step them, with
            the chain's config; without any Megatron optimizer in the chain: no clipping, no loss scaling).
            Other objects with ``param_groups`` are listed and zeroed but cannot be stepped. Empty on a rank
            without parameters.

    Attributes:
        chained_optimizers: as given. config: the first Megatron optimizer's config (None without one).
        built: optstack's ``BuiltOptimizer`` when ``get_megatron_optimizer`` built it, else None.
    """

    def __init__(self, chained_optimizers: Sequence[Any]) -> None:
        self.chained_optimizers = list(chained_optimizers)
        self.built: Any = None
        configs = [o.config for o in self.chained_optimizers
                   if isinstance(o, MegatronOptimizer) or all(hasattr(o, k) for k in _PROTOCOL + ("config",))]
        config = configs[0] if configs else None
        super().__init__(None, config, None)
        self.is_stub_optimizer = all(getattr(o, "is_stub_optimizer", False) for o in self.chained_optimizers)
        self._members = [self._member(o, config) for o in self.chained_optimizers]
        stages = [s for m in self._members if m is not None for s in m.stages]
        chains = [m._chain for m in self._members if m is not None and m.stages]
        shared = chains[0] if chains and all(c is chains[0] for c in chains) else None
        if shared is not None and shared.stages == stages:
            self._chain = shared  # built together (get_megatron_optimizer): one chain already
        else:
            scaler = chains[0].scaler if chains else NoScaler()
            syncs = list({id(s): s for c in chains for s in c.grad_syncs}.values())
            self._chain = _core_chain(stages, config, scaler, syncs)  # config None: no clip, no skip

    @staticmethod
    def _member(optimizer: Any, config: Any) -> MegatronOptimizer | None:
        if isinstance(optimizer, MegatronOptimizer):
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            low = any(p.dtype in _LOW_PRECISION for g in optimizer.param_groups for p in g["params"])
            return (Float16OptimizerWithFloat16Params(optimizer, config, None) if low
                    else FP32Optimizer(optimizer, config))
        return None

    @property
    def stages(self) -> list[Stage]:
        return self._chain.stages

    @property
    def optimizer(self) -> Any:  # type: ignore[override]
        """The one chained optimizer's torch optimizer (Megatron's backward-compatible accessor)."""
        if len(self.chained_optimizers) != 1:
            raise ValueError(f"ChainedOptimizer.optimizer needs exactly one chained optimizer, there are "
                             f"{len(self.chained_optimizers)}; use chained_optimizers[i].optimizer")
        only = self.chained_optimizers[0]
        return only if isinstance(only, torch.optim.Optimizer) else only.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        pass  # MegatronOptimizer.__init__'s assignment; the chained optimizers hold theirs

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every chained optimizer's groups, in order (live dicts)."""
        return [g for o in self.chained_optimizers for g in o.param_groups]

    @property
    def state(self) -> ProxyDict:  # type: ignore[override]
        """``(index into chained_optimizers, tensor) -> state``, Megatron's ``ProxyDict``."""
        return ProxyDict([o.state for o in self.chained_optimizers])

    def get_parameters(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for o in self.chained_optimizers:
            out += o.get_parameters() if hasattr(o, "get_parameters") else [
                p for g in o.param_groups for p in g["params"]]
        return out

    def step(self) -> tuple[bool, float | None, int | None]:
        unsteppable = [type(o).__name__ for o, m in zip(self.chained_optimizers, self._members, strict=True)
                       if m is None]
        if unsteppable and len(unsteppable) == len(self.chained_optimizers) and all(
                all(hasattr(o, k) for k in _PROTOCOL) for o in self.chained_optimizers):
            return self._step_protocol()
        if unsteppable:
            raise ValueError(f"ChainedOptimizer.step: {unsteppable} are neither optstack.megatron optimizers nor "
                             "torch.optim optimizers; chain those only")
        return super().step()  # over self._chain, which holds every member's stage

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any chained optimizer holds parameters of ``grad_norm_group`` (on any rank)."""
        _validate_grad_norm_group(grad_norm_group)
        cache = vars(self).setdefault("_has_grad_norm_group_cache", {})
        if grad_norm_group not in cache:
            # an object without Megatron's grad-norm-group methods (an older protocol) holds no such group
            cache[grad_norm_group] = any(o.has_grad_norm_group(grad_norm_group) for o in self.chained_optimizers
                                         if hasattr(o, "has_grad_norm_group"))
        return cache[grad_norm_group]

    def get_grad_norm(self) -> float:
        """The main norm over every chained optimizer (each reduced over its own grad-stats group)."""
        return math.sqrt(sum(float(o.get_grad_norm() or 0.0) ** 2 for o in self.chained_optimizers))

    @torch.no_grad()
    def _get_grad_norm_for_group(self, grad_norm_group: str) -> float:
        _validate_grad_norm_group(grad_norm_group)
        norms = [grad_norm(o.get_grads_for_grad_norm(grad_norm_group), o.get_grad_stats_parallel_group())
                 for o in self.chained_optimizers if hasattr(o, "get_grads_for_grad_norm")]
        return math.sqrt(sum(n * n for n in norms))

    @torch.no_grad()
    def _step_protocol(self) -> tuple[bool, float | None, int | None]:
        """Megatron's chained step over objects that implement Megatron's optimizer protocol themselves
        (``prepare_grads``, ``get_grad_norm``, ``step_with_ready_grads``): one skip decision for all, read
        from the main norm; gradients in a separate gradient-norm group (MTP) clipped by their group's norm."""
        self.grad_norms_by_group = {}
        if any([o.prepare_grads() for o in self.chained_optimizers]):  # every one prepares, as in Megatron
            return False, None, None
        main_norm = self.get_grad_norm()
        live = [o for o in self.chained_optimizers if not getattr(o, "is_stub_optimizer", False)]
        if any(o.config.clip_grad > 0.0 for o in live):
            self._compute_grad_norms_by_group()
        skip = False
        for o in live:
            params = o.get_parameters()
            if o.config.clip_grad > 0.0:
                clip_by_groups(params, o.config.clip_grad, main_norm, self.grad_norms_by_group)
            threshold = _skip_threshold(o.config)
            in_main = any(separate_group_of(p) is None for p in params)
            skip = skip or (in_main and threshold is not None and main_norm > threshold)
        zeros = None
        if self.config is not None and getattr(self.config, "log_num_zeros_in_grad", False):
            zeros = sum(int(o.count_zeros()) for o in self.chained_optimizers)
        if skip:
            return False, main_norm, zeros
        return all([o.step_with_ready_grads() for o in self.chained_optimizers]), main_norm, zeros

    def state_dict(self) -> Any:  # type: ignore[override]
        """Megatron's: the one chained optimizer's state dict, or a list of each chained optimizer's."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [o.state_dict() for o in self.chained_optimizers]

    def load_state_dict(self, state_dict: Any) -> None:
        """Load ``state_dict()``'s form: one chained optimizer's dict, or a list (or ``{index: dict}``) with one
        per chained optimizer; also the whole chain's dict (``sharded_state_dict()["optimizer"]``).

        Raises:
            ValueError: a list of another length than ``chained_optimizers``.
        """
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if isinstance(state_dict, Mapping) and "param_groups" in state_dict:
            super().load_state_dict(state_dict)
            return
        parts = [v for _, v in sorted(state_dict.items())] if isinstance(state_dict, Mapping) else list(state_dict)
        if len(parts) != len(self.chained_optimizers):
            raise ValueError(f"ChainedOptimizer.load_state_dict: expected {len(self.chained_optimizers)} entries "
                             f"(one per chained optimizer), got {len(parts)}")
        for optimizer, part in zip(self.chained_optimizers, parts, strict=True):
            optimizer.load_state_dict(part)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._chain.zero_grad(set_to_none)
        for o, m in zip(self.chained_optimizers, self._members, strict=True):
            if m is None and hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[type(o).__name__ for o in self.chained_optimizers]})"
