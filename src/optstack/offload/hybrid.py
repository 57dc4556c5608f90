"""CPU offload of optimizer state: a chosen fraction of the parameters stepped on the host, the rest on the device.

``HybridDeviceOptimizer`` stands where an inner ``torch.optim`` optimizer stands (a stage's ``make_optimizer``
builds it, see ``offloaded``), so the precision and ZeRO-1 stages know nothing of offload. This module takes
plain arguments; ``optstack.config.OffloadConfig.wrap`` reads a config and decides whether to offload. It takes over the
groups of the inner optimizer it wraps (the fp32 masters, fp32 parameters or ZeRO-1 pieces the stage steps:
the *device tensors*) and splits them, in one code path for every fraction from 0 to 1:

- the first device tensors in group order, up to ``fraction`` of the elements (``plan_offload``), get a host
  copy (pinned on CUDA) that is stepped in their place by the same algorithm's host kernel (torch's fused
  CPU AdamW / SGD): the fp32 values stepped and the optimizer state live in host memory. They are stepped in chunks,
  each chunk its own optimizer, so the copy back of one chunk overlaps the host step of the next;
- the rest are stepped on the device by an optimizer of the same kind, exactly as without offload.

One step::

    hyperparameters  the outer groups (where the scheduler writes lr / weight_decay) -> every sub-optimizer
    device -> host   gradients of the offloaded tensors into pinned buffers, one event per chunk; also their
                     values on the first step, after a load, and when something wrote a device tensor since
                     the last step (seen through its version counter): the device tensors are the truth
    device step      launched (asynchronous on CUDA), overlapping what follows
    per chunk        wait for its copies -> host step -> host -> device copy of the updated values
    finish           the current stream waits for the host -> device copies

``transfers.py`` issues and orders the copies (side streams with ``overlap_transfers``; synchronous
without CUDA, where the "device" is the CPU and the host copies are still separate tensors).

What the device keeps: the device tensors themselves (the stage publishes them to the model, and they are
the truth a load writes to) and their gradients; what offload takes off the device is the optimizer state (8
bytes per element for AdamW) and the update's work.

``state_dict`` / ``load_state_dict`` have exactly the form of the inner optimizer's (the same groups, the
same per-tensor state indexed in group order), and ``algorithm_name`` is the inner optimizer's (checkpoints
identify a group's algorithm by ``protocol.algorithm_name``), so a checkpoint saved offloaded loads into a
plain optimizer and back. ``state`` maps each device tensor to its state, wherever that lives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optstack.offload.state import NOT_SYNCED, Slot, StateView, loaded_groups, merge_state_dicts, split_state_dict
from optstack.offload.transfers import Transfers
from optstack.protocol import MakeOptimizer, algorithm_name, phase

__all__ = ["DEFAULT_CHUNK_NUMEL", "HybridDeviceOptimizer", "offloaded", "plan_offload"]

#: Elements per host chunk (64 MiB of fp32): large enough that per-chunk costs vanish, small enough that the
#: copy back of one chunk overlaps the host step of the next.
DEFAULT_CHUNK_NUMEL = 1 << 24


def _check_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload fraction must be a number in [0, 1], got {fraction!r}")


def plan_offload(numels: Sequence[int], fraction: float) -> int:
    """How many leading tensors go to the host: the longest prefix of ``numels`` (element counts in group
    order) holding at most ``fraction`` of all elements. 0 for ``fraction=0``, all for ``fraction=1``."""
    _check_fraction(fraction)
    if fraction == 0:
        return 0
    budget = fraction * sum(numels)
    count = taken = 0
    for numel in numels:
        if taken + numel > budget:
            break
        taken += numel
        count += 1
    return count


@dataclass(eq=False)
class _Chunk:
    """Offloaded tensors stepped by one host optimizer, moved together."""

    optimizer: torch.optim.Optimizer
    device: list[torch.Tensor]  # the device tensors, in group order
    host: list[torch.Tensor]  # their host copies (what the host optimizer steps), back to back
    grads: list[torch.Tensor]  # host gradient buffers, back to back
    versions: list[int]  # each device tensor's version counter after our last write


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Steps the first ``fraction`` of an inner optimizer's elements on the host, the rest on the device.

    Args:
        inner: the optimizer to offload part of, built over the device tensors (its groups, with the
            algorithm's defaults filled in, become this optimizer's groups). State it already holds is
            carried over.
        make_optimizer: builds an optimizer of the same algorithm over given groups: called once for the
            device part and once per host chunk (it must build over exactly the groups given).
        fraction: share of the elements, in [0, 1], stepped on the host (the leading tensors in group
            order, see ``plan_offload``).
        overlap_transfers: on CUDA, run the copies on side streams overlapping the device step.
        chunk_numel: elements per host chunk (a tensor is never split; a chunk closes once it reaches this).

    Raises:
        ValueError: a bad ``fraction`` or ``chunk_numel``; ``inner`` not an optimizer; ``make_optimizer``
            not building over the groups given.

    Groups are fixed at construction (``add_param_group`` afterwards raises). ``algorithm_name`` is the
    inner optimizer's (an offloaded ``AdamW`` is an ``AdamW`` to checkpoints).
    """

    algorithm_name: str

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        make_optimizer: MakeOptimizer,
        *,
        fraction: float,
        overlap_transfers: bool = False,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    ) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"HybridDeviceOptimizer: inner must be a torch.optim.Optimizer, got {inner!r:.80}")
        _check_fraction(fraction)
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"HybridDeviceOptimizer: chunk_numel must be an int >= 1, got {chunk_numel!r}")
        self.algorithm_name = algorithm_name(inner)
        super().__init__([dict(g) for g in inner.param_groups], dict(inner.defaults))
        params = [p for g in self.param_groups for p in g["params"]]
        count = plan_offload([p.numel() for p in params], fraction)
        device = params[0].device if params else torch.device("cpu")
        pin = device.type == "cuda"  # pinned host memory: asynchronous copies

        self._owners: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]] = {}
        self._device_optimizer = self._build(make_optimizer, {i: p for i, p in enumerate(params) if i >= count})
        self._chunks = [self._host_chunk(make_optimizer, positions, params, pin)
                        for positions in _chunk_positions([p.numel() for p in params[:count]], chunk_numel)]
        self._copies = Transfers(device, overlap=overlap_transfers)
        self.state = StateView(self._owners, params)  # type: ignore[assignment]
        self._fixed = True
        # The host copies are read afresh from the device tensors on the first step and on the first step
        # after a load (model weights and masters are typically loaded around the optimizer's load, possibly
        # through aliases with their own version counters: a DDP-held fp32 parameter under ZeRO-1).
        self._reread = True
        if inner.state:
            self.load_state_dict(inner.state_dict())

    # -- construction --------------------------------------------------------------------------------
    def _build(self, make_optimizer: MakeOptimizer, members: Mapping[int, torch.Tensor]) -> torch.optim.Optimizer:
        """An optimizer over ``members`` (outer position -> tensor it steps), one group per outer group."""
        groups, outer = [], []
        position = 0
        for group in self.param_groups:
            picked = [j for j in range(len(group["params"])) if position + j in members]
            sub = {k: v for k, v in group.items() if k not in NOT_SYNCED}
            sub["params"] = [members[position + j] for j in picked]
            if "param_names" in group:
                sub["param_names"] = [group["param_names"][j] for j in picked]
            outer += [group["params"][j] for j in picked]
            groups.append(sub)
            position += len(group["params"])
        given = [[id(p) for p in g["params"]] for g in groups]
        optimizer = make_optimizer(groups)
        if not isinstance(optimizer, torch.optim.Optimizer) or given != [
            [id(p) for p in g["params"]] for g in optimizer.param_groups
        ]:
            raise ValueError("HybridDeviceOptimizer: make_optimizer must return a torch.optim.Optimizer over "
                             f"exactly the groups given, in order; got {optimizer!r:.80}")
        inner = [p for g in optimizer.param_groups for p in g["params"]]
        for device_tensor, stepped in zip(outer, inner, strict=True):
            self._owners[id(device_tensor)] = (optimizer, stepped)
        return optimizer

    def _host_chunk(self, make_optimizer: MakeOptimizer, positions: range, params: list[torch.Tensor],
                    pin: bool) -> _Chunk:
        device = [params[i] for i in positions]
        host = _back_to_back(device, pin)  # filled from the device tensors on the first step
        grads = _back_to_back(device, pin)
        optimizer = self._build(make_optimizer, dict(zip(positions, host, strict=True)))
        return _Chunk(optimizer, device, host, grads, [d._version for d in device])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the split between host and device is fixed then."""
        if getattr(self, "_fixed", False):
            raise ValueError("HybridDeviceOptimizer: param groups are fixed at construction; build a new "
                             "optimizer over all groups instead of adding one")
        super().add_param_group(param_group)

    # -- views ---------------------------------------------------------------------------------------
    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The device optimizer, then one host optimizer per chunk."""
        return [self._device_optimizer] + [c.optimizer for c in self._chunks]

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

    # -- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of every tensor with a gradient (host and device parts); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        copies = self._copies
        copies.start()
        with phase("offload_to_host"):
            done = [self._send_to_host(chunk) for chunk in self._chunks]
        with phase("device_step"):
            self._device_optimizer.step()
        for chunk, event in zip(self._chunks, done, strict=True):
            copies.wait(event)
            with phase("host_step"):
                chunk.optimizer.step()
            with phase("offload_to_device"):
                stepped = [i for i, d in enumerate(chunk.device) if d.grad is not None]
                copies.to_device([(chunk.device[i], chunk.host[i]) for i in stepped])
        copies.finish()
        for chunk in self._chunks:
            chunk.versions = [d._version for d in chunk.device]
        self._reread = False
        return loss

    def _sync_hyperparameters(self) -> None:
        """Write every outer group's settings (the scheduler's lr / weight_decay among them) into the matching
        group of every sub-optimizer."""
        for index, group in enumerate(self.param_groups):
            settings = {k: v for k, v in group.items() if k not in NOT_SYNCED}
            for optimizer in self.sub_optimizers:
                optimizer.param_groups[index].update(settings)

    def _send_to_host(self, chunk: _Chunk) -> torch.cuda.Event | None:
        """Queue the device -> host copies of one chunk: the gradients, and the values of device tensors
        written since our last write (seen by their version counter) or, on the first step and after a
        load, all values; point the host copies' ``.grad`` at the buffers."""
        dst, src = [], []
        for i, device in enumerate(chunk.device):
            if self._reread or device._version != chunk.versions[i]:
                dst.append(chunk.host[i])
                src.append(device)
            grad = device.grad
            chunk.host[i].grad = chunk.grads[i] if grad is not None else None
            if grad is not None:
                dst.append(chunk.grads[i])
                src.append(grad)
        return self._copies.to_host(list(zip(dst, src, strict=True)))

    # -- state ---------------------------------------------------------------------------------------
    def _slots(self) -> list[Slot]:
        """Per device tensor in group order: (index into ``sub_optimizers``, its index in that optimizer's
        state dict)."""
        which = {id(o): k for k, o in enumerate(self.sub_optimizers)}
        counters = [0] * len(which)
        out = []
        for group in self.param_groups:
            for param in group["params"]:
                k = which[id(self._owners[id(param)][0])]
                out.append((k, counters[k]))
                counters[k] += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The state dict the inner optimizer would give: the groups' settings, and each tensor's state (in
        host memory where it lives there) indexed in group order. Tensors are references."""
        return merge_state_dicts(self.param_groups, self._slots(),
                                 [o.state_dict()["state"] for o in self.sub_optimizers])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of the plain inner optimizer (the same form): each tensor's
        state goes to the sub-optimizer stepping it (moved to its memory), the groups' settings to all.

        Raises:
            ValueError: a group's size differs (nothing is changed then).
        """
        subs = split_state_dict(state_dict, self.param_groups, self._slots(), len(self.sub_optimizers))
        for optimizer, sub_state in zip(self.sub_optimizers, subs, strict=True):
            optimizer.load_state_dict(sub_state)
        self.param_groups[:] = loaded_groups(self.param_groups, state_dict["param_groups"])
        self._reread = True


