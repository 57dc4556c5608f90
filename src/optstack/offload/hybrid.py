"""CPU offload: ``HybridDeviceOptimizer`` steps a fraction of an inner optimizer's tensors on the host.

It stands where the inner ``torch.optim`` optimizer stands (``offloaded`` wraps a stage's ``make_optimizer``),
so stages know nothing of offload. The device tensors and gradients stay the truth (stages publish them, loads
write them); the host holds the offloaded ones' optimizer state and does their update. A tensor the stage
already keeps in host memory (an fp32 master of an offloaded piece: ``Masters(host_fraction=...)``, so the
device holds no master for it) is stepped in place, with no copy either way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import torch

from optstack.offload.states import scratch_of
from optstack.offload.transfers import Pairs, Transfers
from optstack.protocol import MakeOptimizer, algorithm_name, phase, unhooked_step

__all__ = ["DEFAULT_CHUNK_NUMEL", "HybridDeviceOptimizer", "offloaded", "plan_offload"]

#: Elements per host chunk (64 MiB of fp32): per-chunk costs vanish, yet a chunk's copy back overlaps the next step.
DEFAULT_CHUNK_NUMEL = 1 << 24

_OWN_KEYS = ("params", "param_names")  # group keys each sub-optimizer keeps its own of; the rest is synced
_Owner = tuple[torch.optim.Optimizer, torch.Tensor]  # the sub-optimizer stepping a device tensor, what it steps


def _check_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload fraction must be a number in [0, 1], got {fraction!r}")


def plan_offload(numels: Sequence[int], fraction: float) -> int:
    """How many leading tensors go to the host: the longest prefix of ``numels`` (group order) holding at most
    ``fraction`` (in [0, 1], else ValueError) of all elements; 0 for ``fraction=0``."""
    _check_fraction(fraction)
    budget = fraction * sum(numels)
    return 0 if fraction == 0 else sum(1 for taken in accumulate(numels) if taken <= budget)


@dataclass(eq=False)
class _Chunk:
    """Offloaded tensors stepped by one host optimizer, moved together (lists in group order)."""

    optimizer: torch.optim.Optimizer
    device: list[torch.Tensor]  # the device tensors
    host: list[torch.Tensor]  # their host copies (what the host optimizer steps), back to back
    grads: list[torch.Tensor]  # host gradient buffers, back to back
    versions: list[int]  # each device tensor's version counter after our last write


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Steps the first ``fraction`` of an inner optimizer's elements on the host, the rest on the device.

    The leading tensors in group order (``plan_offload``) get host copies (pinned on CUDA) stepped in chunks by
    host optimizers of the same algorithm. ``state`` maps each device tensor to its state wherever that lives, so
    ``state_dict`` has the inner optimizer's form and, with its ``algorithm_name``, checkpoints move between
    offloaded and plain. Groups are fixed at construction.

    Args:
        inner: the optimizer over the device tensors (masters, fp32 parameters or ZeRO-1 pieces); its groups
            (defaults filled in) and state are carried over.
        make_optimizer: builds an optimizer of the same algorithm over exactly the groups given (once for the
            device part, once per host chunk).
        fraction: share of the elements stepped on the host.
        overlap_transfers: on CUDA, run the copies on side streams overlapping the device step.
        chunk_numel: elements per host chunk (a tensor is never split; a chunk closes once it reaches this).

    Raises:
        ValueError: a bad argument, or ``make_optimizer`` not building over exactly the groups given.
    """

    algorithm_name: str

    def __init__(self, inner: torch.optim.Optimizer, make_optimizer: MakeOptimizer, *, fraction: float,
                 overlap_transfers: bool = False, chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"HybridDeviceOptimizer: inner must be a torch.optim.Optimizer, got {inner!r:.80}")
        _check_fraction(fraction)
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"HybridDeviceOptimizer: chunk_numel must be an int >= 1, got {chunk_numel!r}")
        self.algorithm_name = algorithm_name(inner)
        super().__init__([dict(g) for g in inner.param_groups], dict(inner.defaults))
        params = [p for g in self.param_groups for p in g["params"]]
        count = plan_offload([p.numel() for p in params], fraction)
        device = next((p.device for p in params if p.device.type != "cpu"), torch.device("cpu"))
        self._owners: dict[int, _Owner] = {}  # by id(device tensor)
        self._device_optimizer = self._build(make_optimizer, params[count:], params[count:])
        pin = device.type == "cuda"  # pinned host memory: asynchronous copies
        self._chunks = []
        for on_device in (params[cut] for cut in _chunk_slices([p.numel() for p in params[:count]], chunk_numel)):
            # tensors already in host memory (off a device) are stepped in place; the others get copies
            adopted = [d.device.type == "cpu" and device.type != "cpu" for d in on_device]
            host, grads = _back_to_back(on_device, pin, adopted), _back_to_back(on_device, pin, adopted)
            self._chunks.append(_Chunk(self._build(make_optimizer, on_device, host), on_device, host, grads,
                                       [d._version for d in on_device]))
        self._copies = Transfers(device, overlap=overlap_transfers)
        self.state = _StateView(self._owners, params)  # type: ignore[assignment]
        self._fixed = True
        # Host copies are re-read on the first step and after a load: weights and masters are loaded around the
        # optimizer's load, possibly via aliases with their own version counters (DDP's fp32 params under ZeRO-1).
        self._reread = True
        if inner.state:
            self.load_state_dict(inner.state_dict())

    def _build(self, make_optimizer: MakeOptimizer, device: list[torch.Tensor], stepped: list[torch.Tensor]
               ) -> torch.optim.Optimizer:
        """An optimizer stepping ``stepped[i]`` in place of ``device[i]``, one group per outer group."""
        members = {id(d): s for d, s in zip(device, stepped, strict=True)}
        groups = []
        for group in self.param_groups:
            picked = [j for j, p in enumerate(group["params"]) if id(p) in members]
            groups.append(_subgroup(group, picked, [members[id(group["params"][j])] for j in picked],
                                    group.get("param_names")))
        given = [[id(p) for p in g["params"]] for g in groups]  # before make_optimizer may touch the groups
        optimizer = make_optimizer(groups)
        if not isinstance(optimizer, torch.optim.Optimizer) or given != [[id(p) for p in g["params"]]
                                                                         for g in optimizer.param_groups]:
            raise ValueError("HybridDeviceOptimizer: make_optimizer must return a torch.optim.Optimizer over "
                             f"exactly the groups given, in order; got {optimizer!r:.80}")
        self._owners.update({key: (optimizer, s) for key, s in members.items()})
        return optimizer

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the split between host and device is fixed then."""
        if getattr(self, "_fixed", False):
            raise ValueError("HybridDeviceOptimizer: param groups are fixed at construction; build a new "
                             "optimizer over all groups instead of adding one")
        super().add_param_group(param_group)

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The device optimizer, then one host optimizer per chunk."""
        return [self._device_optimizer] + [c.optimizer for c in self._chunks]

    def exported_state(self, tensor: torch.Tensor) -> dict[str, Any]:
        """The portable state of device tensor ``tensor`` from the sub-optimizer stepping it (see
        ``stage.state.exported_state``); empty when it has none."""
        if tensor not in self.state:
            return {}
        optimizer, stepped = self._owners[id(tensor)]
        export = getattr(optimizer, "exported_state", None)
        return export(stepped) if export is not None else optimizer.state[stepped]

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The sub-optimizers' reused buffers whose values do not outlive a step (``offload.states.scratch_of``)."""
        return [t for optimizer in self.sub_optimizers for t in scratch_of(optimizer)]

    @property
    def host_tensors(self) -> list[torch.Tensor]:
        """The host copies of the offloaded tensors, in group order (what the host optimizers step)."""
        return [t for c in self._chunks for t in c.host]

    @property
    def offloaded(self) -> list[torch.Tensor]:
        """The device tensors whose state and step live on the host, in group order."""
        return [t for c in self._chunks for t in c.device]

    def __repr__(self) -> str:
        total = sum(p.numel() for g in self.param_groups for p in g["params"])
        host = sum(t.numel() for t in self.host_tensors)
        return (f"HybridDeviceOptimizer({self.algorithm_name}, {host}/{total} elements on the host in "
                f"{len(self._chunks)} chunk(s), overlap_transfers={self._copies.overlap})")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of every tensor with a gradient; the outer groups' settings (schedulers write there) go to all."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            settings = {k: v for k, v in group.items() if k not in _OWN_KEYS}
            for optimizer in self.sub_optimizers:
                optimizer.param_groups[index].update(settings)
        copies = self._copies
        copies.start()
        with phase("offload_to_host"):
            done = [copies.to_host(self._to_host(chunk)) for chunk in self._chunks]
        with phase("device_step"):
            unhooked_step(self._device_optimizer)()
        for chunk, event in zip(self._chunks, done, strict=True):
            copies.wait(event)
            with phase("host_step"):
                unhooked_step(chunk.optimizer)()
            with phase("offload_to_device"):
                copies.to_device([(d, h) for d, h in zip(chunk.device, chunk.host, strict=True)
                                  if d.grad is not None and h is not d])
        copies.finish()
        for chunk in self._chunks:
            chunk.versions = [d._version for d in chunk.device]
        self._reread = False
        return loss

    def _to_host(self, chunk: _Chunk) -> Pairs:
        """A chunk's device -> host copies (gradients; values changed since our write or re-read); sets host grads."""
        pairs = []
        for device, host, grad, version in zip(chunk.device, chunk.host, chunk.grads, chunk.versions, strict=True):
            if host is device:  # stepped in place; the stage set its gradient
                continue
            if self._reread or device._version != version:
                pairs.append((host, device))
            host.grad = grad if device.grad is not None else None
            if device.grad is not None:
                pairs.append((grad, device.grad))
        return pairs

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of the plain inner optimizer (the same form): each tensor's
        state goes to the sub-optimizer stepping it (moved to its memory), the groups' settings to all.

        Raises:
            ValueError: a group's size differs (nothing is changed then).
        """
        sizes, ours = ([len(g["params"]) for g in gs] for gs in (state_dict["param_groups"], self.param_groups))
        if sizes != ours:
            raise ValueError(f"HybridDeviceOptimizer: the state dict's groups hold {sizes} parameters, this "
                             f"optimizer's {ours}")
        for optimizer, part in [(o, self._part(state_dict, o)) for o in self.sub_optimizers]:  # all, then load
            optimizer.load_state_dict(part)
        # what torch.optim makes of its groups on a load: copies of the saved ones, with our parameters
        loaded = []
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            loaded.append(copy.deepcopy({k: v for k, v in saved.items() if k != "params"}))
            loaded[-1]["params"] = group["params"]
            if "param_names" in group:
                loaded[-1].setdefault("param_names", group["param_names"])
        self.param_groups[:] = loaded
        self._reread = True

    def _part(self, state_dict: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The share of a plain state dict ``optimizer`` loads: every group's settings, its tensors and their state."""
        groups, state = [], {}
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            picked = [j for j, p in enumerate(group["params"]) if self._owners[id(p)][0] is optimizer]
            ids = [saved["params"][j] for j in picked]
            groups.append(_subgroup(saved, picked, ids, saved.get("param_names", group.get("param_names"))))
            state.update({i: state_dict["state"][i] for i in ids if i in state_dict["state"]})
        return {"state": state, "param_groups": groups}


