"""Megatron's ``megatron.training.training.wrap_model_chunks_with_ddp`` (Megatron's training module needs its
whole training stack to import; this is the one function of it that model wiring and tests call).

Layouts, for ``DistributedDataParallel`` only (``DP``), as Megatron's current main computes them:

- the layer-wise optimizer with its layout (``use_layer_wise_distributed_optimizer`` and
  ``use_layer_wise_param_layout``): the trainable parameters are tagged (``tag_params_for_buffer_routing``),
  ``ddp_config.use_distributed_optimizer`` is set True in place (Megatron mutates the caller's config, and callers
  read it back), and each chunk gets ``LayerWiseDistributedOptimizer.compute_full_param_layout``: Muon's matrices
  whole inside one rank's shard, the rest laid out for the distributed optimizer;
- the distributed optimizer alone: ``DistributedOptimizer.compute_full_param_layout``;
- otherwise none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from optstack.distributed.comm import Comm, is_initialized, world_size
from optstack.distributed.parallel import ParallelGroups
from optstack.megatron.ddp import DistributedDataParallel
from optstack.megatron.ddp_config import DistributedDataParallelConfig, compute_full_param_layout, megatron_bucket_size
from optstack.megatron.layer_wise import tag_params_for_buffer_routing
from optstack.megatron.param_and_grad_buffer import FullParamLayout
from optstack.megatron.process_groups import collection_group, megatron_mpu_collection, to_parallel_groups

__all__ = ["wrap_model_chunks_with_ddp"]


def _layout_sizes(pg_collection: Any, instances: int) -> tuple[int, int, int, int]:
    """(data-parallel size, ranks a dense bucket is split across, ranks an expert bucket is split across, pipeline
    rank) of the groups the wrappers will use: ``pg_collection``, else ``parallel_state``'s when Megatron
    initialised it, else torch.distributed's world (every rank data-parallel; one process without it). A dense
    bucket is split over the intra-instance group (``intra_dp_cp`` when set, else the data-parallel group's
    ``instances`` runs, as the wrapper builds them); an expert one over ``intra_expt_dp`` when set."""
    collection = pg_collection if pg_collection is not None else megatron_mpu_collection()
    if collection is None:
        size = world_size() if is_initialized() else 1
        return size, size // instances, size, 0
    groups = collection if isinstance(collection, ParallelGroups) else to_parallel_groups(collection)
    sizes = []
    for name, fallback in (("intra_dp_cp", groups.dp.size // instances), ("intra_expt_dp", groups.expert_dp.size)):
        group = collection_group(collection, name)
        sizes.append(fallback if group is None else Comm(group, name=name).size)
    return groups.dp.size, sizes[0], sizes[1], groups.pp.rank


def wrap_model_chunks_with_ddp(
    model_chunks: Sequence[nn.Module],
    config: Any,
    ddp_config: DistributedDataParallelConfig,
    *,
    use_layer_wise_distributed_optimizer: bool = False,
    use_layer_wise_param_layout: bool = True,
    DP: type = DistributedDataParallel,  # noqa: N803 (Megatron's argument name)
    pg_collection: Any = None,
    bucket_sizes: Sequence[int | None] | None = None,
    disable_bucketing_per_chunk: Sequence[bool] | None = None,
) -> list[nn.Module]:
    """Wrap each model chunk in ``DP``, with the layout its optimizer needs (module docstring).

    Args:
        model_chunks: the (unwrapped) model chunks.
        config: Megatron's ``TransformerConfig`` (or None), passed to each wrapper.
        ddp_config: the ``DistributedDataParallelConfig``; ``use_distributed_optimizer`` is set True in place for
            the layer-wise optimizer with its layout, as Megatron does.
        use_layer_wise_distributed_optimizer: the model will be stepped by ``LayerWiseDistributedOptimizer``.
        use_layer_wise_param_layout: with it, lay the buffers out for it (else the wrapper keeps plain buffers and
            the optimizer gathers parameters by itself).
        DP: the wrapper class (``DistributedDataParallel``, or ``FullyShardedDataParallel``: no layout).
        pg_collection: Megatron's ``ProcessGroupCollection`` for the wrappers (None: ``parallel_state``'s groups
            when initialised, else the world); its data-parallel sizes size the layouts.
        bucket_sizes: per chunk, the elements per bucket the layout is cut into; None: the bucket size each
            wrapper uses (``megatron_bucket_size``: what Megatron's training script resolves), so layout and
            wrapper agree.
        disable_bucketing_per_chunk: per chunk, one bucket per buffer (default: False for each).

    Returns:
        The wrapped chunks, in order.

    Raises:
        ValueError: ``bucket_sizes`` or ``disable_bucketing_per_chunk`` of another length than ``model_chunks``.
    """
    chunks = list(model_chunks)
    n = len(chunks)
    disable = list(disable_bucketing_per_chunk) if disable_bucketing_per_chunk is not None else [False] * n
    for name, values in (("bucket_sizes", bucket_sizes), ("disable_bucketing_per_chunk", disable)):
        if values is not None and len(values) != n:
            raise ValueError(f"wrap_model_chunks_with_ddp: {name} has {len(values)} entries for {n} model chunks; "
                             "give one per chunk or None")
    layer_wise = use_layer_wise_distributed_optimizer and use_layer_wise_param_layout
    layouts: list[FullParamLayout | None] = [None] * n
    if DP is DistributedDataParallel and (layer_wise or (
            not use_layer_wise_distributed_optimizer and ddp_config.use_distributed_optimizer)):
        if layer_wise:
            ddp_config.use_distributed_optimizer = True  # Megatron's: the layout needs the reduce-scatter
            tag_params_for_buffer_routing(chunks)
        dp_size, dense, expert, pp_rank = _layout_sizes(pg_collection, ddp_config.num_distributed_optimizer_instances)
        for i, chunk in enumerate(chunks):
            params = [p for p in chunk.parameters() if p.requires_grad]
            size = bucket_sizes[i] if bucket_sizes is not None else megatron_bucket_size(
                ddp_config, dp_size=dp_size, bucketing=not disable[i] and pp_rank == 0,
                num_parameters=sum(p.numel() for p in chunk.parameters()))
            layouts[i] = compute_full_param_layout(params, size, dense, ddp_config, expert)
    wrapped = []
    for chunk, layout, one_bucket in zip(chunks, layouts, disable, strict=True):
        kwargs: dict[str, Any] = {}
        if pg_collection is not None:
            kwargs["pg_collection"] = pg_collection
        if layout is not None:
            kwargs["full_param_layout"] = layout
        wrapped.append(DP(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=one_bucket, **kwargs))
    return wrapped