def offloaded(
    make_optimizer: MakeOptimizer,
    *,
    fraction: float,
    overlap_transfers: bool = False,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
) -> MakeOptimizer:
    """``make_optimizer`` with CPU offload: builds ``HybridDeviceOptimizer(make_optimizer(groups), ...)``.

    Plug the result in wherever a stage takes ``make_optimizer`` (``Stage`` and its builders in
    ``optstack.stage``); the arguments are ``HybridDeviceOptimizer``'s. Raises ``ValueError`` for a bad
    ``fraction`` at once.
    """
    _check_fraction(fraction)

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return HybridDeviceOptimizer(make_optimizer(groups), make_optimizer, fraction=fraction,
                                     overlap_transfers=overlap_transfers, chunk_numel=chunk_numel)

    return make


def _chunk_positions(numels: Sequence[int], chunk_numel: int) -> list[range]:
    """Consecutive ranges of positions, each closed once it holds ``chunk_numel`` elements or more."""
    out, start, held = [], 0, 0
    for position, numel in enumerate(numels):
        held += numel
        if held >= chunk_numel:
            out.append(range(start, position + 1))
            start, held = position + 1, 0
    if start < len(numels):
        out.append(range(start, len(numels)))
    return out


def _back_to_back(like: Sequence[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """Host tensors shaped and typed like ``like``, those of one dtype lying back to back in one allocation
    (the fused kernels then step a run as one flat tensor); pinned when ``pin`` (asynchronous copies)."""
    out: list[torch.Tensor | None] = [None] * len(like)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(like):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.empty(sum(like[i].numel() for i in indices), dtype=dtype, device="cpu", pin_memory=pin)
        for i, part in zip(indices, flat.split([like[i].numel() for i in indices]), strict=True):
            out[i] = part.view(like[i].shape)
    return out  # type: ignore[return-value]
