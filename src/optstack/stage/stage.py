"""``Stage``: one inner algorithm over one placement and one precision; the step's phases happen here once
for every combination.

One step, as the optimizer sequences it over all its stages (one norm, one clip factor, one skip)::

    grad_stats   gradients made ready (a view, or an fp32 copy for a master), then ONE read pass: a norm per
                 tensor -> [sum |g|^p (max for inf), non-finite count], reduced over the placement's groups.
                 A non-finite norm is the finite check; the loss scale is divided out of the norm afterwards.
    step(f)      the inner algorithm with the gradients multiplied by f = clip factor / loss scale, folded
                 into the fused kernel where the algorithm takes a grad scale (one pass fewer), then the
                 masters rounded into the model and the placement's publish (gather / broadcast).

The inner algorithm only sees local tensors (whole parameters, masters, flat shard views); it never knows
which placement or precision it is stepped under. State is the one name-keyed format (``state.py``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from optstack.clip import norm_pows, zero_count
from optstack.offload.states import HostCopy, scratch_of
from optstack.protocol import MakeOptimizer, ParamShard, phase, unhooked_step
from optstack.stage.placement import Piece, Placement, Whole
from optstack.stage.precision import Masters, Precision
from optstack.stage.state import exported_state, from_plain, load_into, migrate, settings_of, shards_of, to_plain

__all__ = ["Stage"]


def _check_groups(param_groups: Any, owner: str) -> list[dict[str, Any]]:
    """Shallow copies of the caller's groups (torch.optim writes defaults into the dicts it is given),
    after checking every group has a list of distinct floating-point tensors."""
    if isinstance(param_groups, dict) or not isinstance(param_groups, Sequence):
        raise ValueError(f"{owner}: param_groups must be a list of group dicts, got {type(param_groups).__name__}")
    seen: set[int] = set()
    copies = []
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"{owner}: param group {index} must be a dict with a 'params' list, got {group!r:.80}")
        params = list(group["params"])
        names = group.get("param_names")
        if names is not None and len(names) != len(params):
            raise ValueError(f"{owner}: param group {index} has {len(params)} params but {len(names)} param_names")
        for position, param in enumerate(params):
            name = names[position] if names is not None else f"group {index} param {position}"
            if not isinstance(param, torch.Tensor) or not param.is_floating_point():
                raise ValueError(f"{owner}: parameters must be floating-point tensors; {name!r} is {param!r:.80}")
            if id(param) in seen:
                raise ValueError(f"{owner}: parameter {name!r} appears twice in param_groups; give each param once")
            seen.add(id(param))
        copies.append({**group, "params": params})
    return copies


class Stage:
    """An inner optimizer over this rank's pieces of ``param_groups``.

    Args:
        param_groups: group dicts over model parameters (``params``, ``param_names``, any settings); not
            modified. Every rank passes the same groups (a placement may leave some empty on a rank).
        make_optimizer: builds the inner optimizer over exactly the groups it is given (the same dicts with
            ``params`` = the tensors to step, ``param_names`` = their names).
        placement: which parts of which parameters this rank steps (default ``Whole()``).
        precision: what the algorithm steps for them (default ``Masters()``: fp32 masters for bf16/fp16).

    Raises:
        ValueError: malformed groups, a non-floating or repeated parameter, or an optimizer not built over
            the groups given.
    """

    def __init__(self, param_groups: Sequence[dict[str, Any]], make_optimizer: MakeOptimizer, *,
                 placement: Placement | None = None, precision: Precision | None = None) -> None:
        self.placement = placement if placement is not None else Whole()
        self.precision = precision if precision is not None else Masters()
        owner = self.name = f"{self.kind} stage"
        groups = _check_groups(param_groups, owner)
        names = [list(g.get("param_names") or [f"group {i} param {j}" for j in range(len(g["params"]))])
                 for i, g in enumerate(groups)]
        by_group = self.placement.pieces(names, [g["params"] for g in groups])
        self.pieces: list[Piece] = [p for group in by_group for p in group]
        first = self.pieces[0].value.device if self.pieces else None
        fallback = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
        self.device: torch.device = self.placement.device or first or fallback
        stepped = self.precision.inner(by_group, self.device)
        placed = [self.placement.group_settings(pg) for pg in by_group]  # the inner groups' only
        inner_groups = [{**g, **extra, "params": s, "param_names": [p.name for p in pg]}
                        for g, extra, s, pg in zip(groups, placed, stepped, by_group, strict=True)]
        optimizer = make_optimizer(inner_groups)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"{owner}: make_optimizer must return a torch.optim.Optimizer, got {optimizer!r:.80}")
        given = [[id(p) for p in g["params"]] for g in inner_groups]
        built = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
        if given != built:
            raise ValueError(f"{owner}: make_optimizer must build the optimizer over exactly the groups given, in "
                             f"order (given {len(given)} groups of sizes {[len(g) for g in given]}, built "
                             f"{len(built)} of sizes {[len(g) for g in built]})")
        self.optimizer = optimizer
        # The model-side groups, what users and schedulers see and write: every parameter of the group (on
        # every rank, whatever this rank steps) and the inner group's settings, copied in at each step.
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(g["params"]), **{k: v for k, v in settings_of(inner).items() if k not in extra},
             "param_names": n}
            for g, inner, n, extra in zip(groups, optimizer.param_groups, names, placed, strict=True)]
        self._stepped = [t for group in stepped for t in group]
        self._ready: list[torch.Tensor | None] = []
        self._counts = self.placement.norm_counts(self.placement.norm_params(self.pieces))
        self._slot_norm_terms()
        self._takes_grad_scale = bool(getattr(optimizer, "takes_grad_scale", False))
        self._host: HostCopy | None = None  # the state while offload_states() holds it on the host
        self._piece_of: dict[int, int] = {}  # id of a model parameter -> index of its piece (torch_entry)

    def __repr__(self) -> str:
        return f"Stage({type(self.optimizer).__name__}, {self.kind}, {len(self.pieces)} pieces)"

    @property
    def kind(self) -> str:
        """``placement+precision``, e.g. ``"zero1+masters"``."""
        return f"{self.placement.kind}+{self.precision.kind}"

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters, in group order."""
        self.reload_states()
        return self.precision.masters

    def add_param_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """Add a group of new parameters (torch's ``add_param_group``; the inner optimizer fills in its
        defaults) and return its model-side group dict.

        Raises:
            ValueError: the placement cannot take parameters after construction (sharded, layer-wise, or
                gradients from a data-parallel wrapper), a malformed group, or a parameter already here.
        """
        self.reload_states()
        if (why := self.placement.cannot_add()) is not None:
            raise ValueError(f"{self.name}: cannot add a param group: {why}. Build the optimizer over every "
                             "parameter instead (freeze some with requires_grad=False and build again to change it)")
        [group] = _check_groups([param_group], self.name)
        known = {id(p) for g in self.param_groups for p in g["params"]}
        index = len(self.param_groups)
        names = list(group.get("param_names") or [f"group {index} param {j}" for j in range(len(group["params"]))])
        for name, param in zip(names, group["params"], strict=True):
            if id(param) in known:
                raise ValueError(f"{self.name}: parameter {name!r} is already in a param group; give each param once")
        [pieces] = self.placement.pieces([names], [group["params"]])
        [stepped] = self.precision.inner([pieces], self.device)
        self.optimizer.add_param_group({**group, "params": stepped, "param_names": names})
        self.param_groups.append({"params": group["params"], **settings_of(self.optimizer.param_groups[-1]),
                                  "param_names": names})
        self.pieces += pieces
        self._stepped += stepped
        self._counts += self.placement.norm_counts(self.placement.norm_params(pieces))
        self._slot_norm_terms()
        return self.param_groups[-1]

    # -- the step ------------------------------------------------------------------------------------
    def norm_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients make this rank's norm terms, in ``grad_stats``' order (fixed)."""
        return self.placement.norm_params(self.pieces)

    def grad_stats(self, norm_type: float, groups: torch.Tensor | None = None, num_groups: int = 1
                   ) -> torch.Tensor:
        """Make the gradients ready and return ``[sum |g|^p (max |g| for inf), non-finite count]`` over
        this stage's gradients as they are (loss-scaled), reduced over the placement's groups: a
        2-element fp32 tensor, the same on every rank. Collective.

        With norm groups, ``groups`` gives each norm term (``norm_params`` order) its group index in
        ``[0, num_groups)`` (None: all in group 0) and the result is ``[one sum (max) per group..., non-finite
        count]`` (``num_groups + 1`` elements)."""
        self.reload_states()
        self.placement.finish()
        grads = self.placement.grads(self.pieces)
        for k, (piece, grad) in enumerate(zip(self.pieces, grads, strict=True)):
            if grad is None or grad.layout is torch.strided:
                continue
            if not getattr(self.optimizer, "accepts_sparse_grads", False):
                raise RuntimeError(
                    f"{self.name}: parameter {piece.name!r} has a {grad.layout} gradient, which "
                    f"{type(self.optimizer).__name__} cannot step (its state would treat the missing rows as "
                    "zero gradients). Use a dense gradient (e.g. nn.Embedding(..., sparse=False)), SGD "
                    "(algorithm='sgd' steps sparse gradients), or torch.optim.SparseAdam for that parameter")
            # an update linear in the gradient (SGD) is the same for a sparse gradient and its dense equal;
            # norms, clipping and masters then read it as any other
            grads[k] = grad.to_dense()
        self._ready = self.precision.ready(grads)
        pows = norm_pows(self.placement.norm_grads(self._ready), norm_type, self.device)
        inf = math.isinf(norm_type)
        # Each term goes to its parameter's slot (the stage's parameters in group order, the same on every rank)
        # and every rank sums the reduced slots in that order: where each parameter's term is computed on one
        # rank (owners, whole shards, replicated) the all-reduce only adds zeros, so the norm is bitwise the
        # same however the stage is placed; summing per rank first would make its last bit depend on the split.
        terms, slots, width = self._norm_terms
        rows = slots if groups is None else groups.to(terms.device)[terms] * width + slots
        table = pows.new_zeros(num_groups * width)
        table.scatter_reduce_(0, rows, pows[terms], reduce="amax" if inf else "sum")
        nonfinite = (~torch.isfinite(pows)).sum().to(torch.float32).reshape(1)
        reduced = self.placement.comm.all_reduce(torch.cat([table, nonfinite]), op="max" if inf else "sum")
        per_group = reduced[:-1].view(num_groups, width)
        sums = per_group.amax(1) if inf else per_group.sum(1)
        return torch.cat([sums, reduced[-1:]])

    def _slot_norm_terms(self) -> None:
        """The norm terms counted on this rank (indices into ``norm_params``), each one's slot (its parameter's
        index among the stage's parameters, in group order, the same on every rank; one slot past them for a
        term whose parameter is not one of them), and the number of slots. Fixed with the parameters."""
        index: dict[int, int] = {}
        for p in (p for g in self.param_groups for p in g["params"]):
            index.setdefault(id(p), len(index))
        params = self.placement.norm_params(self.pieces)
        terms = [i for i, counts in enumerate(self._counts) if counts]
        slots = [index.get(id(params[i]), len(index)) for i in terms]
        self._norm_terms = (torch.tensor(terms, dtype=torch.long, device=self.device),
                            torch.tensor(slots, dtype=torch.long, device=self.device), len(index) + 1)

    def count_zeros(self) -> torch.Tensor:
        """Zero elements of the counted ready gradients, summed over the placement's groups (0-d int64)."""
        grads = self.placement.norm_grads(self._ready)
        total = zero_count([g for g, c in zip(grads, self._counts, strict=True) if c and g is not None], self.device)
        return self.placement.comm.all_reduce(total, op="sum")[0]

    def sync_settings(self) -> None:
        """Copy the model-side groups' settings (``lr``, ``weight_decay``, ...) into the inner optimizer's."""
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update(settings_of(outer))

    def step(self, grad_scale: float = 1.0, piece_scales: Sequence[float] | None = None) -> None:
        """The inner step with the ready gradients multiplied by ``grad_scale`` (and each piece's by its
        ``piece_scales`` entry too, when given: one per piece), then publish."""
        self.sync_settings()
        if piece_scales is not None:
            by_factor: dict[float, list[torch.Tensor]] = {}
            for grad, factor in zip(self._ready, piece_scales, strict=True):
                if grad is not None and factor != 1.0:
                    by_factor.setdefault(factor, []).append(grad)
            for factor, grads in by_factor.items():
                torch._foreach_mul_(grads, factor)
        step = unhooked_step(self.optimizer)
        if self._takes_grad_scale:
            step(grad_scale=grad_scale)
        else:
            if grad_scale != 1.0:
                grads = [g for g in self._ready if g is not None]
                if grads:
                    torch._foreach_mul_(grads, grad_scale)
            step()
        self._publish()

    def _publish(self) -> None:
        with phase("publish_params"):
            self.precision.publish()
        self.placement.publish()

    def finish_param_sync(self) -> None:
        """Wait for parameter gathers still in flight (with overlap they run during the next forward)."""
        self.placement.finish()

    def swap_weights(self, mode: str) -> None:
        """``mode`` "train" or "eval": call the inner optimizer's ``train()`` / ``eval()`` where its algorithm
        swaps weights (Schedule-Free; a no-op otherwise), then publish the stepped values as a step does, so
        every rank's model holds them. Collective where publishing is."""
        swap = getattr(self.optimizer, mode, None)
        if not callable(swap):
            return
        self.reload_states()
        self.placement.finish()
        self.precision.materialize()  # a master held as a remainder is whole while the swap writes it
        swap()
        self._publish()
        self.placement.finish()

    def scale_rows(self, factors: Mapping[str, torch.Tensor]) -> None:
        """Multiply each row of the named 2-D parameters' stepped values (fp32 masters, or the parameters) by
        ``factors[name]`` (shape ``(rows,)``), on whatever part of the parameter this rank holds (a range, a
        DTensor's local shard or block, an owner's whole matrix: ``Placement.element_rows``), then publish as a
        step does. Collective where publishing is: every rank passes the same names (QK-clip, ``qk_clip.py``).
        Each element is scaled by its own row's factor, so no rank needs another's values: no gather."""
        mine = {n for g in self.param_groups for n in g["param_names"]} & set(factors)
        if not mine:
            return
        self.reload_states()
        self.placement.finish()
        self.precision.materialize()
        with torch.no_grad():
            for piece, stepped in zip(self.pieces, self._stepped, strict=True):
                factor = factors.get(piece.name)
                if factor is None or stepped.numel() == 0:
                    continue
                rows = self.placement.element_rows(piece)
                scale = factor.to(rows.device)[rows].to(device=stepped.device, dtype=stepped.dtype)
                stepped.mul_(scale.view(stepped.shape))
        self._publish()
        self.placement.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the stepped tensors' gradients and those of every model parameter of the groups."""
        self._ready = []  # else a gradient set to None would stay alive here until the next step
        self.precision.clear(set_to_none)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    if set_to_none:
                        param.grad = None
                    else:
                        param.grad.detach_().zero_()

    # -- moving the state off the device between steps --------------------------------------------------
    def offload_states(self) -> int:
        """Move every master, remainder and optimizer state tensor of this stage to host memory (pinned and
        asynchronous on CUDA) and free its device memory; the tensor objects stay. Scratch (fp32 gradient
        copies, the algorithm's staging buffers) is freed without a copy and regrown zeroed on reload, so
        the device keeps no storage of this stage. Anything that reads the state (a step, ``state_dict``, a
        load) first calls ``reload_states``. Returns the bytes moved."""
        if self._host is not None:
            return self._host.nbytes
        self.placement.finish()
        self.precision.release()  # after a skipped step; the parameters and remainders hold the masters
        self._ready = []  # the next step makes them ready again
        state = [v for t in self._stepped for v in (self.optimizer.state.get(t) or {}).values()
                 if isinstance(v, torch.Tensor)]
        self._host = HostCopy(self.precision.held() + state + list(self._norm_terms[:2]), self.device,
                              scratch=self.precision.scratch() + scratch_of(self.optimizer))
        return self._host.nbytes

    def reload_states(self) -> None:
        """Bring back what ``offload_states`` moved (bit for bit; nothing when nothing is offloaded)."""
        if self._host is not None:
            self._host.reload()
            self._host = None

    # -- state as torch.optim keeps it -----------------------------------------------------------------
    def torch_state(self) -> dict[int, dict[str, Any]]:
        """This rank's optimizer state by ``id`` of the model parameter, as ``torch.optim`` keeps it: the live
        state tensors, shaped as stepped (the parameter's shape when held whole, the flat range
        ``[start, end)`` otherwise; 8-bit moments as fresh fp32 copies), and for a parameter with an fp32
        master that master as ``"master"``.
        Only parameters this rank steps and that have state (after a first step, or a load)."""
        self.reload_states()
        self.placement.finish()
        masters = self.precision.master_ids()
        readable = self.precision.readable(self._stepped)
        out = {}
        for piece, inner, value in zip(self.pieces, self._stepped, readable, strict=True):
            entry = exported_state(self.optimizer, inner)  # 8-bit moments as fp32
            if entry:
                out[id(piece.param)] = {**entry, "master": value.detach()} if id(inner) in masters else entry
        return out

    def torch_entry(self, param: torch.Tensor) -> dict[str, Any]:
        """``torch_state()[id(param)]`` for one model parameter without building the others' entries: its live
        state on this rank (empty when this rank does not step it, or it has no state yet)."""
        if len(self._piece_of) != len(self.pieces):  # pieces only grow (add_param_group)
            self._piece_of = {id(p.param): i for i, p in enumerate(self.pieces)}
        index = self._piece_of.get(id(param))
        if index is None:
            return {}
        self.reload_states()
        self.placement.finish()
        inner = self._stepped[index]
        entry = exported_state(self.optimizer, inner)
        if entry and id(inner) in self.precision.master_ids():
            [value] = self.precision.readable([inner])
            return {**entry, "master": value.detach()}
        return entry

    def keeps_state(self) -> bool:
        """Whether a step makes optimizer state (False e.g. for SGD without momentum): the inner optimizer's
        ``keeps_state()`` where it says, else True. The same on every rank (it reads the groups' settings)."""
        says = getattr(self.optimizer, "keeps_state", None)
        return bool(says()) if callable(says) else True

    def sharded_torch_state(self) -> dict[int, dict[str, Any]]:
        """``torch_state``, for a placement that spreads parameters' state over ranks with element-wise
        tensors as ``ShardedTensor``s of the flattened parameter, for every parameter some rank holds
        (``stage/sharded.py``; what DCP needs to reshard). Collective over that group."""
        params = [p for g in self.param_groups for p in g["params"]]
        return self.placement.sharded_state(self.torch_state(), self.pieces, params)

    def shards_from_torch(self, entries: Mapping[int, Mapping[str, Any]]) -> dict[str, ParamShard]:
        """The ``ParamShard``s of this rank's pieces from ``torch_state``-like entries (keyed by ``id`` of the
        model parameter; tensors as stepped, or flat), checked to load (``ValueError`` naming the parameter);
        changes nothing. A piece without an entry gets no state (torch's rule); without a ``"master"`` its
        master is taken from the model's values."""
        self.placement.refresh()  # where the stepped values are copies of the model (DTensor owners)
        shards = {}
        for piece in self.pieces:
            entry = entries.get(id(piece.param), {})
            numel = piece.end - piece.start
            tensors: dict[str, torch.Tensor] = {"param": piece.value.detach().reshape(-1)}
            scalars: dict[str, Any] = {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and (value.dim() > 0 or key == "master"):
                    if value.numel() != numel:
                        raise ValueError(_misfit(key, piece.name, value.numel(), tuple(piece.param.shape),
                                                 piece.start, piece.end))
                    tensors["param" if key == "master" else key] = value.detach().reshape(-1)
                else:
                    scalars[key] = value
            shards[piece.name] = ParamShard(tuple(piece.param.shape), piece.start, piece.end, tensors, scalars)
        load_into(self.name, self.optimizer, self.pieces, shards, apply=False)
        return self.placement.flat_shards(shards)

    # -- state: the one name-keyed format ------------------------------------------------------------
    def param_shards(self) -> dict[str, ParamShard]:
        """What this rank holds of each parameter it steps, by name (flat views of the live tensors; a master
        held as a remainder is a fresh fp32 copy: checkpoints hold whole fp32 masters whatever the precision)."""
        self.reload_states()
        self.placement.finish()
        shards = shards_of(self.optimizer, self.pieces, self.param_groups)
        for piece, inner, value in zip(self.pieces, self._stepped, self.precision.readable(self._stepped),
                                       strict=True):
            if value is not inner:
                shards[piece.name].tensors["param"] = value.reshape(-1)
        return self.placement.flat_shards(shards)  # e.g. tensor-parallel blocks as flat ranges (collective)

    def load_param_shards(self, shards: Mapping[str, ParamShard]) -> None:
        """Load name-keyed state (each shard must cover this rank's range of its parameter; the range is cut
        out), then publish as a step does, so every rank's model holds the loaded values. Collective.

        Raises:
            ValueError: a parameter this rank steps is missing or does not fit; nothing changes then.
        """
        self.reload_states()
        self.placement.finish()
        shards = self.placement.local_shards(shards)  # e.g. flat ranges to tensor-parallel blocks (collective)
        self.precision.materialize()  # a remainder-held master is written whole, then split by the publish
        try:
            load_into(self.name, self.optimizer, self.pieces, shards)
        except ValueError:
            self.precision.release()  # nothing was loaded (load_into checks everything first)
            raise
        self._publish()
        self.placement.finish()

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, name-keyed: ``{"params": {name: {shape, start, end, tensors, scalars, group}},
        "groups": [each group's settings]}`` (references; ``torch.save`` or deep-copy to snapshot)."""
        return to_plain(self.param_shards(), self.param_groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (of any rank holding the same ranges; a 0.1 tagged one is migrated), all
        or nothing: on a mismatch a ``ValueError`` names it and nothing changes."""
        shards, settings = self.validate_state_dict(state_dict)
        self.load_param_shards(shards)
        for group, saved in zip(self.param_groups, settings, strict=True):
            group.update({k: copy.deepcopy(v) for k, v in settings_of(saved).items()})
        self.sync_settings()

    def validate_state_dict(self, state_dict: Any) -> tuple[dict[str, ParamShard], list[dict[str, Any]]]:
        """The shards and group settings of ``state_dict`` after checking they fit (``ValueError`` naming
        what differs); changes nothing."""
        if isinstance(state_dict, dict) and "kind" in state_dict:
            ids = self.precision.master_ids()
            masters = [id(t) in ids for t in self._stepped]
            state_dict = migrate(state_dict, self.pieces, self._stepped, masters)
        shards = from_plain(self.name, state_dict, self.param_groups)
        load_into(self.name, self.optimizer, self.pieces, self.placement.local_shards(shards), apply=False)
        settings = state_dict["groups"]
        if any(not isinstance(s, dict) for s in settings):
            raise ValueError(f"{self.name}: the state dict's 'groups' must be dicts of settings")
        names = [g["param_names"] for g in self.param_groups]
        for index, (saved, ours) in enumerate(zip(settings, names, strict=True)):
            if "param_names" in saved and ours is not None and list(saved["param_names"]) != list(ours):
                raise ValueError(f"{self.name}: param group {index} holds other parameters in the state dict")
        return shards, settings


def _misfit(key: str, name: str, got: int, shape: tuple[int, ...], start: int, end: int) -> str:
    """Why a state tensor of ``got`` elements does not fit the part ``[start, end)`` of parameter ``name``."""
    whole, here = math.prod(shape), end - start
    head = f"cannot load the optimizer state: its {key!r} of parameter {name!r} has {got} elements"
    other_model = ("Load the state dict saved with this model's optimizer; to start from another model's weights, "
                   "load those into the model (model.load_state_dict) and keep this fresh optimizer")
    resharded = ("optimizer.state_dict() holds one rank's part and loads into the same sharding and number of "
                 "ranks; to load at another, save and load with optstack.checkpoint (save_checkpoint / "
                 "load_checkpoint) or DCP (OptimizerState)")
    if got > whole:
        return (f"{head}, but {name!r} has {whole} (shape {shape}): the state dict was saved with another model, or "
                f"before this one changed. {other_model}")
    if here == whole:
        return (f"{head}, {name!r} has {whole} (shape {shape}): the state dict holds a part of it, saved by one rank "
                f"of a sharded optimizer (or with another model). {resharded}. {other_model}")
    return (f"{head}; this rank steps elements [{start}, {end}) of its {whole} (a sharded optimizer): the state dict "
            f"was saved with another sharding or number of ranks (or with another model). {resharded}")