class _StateView(Mapping[torch.Tensor, dict[str, Any]]):
    """Device tensor -> its live state in whichever sub-optimizer steps it; iterates in group order."""

    def __init__(self, owners: Mapping[int, _Owner], params: Sequence[torch.Tensor]) -> None:
        self._owners, self._params = owners, list(params)

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        if (owner := self._owners.get(id(param))) is None:
            raise KeyError(param)
        return owner[0].state[owner[1]]  # a defaultdict, as torch.optim's own ``state``

    def get(self, param: torch.Tensor, default: Any = None) -> Any:  # type: ignore[override]
        return self[param] if param in self else default  # never creates an entry (``self[...]`` would)

    def __contains__(self, param: object) -> bool:
        owner = self._owners.get(id(param))
        return owner is not None and owner[1] in owner[0].state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p in self._params if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def offloaded(make_optimizer: MakeOptimizer, *, fraction: float, overlap_transfers: bool = False,
              chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> MakeOptimizer:
    """``make_optimizer`` with CPU offload (``HybridDeviceOptimizer``'s arguments); a bad ``fraction`` fails now."""
    _check_fraction(fraction)

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return HybridDeviceOptimizer(make_optimizer(groups), make_optimizer, fraction=fraction,
                                     overlap_transfers=overlap_transfers, chunk_numel=chunk_numel)

    return make


def _subgroup(settings: Mapping[str, Any], picked: list[int], params: list[Any], names: list[str] | None
              ) -> dict[str, Any]:
    sub = {k: v for k, v in settings.items() if k not in _OWN_KEYS}
    sub["params"] = params
    if names is not None:
        sub["param_names"] = [names[j] for j in picked]
    return sub


def _chunk_slices(numels: Sequence[int], chunk_numel: int) -> list[slice]:
    """Consecutive slices of positions, each closed once it holds ``chunk_numel`` elements or more."""
    bounds, held = [0], 0
    for end, numel in enumerate(numels, 1):
        held += numel
        if held >= chunk_numel or end == len(numels):
            bounds.append(end)
            held = 0
    return [slice(a, b) for a, b in pairwise(bounds)]


def _back_to_back(like: Sequence[torch.Tensor], pin: bool, adopted: Sequence[bool]) -> list[torch.Tensor]:
    """Host tensors like ``like``, each dtype's back to back in one allocation (fused kernels step it flat);
    ``like[i]`` itself where ``adopted[i]``."""
    out: list[torch.Tensor] = [t if a else None for t, a in zip(like, adopted, strict=True)]  # type: ignore[misc]
    for dtype in dict.fromkeys(t.dtype for t, a in zip(like, adopted, strict=True) if not a):
        indices = [i for i, t in enumerate(like) if t.dtype == dtype and not adopted[i]]
        flat = torch.empty(sum(like[i].numel() for i in indices), dtype=dtype, device="cpu", pin_memory=pin)
        for i, part in zip(indices, flat.split([like[i].numel() for i in indices]), strict=True):
            out[i] = part.view(like[i].shape)
    return out
