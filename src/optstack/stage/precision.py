"""Precisions: which tensors the inner algorithm steps for a placement's pieces, how their gradients get
ready, and how the stepped values reach the model.

- ``Direct``: the algorithm steps the pieces' model storage itself (the parameter, or its buffer view).
- ``Masters``: fp32 masters for bf16/fp16 pieces (one flat fp32 tensor per group, so the fused kernels step a
  group's masters as one run), rounded into the model storage after a step; fp32 pieces are stepped directly
  (Megatron's fp32-from-fp32 groups). With ``host_fraction`` (CPU offload, ``offload.hybrid.plan_offload``'s
  plan) the offloaded pieces' masters live in host memory (pinned on CUDA).
- ``Remainders``: bf16 pieces keep only the low 16 bits of their fp32 master (int16, 2 B/element); the
  masters are rebuilt for the step only.

A gradient becomes the stepped tensor's ``.grad`` as it is when its dtype is the stepped tensor's (no copy:
an fp32 gradient buffer under fp32 masters), or always with ``copy_grads=False`` (an algorithm that reads
low-precision gradients itself, e.g. AdamW), else it is copied into an fp32 buffer allocated once (laid out
back to back where the stepped tensors are).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from optstack.algorithms._common import coalesce
from optstack.stage.placement import Piece

__all__ = ["Direct", "Masters", "Precision", "Remainders", "join_remainder", "split_remainder"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_HOST = torch.device("cpu")


class Precision:
    """Direct: the pieces' model storage is what the algorithm steps (the base of ``Masters``)."""

    kind = "direct"

    def __init__(self, *, copy_grads: bool = True, host_fraction: float = 0.0) -> None:
        self.copy_grads = copy_grads
        self.host_fraction = host_fraction
        self._seen = 0  # stepped tensors so far (the offload plan counts them in group order)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model storage, its master)
        self._publish_plan: tuple[int, list, list, list] | None = None  # publish's grouping of _pairs, made once
        self._inner: list[torch.Tensor] = []
        self._copy_to: list[torch.Tensor] = []  # fp32 grads of the pieces whose grads are copied
        self._copied: list[int] = []
        self._dtypes: list[torch.dtype | None] | None = None  # the gradient dtypes the plan was made for

    def _wants_master(self, piece: Piece) -> bool:
        return False

    def inner(self, pieces: Sequence[Sequence[Piece]], device: torch.device) -> list[list[torch.Tensor]]:
        """Per group, the tensors the algorithm steps, one per piece (appended to those of earlier calls)."""
        out = []
        on_host = self._host_count(pieces)
        for group in pieces:
            low = [p for p in group if self._wants_master(p)]
            host = [p for p in low if id(p) in on_host]
            masters = {}
            for where, members in ((device, [p for p in low if id(p) not in on_host]), (_HOST, host)):
                if members or where == device:
                    pin = where is _HOST and device.type == "cuda"  # asynchronous copies to the device
                    flat = torch.empty(sum(p.end - p.start for p in members), dtype=torch.float32, device=where,
                                       pin_memory=pin)
                    masters.update(zip(map(id, members), flat.split([p.end - p.start for p in members]), strict=True))
            stepped = []
            with torch.no_grad():
                for p in group:
                    if self._wants_master(p):
                        master = masters[id(p)].view(p.value.shape)
                        master.copy_(p.value)
                        self._pairs.append((p.value, master))
                        stepped.append(master)
                    else:
                        stepped.append(p.value)
            out.append(stepped)
        self._inner += [t for group in out for t in group]
        self._dtypes = None  # plan the gradient copies again
        return out

    def _host_count(self, pieces: Sequence[Sequence[Piece]]) -> set[int]:
        """``id``s of the pieces whose masters go to host memory: those ``plan_offload`` offloads (the first
        stepped tensors in group order holding ``host_fraction`` of the elements), at construction only."""
        flat = [p for group in pieces for p in group]
        first, self._seen = self._seen, self._seen + len(flat)
        if not self.host_fraction or first:
            return set()
        from optstack.offload.hybrid import plan_offload  # offload builds on the stages, not the reverse

        count = plan_offload([p.end - p.start for p in flat], self.host_fraction)
        return {id(p) for p in flat[:count]}

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 masters, in group order."""
        return [m for _, m in self._pairs]

    def master_ids(self) -> set[int]:
        """``id``s of the stepped tensors that are fp32 masters (not the model's own storage)."""
        return {id(m) for _, m in self._pairs}

    def held(self) -> list[torch.Tensor]:
        """The state this precision allocates besides the model's (masters, remainders): what
        ``offload_states`` moves and memory accounting counts."""
        return [m for _, m in self._pairs]

    def scratch(self) -> list[torch.Tensor]:
        """The fp32 gradient copies: buffers this precision owns whose values ``ready`` rewrites before the
        step reads them (``offload_states`` frees them without a copy)."""
        return list(self._copy_to)

    def readable(self, stepped: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``stepped`` with their values readable between steps: each tensor itself, or (for a master held
        as a remainder) a fresh fp32 copy of the master it stands for."""
        return list(stepped)

    def materialize(self) -> None:
        """Make the stepped tensors hold their values (before a step or a load writes them)."""

    def release(self) -> None:
        """Drop what ``materialize`` made without writing it back (a skipped step changed nothing)."""

    def ready(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Make ``grads`` (the model gradients, one per piece) the stepped tensors' ``.grad``; returns them.
        Gradients are used as they are (loss scale and clip factor are applied in the step)."""
        inner = self._inner
        self.materialize()
        dtypes = [None if g is None else g.dtype for g in grads]
        if dtypes != self._dtypes:  # planned on the first step (and again if a gradient's dtype changes)
            self._dtypes = dtypes
            self._copied = [i for i, d in enumerate(dtypes)
                            if d is not None and d != inner[i].dtype and self.copy_grads]
            self._copy_to = _back_to_back([inner[i] for i in self._copied])
        ready: list[torch.Tensor | None] = list(grads)
        if self._copied:
            _copy_all(self._copy_to, [grads[i] for i in self._copied])  # type: ignore[misc]
            for k, i in enumerate(self._copied):
                ready[i] = self._copy_to[k]
        for tensor, grad in zip(inner, ready, strict=True):
            if tensor.grad is not grad:
                if grad is not None and grad.dtype != tensor.dtype and hasattr(tensor, "grad_dtype"):
                    tensor.grad_dtype = None  # copy_grads=False: the algorithm reads the gradient's dtype itself
                tensor.grad = grad
        return ready

    def publish(self) -> None:
        """Round the masters into the model storage (after a step or a load). bf16 values round exact ties
        half away from zero, as ``Remainders`` must (round-half-to-even does not fit 16 bits: 65,537 fp32
        values round to an even bf16), so an fp32-master run and a remainder run are bitwise the same."""
        if not self._pairs:
            return
        if self._publish_plan is None or self._publish_plan[0] != len(self._pairs):  # pairs only grow
            bf16 = [(v, m) for v, m in self._pairs if v.dtype == torch.bfloat16]
            other = [(v, m) for v, m in self._pairs if v.dtype != torch.bfloat16]
            # back-to-back pieces (a bucket's, a model's) as one run: a few passes, not a few per piece; the
            # views stay valid across offload (it resizes the same storages)
            runs = coalesce([[v for v, _ in bf16], [m for _, m in bf16]])[0] if bf16 else [[], []]
            self._publish_plan = (len(self._pairs), [v for v, _ in other], [m for _, m in other],
                                  list(zip(*runs, strict=True)))
        _, values, masters, bf16_runs = self._publish_plan
        with torch.no_grad():
            if values:
                _copy_all(values, masters)
            for value, master in bf16_runs:
                round_bf16_ties_away(master, value)

    def clear(self, set_to_none: bool) -> None:
        """Clear the stepped tensors' gradients (and the model's, for pieces that are whole parameters)."""
        for tensor in self._inner:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            elif tensor.grad.untyped_storage().nbytes() == 0:
                continue  # a gradient copy freed by offload_states: it comes back zero-filled
            elif tensor.grad.grad_fn is not None:
                tensor.grad.detach_().zero_()
            else:
                tensor.grad.requires_grad_(False).zero_()


class Direct(Precision):
    """The algorithm steps the model's own storage (bf16/fp16 parameters too, without masters)."""


class Masters(Precision):
    """fp32 masters for bf16/fp16 pieces; fp32 pieces are stepped directly."""

    kind = "masters"

    def _wants_master(self, piece: Piece) -> bool:
        return piece.value.dtype in _LOW_PRECISION


class Remainders(Precision):
    """bf16 pieces: the fp32 master is the bf16 parameter (high 16 bits) + an int16 remainder (low 16 bits);
    fp32 pieces are stepped directly. fp16 pieces cannot be split this way (a ``ValueError`` names them).

    Between steps only the remainders exist (2 B per element); ``ready`` rebuilds the fp32 masters into a
    workspace (one flat tensor per group, so fused kernels step it as one run) whose storage ``publish``
    frees after splitting the stepped masters back. The split is Megatron's / TransformerEngine's
    ``store_param_remainders``: the parameter is the master's high half rounded to nearest by the remainder's
    top bit (half away from zero, as ``Masters`` rounds bf16 too; ``master.to(bfloat16)`` differs on exact
    ties), and the remainder is the master's low 16 bits read as a signed int16, so ``master_bits =
    param_bits << 16 + remainder`` exactly.
    """

    kind = "remainders"

    def __init__(self, *, copy_grads: bool = True) -> None:
        super().__init__(copy_grads=copy_grads)
        self._remainders: list[torch.Tensor] = []  # one flat int16 tensor per group (views: in _splits)
        self._workspaces: list[torch.Tensor] = []  # one flat fp32 tensor per group, storage freed between steps
        self._splits: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (model value, master, remainder)
        self._live = False

    def _wants_master(self, piece: Piece) -> bool:
        if piece.value.dtype == torch.float16:
            raise ValueError(f"masters.store_remainders (Megatron: store_param_remainders): parameter "
                             f"{piece.name!r} is torch.float16; remainders split an fp32 master into a bf16 "
                             "parameter and its low 16 bits, so they need bf16 parameters. Make it bf16, or keep "
                             "whole fp32 masters (store_remainders=False)")
        return piece.value.dtype == torch.bfloat16

    def inner(self, pieces: Sequence[Sequence[Piece]], device: torch.device) -> list[list[torch.Tensor]]:
        self.materialize()  # earlier groups' workspaces: their values must survive the release below
        before = len(self._pairs)
        out = super().inner(pieces, device)
        new = self._pairs[before:]
        by_flat: dict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        for value, master in new:  # each group's masters are views of its one flat tensor
            by_flat.setdefault(id(master._base), (master._base, []))[1].append((value, master))
        for flat, members in by_flat.values():
            remainders = torch.zeros(flat.numel(), dtype=torch.int16, device=device)  # exact bf16: low bits 0
            self._workspaces.append(flat)
            self._remainders.append(remainders)
            for (value, master), rem in zip(members, remainders.split([m.numel() for _, m in members]), strict=True):
                self._splits.append((value, master, rem.view(master.shape)))
        self._live = True
        self.release()
        return out

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 masters, in group order: fresh copies rebuilt from parameter + remainder."""
        return [_join(v, r) for v, _, r in self._splits] if not self._live else super().masters

    def held(self) -> list[torch.Tensor]:
        return list(self._remainders) + (list(self._workspaces) if self._live else [])

    def readable(self, stepped: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._live:
            return list(stepped)
        rebuilt = {id(m): (v, r) for v, m, r in self._splits}
        return [_join(*rebuilt[id(t)]) if id(t) in rebuilt else t for t in stepped]

    def materialize(self) -> None:
        if self._live:
            return
        for flat in self._workspaces:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        with torch.no_grad():
            for value, master, rem in _runs(self._splits):
                join_remainder(value, rem, out=master)
        self._live = True

    def release(self) -> None:
        if not self._live:
            return
        for flat in self._workspaces:  # views keep their shapes; nothing reads them until materialize
            flat.untyped_storage().resize_(0)
        self._live = False

    def publish(self) -> None:
        """Split the stepped masters into parameter + remainder, then free the workspace."""
        if not self._live:
            return
        with torch.no_grad():
            for value, master, rem in _runs(self._splits):
                split_remainder(master, value, rem)
        self.release()

    def clear(self, set_to_none: bool) -> None:
        super().clear(set_to_none)
        self.release()  # after a skipped step: the parameters and remainders are still the masters


def join_remainder(param: torch.Tensor, remainder: torch.Tensor, *, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The fp32 master of a bf16 ``param`` and its int16 ``remainder`` (same shape): bits ``param << 16 +
    remainder`` (into ``out`` when given). In place, int32 throughout (three passes, no temporaries)."""
    if out is None:
        out = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    bits = out.view(torch.int32)
    bits.copy_(param.view(torch.int16))  # sign-extended
    bits.bitwise_left_shift_(16).add_(remainder)
    return out


_ROUND_CHUNK = 1 << 16  # elements per pass: the int32 scratch (256 KiB) stays in cache between its passes


def round_bf16_ties_away(master: torch.Tensor, out: torch.Tensor) -> None:
    """Write fp32 ``master`` into bf16 ``out`` rounded to nearest, ties half away from zero: the parameter
    ``split_remainder`` makes (bits ``(master + 0x8000) >> 16``). Differs from ``out.copy_(master)``
    (ties to even) only where the low 16 bits are exactly 0x8000."""
    bits = master.detach().reshape(-1).view(torch.int32)
    flat = out.view(-1) if out.is_contiguous() else None
    if flat is None:  # a strided view: round into a temporary, then one copy
        rounded = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
        round_bf16_ties_away(master, rounded)
        out.copy_(rounded)
        return
    halves = flat.view(torch.int16)
    chunk = _ROUND_CHUNK if bits.device.type == "cpu" else _ROUND_CHUNK << 8  # accelerators: few launches
    scratch = torch.empty(min(bits.numel(), chunk), dtype=torch.int32, device=bits.device)
    for start in range(0, bits.numel(), chunk):
        part = bits[start : start + chunk]
        tmp = torch.add(part, 0x8000, out=scratch[: part.numel()])
        halves[start : start + part.numel()].copy_(tmp.bitwise_right_shift_(16))


def split_remainder(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 ``master`` as bf16 ``param`` (high half, rounded by the low half's top bit) and int16
    ``remainder`` (low half, signed); ``join_remainder`` gives ``master`` back bit for bit. ``master`` is
    used as scratch (its bits end as the parameter's, shifted down)."""
    bits = master.view(torch.int32)
    remainder.copy_(bits)  # the low 16 bits (two's complement wrap)
    param.view(torch.int16).copy_(bits.sub_(remainder).bitwise_right_shift_(16))


def _runs(splits: Sequence[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """``splits`` with back-to-back entries (ZeRO-1's pieces of one bucket) merged into flat views: three
    int32 passes per run instead of per piece."""
    merged, _ = coalesce([[t[k] for t in splits] for k in range(3)])
    return list(zip(*merged, strict=True))


def _join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    return join_remainder(param.detach(), remainder)


def _back_to_back(like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zero fp32 tensors shaped like ``like``, back to back in one allocation per device: where the stepped
    tensors lie back to back their gradients do too, so the fused kernels step the run as one tensor."""
    out: list[torch.Tensor] = [None] * len(like)  # type: ignore[list-item]
    for where in dict.fromkeys(t.device for t in like):
        picked = [i for i, t in enumerate(like) if t.device == where]
        flat = torch.zeros(sum(like[i].numel() for i in picked), dtype=torch.float32, device=where)
        for i, part in zip(picked, flat.split([like[i].numel() for i in picked]), strict=True):
            out[i] = part.view(like[i].shape)
    return out


def _copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])``: one multi-tensor copy for the pairs on one device, single copies across."""
    same = [i for i, (d, s) in enumerate(zip(dst, src, strict=True)) if d.device == s.device]
    if same:
        torch._foreach_copy_([dst[i] for i in same], [src[i] for i in same])
    for i in sorted(set(range(len(dst))) - set(same)):
        dst[i].copy_(src[i])  # blocking: the host side is read or written by the host step next
