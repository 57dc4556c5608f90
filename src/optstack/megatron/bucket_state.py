"""Megatron's bucket-space view of a distributed optimizer: ``gbuf_ranges`` and the ``dp_reshardable`` state.

Megatron's ``DistributedOptimizer`` keeps, per grad buffer, ``{(param dtype, grad dtype): [per bucket
{"param_map": {model param: ranges}}]}`` (``gbuf_ranges``), which checkpoint converters and tests walk to read or
write each parameter's main param and optimizer state, or save bucket by bucket. optstack's ZeRO-1 stage holds the
same ranges as ``Piece``s over the wrapper's buffers; ``BucketRanges`` derives Megatron's names and shapes from the
stage and the wrapper (both fixed once built). Unlike optstack's name-keyed checkpoints, this format loads only
into the same layout, as in Megatron.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from optstack.distributed.ddp import DataParallel
from optstack.megatron.param_and_grad_buffer import BufferView, Range, build_model_gbuf_range

__all__ = ["BucketRanges"]

DTypes = tuple[torch.dtype, torch.dtype]
# the keys of a dp_reshardable entry that are not state (Megatron's)
_RANGE_KEYS = ("gbuf_local_start", "gbuf_local_end", "padding")


class BucketRanges:
    """Megatron's bucket-space attributes of a ZeRO-1 face optimizer (``DistributedOptimizer``), read from
    its stage (``self._stage``) and the ``DataParallel`` wrapper among its chain's gradient syncs."""

    _stage: Any
    _chain: Any

    # -- the layout ------------------------------------------------------------------------------------
    @functools.cached_property
    def _views(self) -> list[BufferView]:
        """The wrapper's buffers holding this optimizer's parameters, as Megatron's buffer views."""
        stage = self._stage
        mine = {id(p) for g in (stage.param_groups if stage is not None else []) for p in g["params"]}
        views: list[BufferView] = []
        for ddp in (s for s in self._chain.grad_syncs if isinstance(s, DataParallel)):
            for buffer in ddp.param_and_grad_buffers:
                if any(id(p) in mine for p in buffer.params):
                    view_of = getattr(ddp, "_view_of", None)
                    views.append(view_of(buffer) if view_of is not None else BufferView(buffer, ddp.shard_comm(buffer)))
        return views

    @property
    def buffers(self) -> list[BufferView]:
        """The grad buffers this optimizer shards (Megatron's ``DistributedOptimizer.buffers``)."""
        return list(self._views)

    @functools.cached_property
    def gbuf_ranges(self) -> list[dict[DTypes, list[dict[str, Any]]]]:
        """Per buffer, ``{(param dtype, grad dtype): [per bucket {"param_map": {param: ranges}}]}``: this rank's
        ranges of the parameters of each bucket it owns part of (``gbuf_world``, ``gbuf_world_in_bucket``,
        ``gbuf_local``, ``param``: Megatron's ``Range``s)."""
        stepped = set(self.model_param_group_index_map)
        out = []
        for view in self._views:
            buckets = []
            for index in range(len(view.buckets)):
                ranges = build_model_gbuf_range(view, index)
                ranges["param_map"] = {p: r for p, r in ranges["param_map"].items() if p in stepped}
                buckets.append(ranges)
            out.append({(view.param_dtype, view.grad_dtype): buckets})
        return out

    @property
    def model_param_gbuf_map(self) -> dict[torch.nn.Parameter, tuple[int, DTypes, int]]:
        """``{param: (buffer index, (param dtype, grad dtype), bucket index)}`` for the parameters in
        ``gbuf_ranges``."""
        return {param: (gbuf_index, dtypes, bucket_index)
                for gbuf_index, by_dtype in enumerate(self.gbuf_ranges)
                for dtypes, buckets in by_dtype.items()
                for bucket_index, ranges in enumerate(buckets)
                for param in ranges["param_map"]}

    @functools.cached_property
    def model_param_group_index_map(self) -> dict[torch.nn.Parameter, tuple[int, int]]:
        """``{param: (group index, position in the group)}``: where the tensor stepped for this rank's range of
        ``param`` sits in the torch optimizer's ``param_groups`` (parameters this rank owns part of)."""
        out: dict[torch.nn.Parameter, tuple[int, int]] = {}
        if self._stage is not None:
            pieces = iter(self._stage.pieces)
            for group_index, group in enumerate(self._stage.optimizer.param_groups):
                for order in range(len(group["params"])):
                    out[next(pieces).param] = (group_index, order)
        return out

    @property
    def per_bucket_numel(self) -> list[dict[DTypes, list[int]]]:
        """Per buffer, ``{(param dtype, grad dtype): [each bucket's numel, padding included]}``."""
        return [{(v.param_dtype, v.grad_dtype): [b.grad_data.numel() for b in v.buckets]} for v in self._views]

    @property
    def per_bucket_numel_unpadded(self) -> list[dict[DTypes, list[int]]]:
        """Per buffer, ``{(param dtype, grad dtype): [each bucket's numel without padding]}``."""
        return [{(v.param_dtype, v.grad_dtype): [b.numel_unpadded for b in v.buckets]} for v in self._views]

    def _get_model_param_range_map(self, param: torch.nn.Parameter) -> dict[str, Range]:
        """This rank's ranges of ``param`` (its entry in ``gbuf_ranges``)."""
        gbuf_index, dtypes, bucket_index = self.model_param_gbuf_map[param]
        return self.gbuf_ranges[gbuf_index][dtypes][bucket_index]["param_map"][param]

    # -- per-parameter state ---------------------------------------------------------------------------
    def _stepped(self, model_param: torch.nn.Parameter) -> torch.Tensor:
        if model_param not in self.model_param_group_index_map:
            raise KeyError("this rank steps no part of the given parameter (it is not in gbuf_ranges' param_map)")
        group_index, order = self.model_param_group_index_map[model_param]
        self._stage.reload_states()  # offload_states() may hold the state on the host
        return self._stage.optimizer.param_groups[group_index]["params"][order]

    def _get_main_param_and_optimizer_states(self, model_param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """``{"param": the fp32 main param of this rank's range, <state key>: tensor, ...}`` for ``model_param``
        (tensor state only, as Megatron: non-tensor entries such as ``found_inf`` are left out). Flat, live
        tensors (a master kept as a remainder comes back as a fresh fp32 copy)."""
        stepped = self._stepped(model_param)
        state = self._stage.optimizer.state.get(stepped, {})
        return {"param": self._stage.precision.readable([stepped])[0],
                **{k: v for k, v in state.items() if isinstance(v, torch.Tensor)}}

    def _set_main_param_and_optimizer_states(self, model_param: torch.nn.Parameter,
                                             tensors: dict[str, Any]) -> None:
        """Copy ``tensors`` (as ``_get_main_param_and_optimizer_states`` returns them) into the main param and
        the existing tensor state of ``model_param``; non-tensor values are skipped, as in Megatron.

        Raises:
            KeyError: a tensor key this optimizer holds is missing from ``tensors``.
        """
        stepped = self._stepped(model_param)
        self._stage.precision.materialize()  # a master kept as a remainder: its fp32 workspace
        state = self._stage.optimizer.state.get(stepped, {})
        targets = {"param": stepped, **{k: v for k, v in state.items() if isinstance(v, torch.Tensor)}}
        with torch.no_grad():
            for key, target in targets.items():
                if key not in tensors:
                    raise KeyError(f"the state to load has no {key!r} (it has {sorted(tensors)})")
                if isinstance(tensors[key], torch.Tensor):
                    target.copy_(tensors[key].reshape(target.shape))

    # -- bucket-space state ------------------------------------------------------------------------------
    def get_parameter_state_dp_reshardable(self) -> dict[Any, Any]:
        """Megatron's bucket-space state: ``{"per_bucket_numel", "per_bucket_numel_unpadded", buffer index:
        {(param dtype, grad dtype): [per bucket [per parameter {"param", <state>, "gbuf_local_start",
        "gbuf_local_end"}]]}}`` (live tensors, no copies); loads only into the same layout."""
        state: dict[Any, Any] = {"per_bucket_numel": self.per_bucket_numel,
                                 "per_bucket_numel_unpadded": self.per_bucket_numel_unpadded}
        for gbuf_index, by_dtype in enumerate(self.gbuf_ranges):
            state[gbuf_index] = {
                dtypes: [[{**self._get_main_param_and_optimizer_states(param),
                           "gbuf_local_start": ranges["gbuf_local"].start, "gbuf_local_end": ranges["gbuf_local"].end}
                          for param, ranges in bucket["param_map"].items()] for bucket in buckets]
                for dtypes, buckets in by_dtype.items()}
        return state

    def load_parameter_state_from_dp_reshardable(self, state_dict: dict[Any, Any]) -> None:
        """Load ``get_parameter_state_dp_reshardable``'s state (entries marked ``padding=True`` skipped).

        Raises:
            ValueError: the buckets' unpadded sizes or a bucket's parameter count differ from this layout's.
        """
        if "per_bucket_numel_unpadded" in state_dict and \
                state_dict["per_bucket_numel_unpadded"] != self.per_bucket_numel_unpadded:
            raise ValueError(
                f"load_parameter_state_from_dp_reshardable: the checkpoint's buckets hold "
                f"{state_dict['per_bucket_numel_unpadded']} elements (unpadded), this optimizer's "
                f"{self.per_bucket_numel_unpadded}; this format loads only into the same layout (use state_dict() "
                "or optstack.checkpoint, keyed by parameter name, to change it)")
        for gbuf_index, by_dtype in enumerate(self.gbuf_ranges):
            for dtypes, buckets in by_dtype.items():
                for bucket_index, bucket in enumerate(buckets):
                    saved = [e for e in state_dict[gbuf_index][dtypes][bucket_index] if not e.get("padding", False)]
                    if len(saved) != len(bucket["param_map"]):
                        raise ValueError(
                            f"load_parameter_state_from_dp_reshardable: buffer {gbuf_index} bucket {bucket_index} "
                            f"has {len(saved)} saved entries, this rank owns parts of {len(bucket['param_map'])} "
                            "parameters there; the layouts differ")
                    for entry, param in zip(saved, bucket["param_map"], strict=True):
                        self._set_main_param_and_optimizer_states(
                            param, {k: v for k, v in entry.items() if k not in _RANGE_KEYS})
        if self._stage is not None and self._stage.precision.kind == "remainders":
            self._stage._publish()  # the loaded masters back into parameter + remainder, on every rank
            self._stage.placement.finish()
