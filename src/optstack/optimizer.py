"""Several stages stepped as one ``torch.optim.Optimizer``: one loss scaler, one global grad norm, one clip
factor, one skip decision, one state dict.

Dense and expert parameters, or Muon and its scalar optimizer, live in separate stages; a plain optimizer
is a chain of one stage; a rank with nothing to optimize holds a chain of none (it still steps, as a null
optimizer). The step reads every gradient once before the update (``Stage.grad_stats``) and syncs with the
host once for the norm and the finite check of all stages together.

torch's contract holds: ``param_groups`` are the model-side groups (every parameter of the group, on every
rank; live: a torch LR scheduler or optstack's ``Scheduler`` writes ``lr`` there and the next step uses it),
``state`` maps each model parameter to its state, ``step(closure)`` returns the closure's loss, ``state_dict``
is torch's format, and torch's step and state-dict hooks run. What a step did is ``last_result``.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from optstack.clip import check_norm_type, clip_coefficient
from optstack.precision.scaler import LossScaler, NoScaler
from optstack.protocol import StepResult, algorithm_name, phase
from optstack.qk_clip import row_factors_of
from optstack.stage import Stage
from optstack.stage.sharded import is_sharded, local_part
from optstack.torch_state import OptimizerState, check_names, check_shapes

__all__ = ["ChainedOptimizer", "GradSync"]


class GradSync(Protocol):
    """What a data-parallel wrapper offers the optimizer (optstack's ``DataParallel`` is one)."""

    def finish_grad_sync(self) -> None: ...

    def zero_grad_buffer(self) -> None: ...


class ChainedOptimizer(torch.optim.Optimizer):
    """Steps a sequence of stages as one optimizer.

    Args:
        stages: the stages, each over its own parameters (no parameter in two stages).
        scaler: the one loss scaler of the run (default: ``NoScaler``).
        clip_grad: clip the global grad norm to this value; 0 disables clipping.
        norm_type: p of the grad norm (2.0; ``float('inf')`` for the max-norm).
        grad_norm_skip_threshold: skip the whole step when the global grad norm exceeds this (None: never).
        log_num_zeros_in_grad: count zero gradient elements into ``StepResult.num_zeros``.
        grad_syncs: objects owning the model's gradients (data-parallel wrappers): ``step`` first calls
            their ``finish_grad_sync()`` (a no-op when the training loop already did) and ``zero_grad``
            their ``zero_grad_buffer()``.
        norm_groups: names of separate norm groups (the same on every rank): a parameter that ``norm_group_of``
            puts in one is left out of the global norm (what the skip threshold reads and ``grad_norm``
            reports) and is clipped by the norm of its group's gradients alone (e.g. an auxiliary loss's head).
        norm_group_of: a parameter -> its group's name, or None for the global norm (default: all None).
        defaults: torch's ``defaults`` (the settings a group added without them gets); default: the first
            stage's inner optimizer's.

    Attributes:
        param_groups: every stage's model-side groups, in stage order (live dicts, one list).
        last_result: the ``StepResult`` of the latest ``step()`` (None before the first).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        scaler: LossScaler | None = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        grad_norm_skip_threshold: float | None = None,
        log_num_zeros_in_grad: bool = False,
        grad_syncs: Sequence[GradSync] = (),
        defaults: Mapping[str, Any] | None = None,
        norm_groups: Sequence[str] = (),
        norm_group_of: Callable[[torch.Tensor], str | None] | None = None,
    ) -> None:
        stages = list(stages)
        seen: dict[int, int] = {}
        for index, stage in enumerate(stages):
            if not isinstance(stage, Stage):
                raise ValueError(f"stages[{index}] must be an optstack Stage, got {type(stage).__name__}")
            for group in stage.param_groups:
                for param in group["params"]:
                    if seen.setdefault(id(param), index) != index:
                        raise ValueError(
                            f"a parameter of shape {tuple(param.shape)} is in stages[{seen[id(param)]}] and "
                            f"stages[{index}]; every parameter must belong to exactly one stage")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise ValueError(f"scaler must be a LossScaler (NoScaler, ConstantScaler, DynamicScaler), got {scaler!r}")
        if isinstance(clip_grad, bool) or not isinstance(clip_grad, (int, float)) or not clip_grad >= 0:
            raise ValueError(f"clip_grad must be a number >= 0 (0 disables clipping), got {clip_grad!r}")
        if grad_norm_skip_threshold is not None and not (
            isinstance(grad_norm_skip_threshold, (int, float)) and grad_norm_skip_threshold > 0
        ):
            raise ValueError(f"grad_norm_skip_threshold must be None or a number > 0, got {grad_norm_skip_threshold!r}")
        # torch.optim.Optimizer.__init__ would add the groups through add_param_group; the stages hold them
        # already, so set what it sets (hooks, the patched step that runs them) and nothing else.
        self.defaults = dict(defaults if defaults is not None else stages[0].optimizer.defaults if stages else {})
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._stages = stages
        self.param_groups: list[dict[str, Any]] = [g for stage in stages for g in stage.param_groups]
        self._scaler: LossScaler = scaler if scaler is not None else NoScaler()
        self.clip_grad = float(clip_grad)
        self.norm_type = check_norm_type(norm_type)
        self.grad_norm_skip_threshold = grad_norm_skip_threshold
        self.log_num_zeros_in_grad = bool(log_num_zeros_in_grad)
        self._grad_syncs = list(grad_syncs)
        self.norm_groups = tuple(norm_groups)
        self.norm_group_of = norm_group_of
        self.norms_by_group: dict[str, float] = {}  # each separate group's norm, of the latest step
        self._label_stages()
        self.last_result: StepResult | None = None
        self._has_state = False  # the same on every rank (steps and loads are collective), unlike len(state)
        self._extra: dict[int, dict[Any, Any]] = {}  # users' own entries of state[param], by id of the param
        self._other: dict[Any, Any] = {}  # users' entries of state under keys that are not parameters
        self._stage_of: dict[int, Stage] = {id(p): stage for stage in stages for g in stage.param_groups
                                            for p in g["params"]}  # the stage of each model parameter (by id)

    def __repr__(self) -> str:
        kinds = ", ".join(repr(s) for s in self._stages)
        return f"ChainedOptimizer([{kinds}], scaler={type(self._scaler).__name__}, clip_grad={self.clip_grad})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an optstack optimizer cannot be pickled or deep-copied (it holds views of the model and "
                        "process groups). For a snapshot of its state: copy.deepcopy(optimizer.state_dict()), or "
                        "optstack.checkpoint.save_checkpoint; for a second model (EMA, a copy to experiment on): "
                        "deepcopy the model, then build_optimizer(config, copy) for it")

    # -- views ---------------------------------------------------------------------------------------
    @property
    def stages(self) -> list[Stage]:
        return list(self._stages)

    @property
    def scaler(self) -> LossScaler:
        return self._scaler

    @property
    def state(self) -> OptimizerState:  # type: ignore[override]
        """Model parameter -> its optimizer state on this rank (torch's ``optimizer.state``), a mapping users may
        write: optstack's own entries are the live state tensors, shaped like the parameter when this rank steps
        it whole, else this rank's flat range of it (ZeRO-1), and ``"master"`` (the fp32 master) for bf16/fp16
        parameters; writing one of those copies into the live tensor. Any other key (``state[p]["ema"] = t``,
        before or after the first step, or ``state["tag"] = 1`` under a key that is not a parameter) is kept
        beside them, saved by ``state_dict()`` and restored by ``load_state_dict``. A parameter appears once it
        has an entry of either kind."""
        return OptimizerState(self)

    def _live_entry(self, param: torch.Tensor) -> dict[str, Any]:
        """optstack's own state of one model parameter on this rank (live; empty before its first step)."""
        stage = self._stage_of.get(id(param))
        return stage.torch_entry(param) if stage is not None else {}

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current loss scale; call ``backward()`` on this."""
        return self._scaler.scale_loss(loss)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of new parameters (torch's semantics), to the stage of its ``"algorithm"`` (default: the
        first stage). Only where parameters are stepped whole from their own ``.grad``; elsewhere (ZeRO-1,
        layer-wise, a data-parallel wrapper) a ``ValueError`` says why and nothing changes."""
        if not isinstance(param_group, dict):
            raise ValueError(f"add_param_group needs a dict with 'params', got {type(param_group).__name__}")
        if isinstance(param_group.get("params"), torch.Tensor):
            param_group = {**param_group, "params": [param_group["params"]]}
        if not self._stages:
            raise ValueError("add_param_group: this optimizer has no stages (no parameters on this rank)")
        wanted = param_group.get("algorithm")
        stages = [s for s in self._stages
                  if wanted is None or algorithm_name(s.optimizer).lower() == str(wanted).lower()
                  or any(g.get("algorithm") == wanted for g in s.param_groups)]
        if not stages:
            have = sorted({str(g.get("algorithm")) for g in self.param_groups})
            raise ValueError(f"add_param_group: no stage steps algorithm {wanted!r} (this optimizer has {have}); "
                             "build the optimizer with a rule routing some parameters to it")
        added = stages[0].add_param_group(param_group)
        self.param_groups[:] = [g for stage in self._stages for g in stage.param_groups]
        self._stage_of |= {id(p): stages[0] for p in added["params"]}
        self._label_stages()

    def _label_stages(self) -> None:
        """Each stage's norm terms' and pieces' group indices (0: the global norm, k: ``norm_groups[k - 1]``);
        None for a stage with none outside the global norm."""
        index = {name: k for k, name in enumerate(self.norm_groups, 1)}

        def label(param: torch.Tensor) -> int:
            name = self.norm_group_of(param) if self.norm_group_of is not None else None
            if name is not None and name not in index:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is in norm group {name!r}, which is "
                                 f"not among norm_groups {list(self.norm_groups)}")
            return 0 if name is None else index[name]

        self._norm_labels: list[torch.Tensor | None] = [None] * len(self._stages)
        self._piece_labels: list[list[int] | None] = [None] * len(self._stages)
        if self.norm_group_of is None:
            return
        self._norm_labels, self._piece_labels = [], []
        for stage in self._stages:
            terms = [label(p) for p in stage.norm_params()]
            pieces = [label(p.param) for p in stage.pieces]
            self._norm_labels.append(torch.tensor(terms, dtype=torch.int64, device=stage.device)
                                     if any(terms) else None)
            self._piece_labels.append(pieces if any(pieces) else None)

    # -- the step ------------------------------------------------------------------------------------
    # torch.compile of a train step (or of opt.step) runs the step eagerly, as one graph break: it decides on
    # the host (finite check, skip, clip factor, step counts) and its kernels are fused / foreach already, so
    # tracing it gains nothing, and dynamo's fake tensors lack what it reads (views' _base, data pointers).
    @torch.compiler.disable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of every stage, or of none; returns the closure's loss (None without one), as torch.

        ``closure``, if given, is called first with grad enabled. A non-finite gradient in any stage skips
        the step (no parameter, optimizer state or step count changes; ``last_result.grad_norm`` is None);
        a global norm above ``grad_norm_skip_threshold`` skips it too. ``last_result`` says what happened.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_result = self._step()
        return loss

    def _step(self) -> StepResult:
        if self._grad_syncs:
            with phase("finish_grad_sync"):
                for sync in self._grad_syncs:
                    sync.finish_grad_sync()
        inv_scale = self._scaler.inv_scale
        with phase("grad_norm"):
            totals, nonfinite = self.global_stats()
        self._scaler.update(nonfinite)
        if nonfinite:
            return StepResult(applied=False, grad_norm=None, num_zeros=None, loss_scale=self._scaler.scale)
        inf = math.isinf(self.norm_type)
        norms = [(total if inf else total ** (1.0 / self.norm_type)) * inv_scale for total in totals]
        grad_norm = norms[0]
        self.norms_by_group = dict(zip(self.norm_groups, norms[1:], strict=True))
        if self.grad_norm_skip_threshold is not None and grad_norm > self.grad_norm_skip_threshold:
            return StepResult(applied=False, grad_norm=grad_norm, num_zeros=None, loss_scale=self._scaler.scale)
        self._has_state = True
        coeffs = [clip_coefficient(n, self.clip_grad) if self.clip_grad > 0 else 1.0 for n in norms]
        coeff = coeffs[0]
        num_zeros = None
        if self.log_num_zeros_in_grad:
            with phase("count_zeros"):
                counts = [stage.count_zeros() for stage in self._stages]
                num_zeros = int(sum(int(c.item()) for c in counts))
        with phase("inner_step"):
            for stage, labels in zip(self._stages, self._piece_labels, strict=True):
                ratios = None if labels is None else [coeffs[k] / coeff for k in labels]
                stage.step(grad_scale=inv_scale * coeff, piece_scales=ratios)
        return StepResult(applied=True, grad_norm=grad_norm, num_zeros=num_zeros, loss_scale=self._scaler.scale)

    @property
    def grad_syncs(self) -> list[Any]:
        """The gradient syncs (data-parallel wrappers) this optimizer finishes before reading gradients."""
        return list(self._grad_syncs)

    def global_stats(self) -> tuple[list[float], bool]:
        """``(per norm group, the global one first: the sum over stages of sum |g|^p, or the max for inf; whether
        any gradient is non-finite)``, reduced over every stage's groups (collective) with one host sync for all
        stages: what the step clips and skips by."""
        count = 1 + len(self.norm_groups)
        if not self.norm_groups:
            stats = [stage.grad_stats(self.norm_type) for stage in self._stages]
        else:
            stats = [stage.grad_stats(self.norm_type, labels, count)
                     for stage, labels in zip(self._stages, self._norm_labels, strict=True)]
        if not stats:
            return [0.0] * count, False
        stacked = torch.stack([s.to(stats[0].device) for s in stats])
        norms = stacked[:, :-1].amax(0) if math.isinf(self.norm_type) else stacked[:, :-1].sum(0)
        *totals, nonfinite = torch.cat([norms, stacked[:, -1].max().reshape(1)]).tolist()
        return totals, nonfinite > 0

    def finish_param_sync(self) -> None:
        """Wait for every stage's overlapped parameter gathers (before evaluation or saving)."""
        for stage in self._stages:
            stage.finish_param_sync()

    def clip_qk(self, max_logits: Mapping[tuple[str, str], torch.Tensor], *, threshold: float,
                alpha: float = 0.5) -> float:
        """QK-clip (``optstack.qk_clip``; Kimi's MuonClip, Megatron's ``clip_qk``), after ``step()``: for each
        ``(query weight name, key weight name)`` pair, the heads whose largest logit (``max_logits[pair]``, shape
        ``(heads,)``, already reduced over the data-parallel ranks) exceeds ``threshold`` get their query rows
        scaled by ``(threshold / S) ** alpha`` and key rows by ``(threshold / S) ** (1 - alpha)``, in the weights
        the optimizer holds (masters, shards), then published to the model. Collective. Returns the largest logit.
        """
        shapes = {n: tuple(p.shape) for g in self.param_groups for n, p in zip(g["param_names"], g["params"],
                                                                              strict=True)}
        factors = row_factors_of(max_logits, shapes, threshold, alpha)
        for stage in self._stages:
            stage.scale_rows(factors)
        return max((float(t.max()) for t in max_logits.values()), default=0.0)

    def train(self) -> None:
        """Training weights in the parameters, for algorithms that swap them (Schedule-Free: ``y``); a no-op for
        the others. Collective (each stage publishes as after a step)."""
        for stage in self._stages:
            stage.swap_weights("train")

    def eval(self) -> None:
        """The weights to evaluate in the parameters, for algorithms that swap them (Schedule-Free: the average
        ``x``); a no-op for the others. Call ``train()`` before the next step. Collective."""
        for stage in self._stages:
            stage.swap_weights("eval")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient: the data-parallel wrappers' buffers, and each parameter's ``.grad``."""
        for sync in self._grad_syncs:
            sync.zero_grad_buffer()
        for stage in self._stages:
            stage.zero_grad(set_to_none)

    def offload_states(self) -> int:
        """Move every stage's masters, remainders and optimizer state to host memory (pinned and asynchronous
        on CUDA) and free their device memory, e.g. while the device serves generation between steps. The
        model's parameters and gradients stay. Returns the bytes moved (this rank)."""
        return sum(stage.offload_states() for stage in self._stages)

    def reload_states(self) -> None:
        """Bring back what ``offload_states`` moved, bit for bit (the next step is what it would have been).
        A step, ``state_dict`` or a load reloads by itself; call this to start the copies early."""
        for stage in self._stages:
            stage.reload_states()

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's format, for this rank: ``{"state": {i: {key: value}}, "param_groups": [{settings...,
        "params": [i, ...], "param_names": [...]}], "optstack": {"version": 2, "scaler": {...}, "has_state": bool}}``,
        ``i`` numbering the parameters of ``param_groups`` as torch does (position in order; a parameter listed
        again keeps its first number). State is as ``state`` shows it (references to the live tensors:
        ``torch.save`` or copy to snapshot), users' own entries included (their keys listed under
        ``"optstack"["user_keys"]``), and ``state`` entries under keys that are not parameters as they are. Only
        this rank's part of a sharded placement: for a checkpoint that loads at any data-parallel size use
        ``optstack.checkpoint`` or DCP."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        held = {k: e for stage in self._stages for k, e in stage.sharded_torch_state().items()}
        numbers: dict[int, int] = {}
        groups = []
        start = 0
        for group in self.param_groups:
            numbers.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in numbers})
            packed = [numbers[id(p)] for p in group["params"]]
            start += len(packed)
            groups.append({k: v for k, v in group.items() if k != "params"} | {"params": packed})
        state: dict[Any, dict[str, Any]] = {}
        user_keys: dict[int, list[Any]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                index = numbers[id(param)]
                if index in state:
                    continue
                entry = held.get(id(param)) or {}
                extra = {k: v for k, v in self._extra.get(id(param), {}).items() if k not in entry}
                if entry or extra:
                    state[index] = dict(sorted(entry.items())) | extra  # one key order, however the state was made
                if extra:
                    user_keys[index] = list(extra)
        state.update(self._other)
        has_state = self._has_state and any(stage.keeps_state() for stage in self._stages)
        meta: dict[str, Any] = {"version": _STATE_VERSION, "scaler": self._scaler.state_dict(), "has_state": has_state}
        if user_keys:
            meta["user_keys"] = user_keys
        out = {"state": state, "param_groups": groups, "optstack": meta}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            out = post_hook(self, out) or out
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a ``state_dict()`` of an optimizer over the same groups (torch's rule: parameters are matched by
        position in ``param_groups``, whatever ids the dict uses), all or nothing: everything is checked
        before anything changes, and a mismatch is a ``ValueError`` naming it. Names are compared only where
        both sides have real ones (not the placeholders ``param.0``, ... of an optimizer built on bare
        tensors); where only the state dict has them, this optimizer takes them. Group settings are taken
        from the dict; the loss scaler's state too when it has an ``"optstack"`` entry. A state dict of optstack
        0.2 (``{"stages": [...], "scaler": ...}``) loads as well."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        if isinstance(state_dict, Mapping) and {"stages", "scaler"} <= state_dict.keys():
            self._load_stages(state_dict)
        else:
            self._load_torch(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_torch(self, state_dict: Any) -> None:
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(f"an optimizer state dict needs 'state' and 'param_groups' (from state_dict()); got {got}")
        saved = state_dict["param_groups"]
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.param_groups):
            got = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            raise ValueError(f"the state dict has {got} param groups, this optimizer has {len(self.param_groups)}; "
                             "it was saved from an optimizer built over other parameters or rules")
        meta = state_dict.get("optstack", {})
        user_keys = meta.get("user_keys", {})
        saved_state = state_dict["state"]
        entries: dict[int, Any] = {}
        extras: dict[int, dict[Any, Any]] = {}
        referenced = set()
        adopt: list[list[str] | None] = []
        for index, (theirs, ours) in enumerate(zip(saved, self.param_groups, strict=True)):
            ids = theirs.get("params") if isinstance(theirs, Mapping) else None
            if not isinstance(ids, (list, tuple)) or len(ids) != len(ours["params"]):
                got = len(ids) if isinstance(ids, (list, tuple)) else repr(ids)
                raise ValueError(f"param group {index} holds {got} parameters in the state dict, "
                                 f"{len(ours['params'])} here; it was saved from an optimizer over other parameters")
            adopt.append(check_names(index, theirs.get("param_names"), ours.get("param_names")))
            for key, param in zip(ids, ours["params"], strict=True):
                referenced.add(key)
                if key in saved_state and id(param) not in entries:
                    entry = dict(saved_state[key]) if isinstance(saved_state[key], Mapping) else saved_state[key]
                    own = user_keys.get(key, user_keys.get(str(key), ())) if isinstance(entry, dict) else ()
                    extras[id(param)] = {k: entry.pop(k) for k in own if k in entry}
                    entries[id(param)] = _local(entry)
                    check_shapes(param, entries[id(param)], ours, index)
        # (the saved entries, not this rank's parts of them: a ZeRO-1 rank may own no part of a saved state)
        if meta.get("has_state") and not saved_state and any(g["params"] for g in self.param_groups):
            raise ValueError(
                "the state dict was saved with optimizer state but holds none: a dcp.load into an optimizer that "
                "has no state yet has no tensors to read it into. Load through "
                "optstack.checkpoint.OptimizerState(model, optimizer) (or get/set_optimizer_state_dict)")
        loaded = [stage.shards_from_torch(entries) for stage in self._stages]
        scaler = meta.get("scaler")
        if scaler is not None:
            self._scaler.validate_state_dict(scaler)
        for stage, shards in zip(self._stages, loaded, strict=True):
            stage.load_param_shards(shards)
        self._has_state = self._has_state or any(entries.values())
        self._extra = {key: extra for key, extra in extras.items() if extra}
        self._other = {k: v for k, v in saved_state.items() if k not in referenced}
        for theirs, ours, names in zip(saved, self.param_groups, adopt, strict=True):
            ours.update({k: copy.deepcopy(v) for k, v in theirs.items() if k not in ("params", "param_names")})
            if names is not None:
                ours["param_names"] = names
        for stage in self._stages:
            stage.sync_settings()
        if scaler is not None:
            self._scaler.load_state_dict(scaler)

    def _load_stages(self, state_dict: Mapping[str, Any]) -> None:
        parts = state_dict["stages"]
        if not isinstance(parts, (list, tuple)) or len(parts) != len(self._stages):
            got = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
            raise ValueError(f"state dict has {got} stages, this optimizer has {len(self._stages)}; it was saved "
                             "from an optimizer built with a different set of stages (dense/expert, algorithms)")
        for index, (stage, part) in enumerate(zip(self._stages, parts, strict=True)):
            try:
                stage.validate_state_dict(part)
            except ValueError as exc:
                raise ValueError(f"stages[{index}] ({stage!r}): {exc}") from exc
        self._scaler.validate_state_dict(state_dict["scaler"])
        for stage, part in zip(self._stages, parts, strict=True):
            stage.load_state_dict(part)
        self._scaler.load_state_dict(state_dict["scaler"])


_STATE_VERSION = 2


def _local(entry: Any) -> dict[str, Any]:
    """A parameter's state with ``ShardedTensor``s (``Stage.sharded_torch_state``) and DTensors cut to this rank's
    part."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"a parameter's state must be a dict of state values, got {type(entry).__name__}")
    out = {}
    for key, value in entry.items():
        if is_sharded(value):
            if (value := local_part(value)) is None:
                continue
        elif isinstance(value, DTensor):  # a DTensor stage's state (stage/dtensor.py): this rank's shard
            value = value.to_local()
        out[key] = value
    return out
