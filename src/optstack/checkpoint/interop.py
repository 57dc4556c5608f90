"""Plain ``torch.optim`` state dicts (export a checkpoint as one, import one) and the parameter -> group map.

The torch form, ``i`` counting parameters group by group as ``torch.optim.Optimizer.state_dict()`` does, without
parameter values (fp32 masters): ``{"state": {i: {"step": 0-d tensor, "exp_avg": tensor shaped like the
parameter, ...}}, "param_groups": [{settings..., "params": [i, ...], "param_names": [...]}]}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from optstack.checkpoint.format import decode_scalar, encode_scalar
from optstack.checkpoint.load import Saved, read_manifest, read_ranges, verify_files
from optstack.checkpoint.save import check_optimizer, local_state, together
from optstack.checkpoint.state import group_map, restore_group_settings
from optstack.distributed.comm import Comm, NullComm, world_comm
from optstack.optimizer import ChainedOptimizer
from optstack.protocol import ParamShard

__all__ = ["export_torch_state_dict", "import_torch_state_dict", "write_group_map"]


def export_torch_state_dict(path: str | os.PathLike[str], *, names: Sequence[str] | None = None,
                            key: bytes | str | None = None) -> dict[str, Any]:
    """A checkpoint's optimizer state as a ``torch.optim`` state dict over the whole model (one process).

    Args:
        path: a checkpoint directory, or a root with a ``latest`` pointer.
        names: the parameter order within each group (e.g. ``[n for n, _ in model.named_parameters()]``;
            default: the checkpoint's).
        key: the secret the checkpoint was saved with (``save_checkpoint(..., key=...)``): the manifest's
            HMAC-SHA256 and every file's SHA-256 are checked before anything is read; without it, unsigned and
            signed checkpoints alike are read after the CRC checks.

    Returns:
        A group per non-empty saved group (``betas`` a tuple); state shaped like the parameter, dtypes as saved.

    Raises:
        ValueError: a damaged checkpoint, (given ``key``) an unsigned one or one signed with another key, or
            ``names`` that are not exactly the checkpoint's parameters.
    """
    directory, manifest = read_manifest(path, key)
    verify_files(directory, manifest["files"], sha256=key is not None)
    params = manifest["params"]
    order = list(params) if names is None else list(names)
    if sorted(order) != sorted(params):
        raise ValueError(f"names must list exactly the checkpoint's {len(params)} parameters; these differ: "
                         f"{sorted(set(order) ^ set(params))[:8]}")
    order.sort(key=lambda n: params[n]["group"])  # group by group, each in the given order (a stable sort)
    saved = Saved(directory, manifest)
    whole = {n: (0, torch.Size(params[n]["shape"]).numel()) for n in order}
    state = {n: saved.state(n, *whole[n]) for n in order}
    data = read_ranges(directory, manifest, whole, keys={n: [k for k in state[n]["dtypes"] if k != "param"]
                                                         for n in order}, saved=saved)
    entries = [{k: v.view(params[n]["shape"]) for k, v in data[n].items()}
               | {k: decode_scalar(v) for k, v in state[n]["scalars"].items()} for n in order]
    groups: list[dict[str, Any]] = []
    for g, group in enumerate(manifest["groups"]):
        if ids := [i for i, n in enumerate(order) if params[n]["group"] == g]:
            settings = {k: tuple(v) if k == "betas" and isinstance(v, list) else v
                        for k, v in group["settings"].items()}
            groups.append({**settings, "params": ids, "param_names": [order[i] for i in ids]})
    return {"state": {i: entry for i, entry in enumerate(entries) if entry}, "param_groups": groups}


def import_torch_state_dict(state_dict: Mapping[str, Any], optimizer: ChainedOptimizer, *,
                            names: Sequence[str] | None = None, comm: Comm | NullComm | None = None) -> None:
    """Load a ``torch.optim`` state dict for the whole model into an optstack optimizer of any layout.

    Parameters are matched by name: the groups' ``param_names`` (torch >= 2.5), or ``names`` in parameter-id
    order. State and group ``lr`` / ``weight_decay`` are loaded, masters kept. Collective; all or nothing.

    Raises:
        ValueError: no names, parameters missing or extra, state of the wrong size, non-scalar state that
            is not element-wise; the optimizer is unchanged.
    """
    optimizer = check_optimizer(optimizer)
    comm = comm if comm is not None else world_comm("checkpoint")
    what = "cannot import the torch state dict"

    torch_state, torch_group = together(comm, what, lambda: _by_name(state_dict, names))
    shards = together(comm, what, lambda: local_state(optimizer, None))[0]
    everyone = {name for held in comm.all_gather_object(list(shards)) for name in held}

    def cut() -> dict[str, ParamShard]:
        extra, missing = sorted(set(torch_group) - everyone), sorted(everyone - set(torch_group))
        if extra or missing:
            raise ValueError(f"parameters only in the state dict: {extra[:8]}; only in the optimizer: {missing[:8]}")
        return {n: _cut(n, s, torch_state[n]) for n, s in shards.items()}

    loaded = together(comm, what, cut)
    for stage in optimizer.stages:  # each takes the parameters it steps
        stage.load_param_shards(loaded)
    restore_group_settings(shards, torch_group)


def _by_name(state_dict: Mapping[str, Any], names: Sequence[str] | None
             ) -> tuple[dict[str, dict[str, Any]], dict[str, Mapping[str, Any]]]:
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("a torch.optim state dict is a dict with 'state' and 'param_groups'")
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    if all("param_names" in g for g in state_dict["param_groups"]):
        found = [n for g in state_dict["param_groups"] for n in g["param_names"]]
    elif names is not None:
        found = list(names)
    else:
        raise ValueError("the state dict's groups have no 'param_names'; pass names=[...] in the order of its "
                         "parameter ids (e.g. [n for n, _ in model.named_parameters()])")
    if len(found) != len(ids) or len(set(found)) != len(found):
        raise ValueError(f"{len(found)} names (distinct: {len(set(found))}) for {len(ids)} parameters")
    groups = {i: g for g in state_dict["param_groups"] for i in g["params"]}
    return ({n: dict(state_dict["state"].get(i, {})) for n, i in zip(found, ids, strict=True)},
            {n: groups[i] for n, i in zip(found, ids, strict=True)})


def _cut(name: str, shard: ParamShard, entry: Mapping[str, Any]) -> ParamShard:
    """This rank's range of one parameter's torch state, with the current 'param' kept."""
    tensors = {"param": shard.tensors["param"].clone()}
    scalars = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.shape == torch.Size(shard.shape):
            tensors[key] = value.detach().reshape(-1)[shard.start : shard.end]
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise ValueError(f"state {key!r} of {name!r} has shape {tuple(value.shape)}; the parameter is "
                             f"{tuple(shard.shape)} ({torch.Size(shard.shape).numel()} elements)")
        else:
            encode_scalar(f"state {key!r} of {name!r}", value)  # raises for what a checkpoint cannot hold
            scalars[key] = value
    return replace(shard, tensors=tensors, scalars=scalars)


def write_group_map(path: str | os.PathLike[str], optimizer: ChainedOptimizer, *,
                    comm: Comm | NullComm | None = None) -> dict[str, Any]:
    """Write ``optimizer``'s parameter -> group map as JSON to ``path`` (rank 0; collective) and return it."""
    optimizer = check_optimizer(optimizer)
    comm = comm if comm is not None else world_comm("checkpoint")
    held = together(comm, "cannot write the group map", lambda: local_state(optimizer, None)[1])
    params: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index_of: dict[str, int] = {}
    for table in comm.all_gather_object(held):
        for name, h in table.items():
            key = json.dumps([h.identity, h.settings], sort_keys=True)
            if key not in index_of:
                index_of[key] = len(groups)
                groups.append({"identity": h.identity, "settings": h.settings})
            params.setdefault(name, {"group": index_of[key]})
    out = group_map(params, groups)
    if comm.rank == 0:
        Path(path).write_text(json.dumps(out, indent=1))
    comm.barrier()
    return out
