"""A pytest plugin that lets Megatron-LM's distributed unit tests import ``optstack.megatron`` on CPU with gloo.

Loaded by ``run_distributed.py`` (``-p shim_distributed``) in each of the N processes it launches, torchrun-like
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment, a FileStore in ``MEGATRON_SHIM_STORE``). It puts
in ``sys.modules``, before the test files are imported:

- ``megatron.core.distributed`` (and ``.param_and_grad_buffer``): optstack's Megatron face
  (``DistributedDataParallel``, ``DistributedDataParallelConfig``, ``FullyShardedDataParallel``, ``BucketGroup``,
  ``partition_buckets``);
- ``megatron.core.optimizer`` / ``.distrib_optimizer``: ``optstack.megatron`` (``DistributedOptimizer``, ...);
- ``megatron.core.process_groups_config``: optstack's ``ProcessGroupCollection``;
- ``megatron.core.parallel_state``: the data-parallel part of Megatron's global groups over the gloo world
  (every rank data-parallel; ``num_distributed_optimizer_instances`` splits it into runs of consecutive ranks
  as Megatron does); a tensor-, pipeline- or context-parallel size > 1 skips the test (out of scope);
- ``megatron.core.transformer``: a ``TransformerConfig`` stand-in holding its keyword arguments (Megatron's
  model config; the DDP face reads only ``calculate_per_token_loss``);
- ``megatron.core.hyper_comm_grid``: a ``HyperCommGrid`` with Megatron's rank order (Megatron's own needs einops);
- ``tests.unit_tests.test_utilities``: ``Utils`` (gloo, FileStore) and Megatron's ``TestModel``.

The test files themselves are copied with only ``'cuda'`` -> ``'cpu'``, ``.cuda()`` -> ``.cpu()`` and
``'nccl'`` -> ``'gloo'`` changed (``run_distributed.py``); their assertions are Megatron's.
"""

from __future__ import annotations

import datetime
import os
import sys
import types
from typing import Any

import pytest
import shim
import torch
import torch.distributed as dist

_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("MEGATRON_SHIM_TIMEOUT", "30")))


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = getattr(mod, "__path__", [])  # a package, so its submodules import
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(_module(parent), leaf, mod)
    return mod


# ---------------------------------------------------------------- parallel_state (data parallel only)
class _State:
    initialized = False
    instances = 1
    intra: dist.ProcessGroup | None = None
    inter: dist.ProcessGroup | None = None


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None, *,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              num_distributed_optimizer_instances: int = 1, **unused: Any) -> None:
    rank, size = _world()
    for what, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
                        ("context_parallel_size", context_parallel_size)):
        if value != 1:
            pytest.skip(f"out of scope: {what}={value} > 1 (the shim's world is data-parallel only)")
    if size % num_distributed_optimizer_instances:
        pytest.skip(f"num_distributed_optimizer_instances={num_distributed_optimizer_instances} does not divide "
                    f"the world size {size}")
    _State.instances = num_distributed_optimizer_instances
    _State.intra = _State.inter = None
    if num_distributed_optimizer_instances > 1:  # Megatron's partial data-parallel groups: runs of ranks
        part = size // num_distributed_optimizer_instances
        for i in range(num_distributed_optimizer_instances):
            group = dist.new_group(list(range(i * part, (i + 1) * part)), timeout=_TIMEOUT)
            if i == rank // part:
                _State.intra = group
        for j in range(part):
            group = dist.new_group(list(range(j, size, part)), timeout=_TIMEOUT)
            if j == rank % part:
                _State.inter = group
    _State.initialized = True


def destroy_model_parallel() -> None:
    _State.initialized, _State.instances, _State.intra, _State.inter = False, 1, None, None


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    size = _world()[1]
    return size // _State.instances if partial_data_parallel else size


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    rank, size = _world()
    return rank % (size // _State.instances) if partial_data_parallel else rank


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> Any:
    if partial_data_parallel and _State.intra is not None:
        return _State.intra
    return dist.group.WORLD


def _one(*args: Any, **kwargs: Any) -> int:
    return 1


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


_PARALLEL_STATE = dict(
    initialize_model_parallel=initialize_model_parallel, destroy_model_parallel=destroy_model_parallel,
    model_parallel_is_initialized=lambda: _State.initialized,
    get_data_parallel_world_size=get_data_parallel_world_size, get_data_parallel_rank=get_data_parallel_rank,
    get_data_parallel_group=get_data_parallel_group,
    get_tensor_model_parallel_world_size=_one, get_tensor_model_parallel_rank=_zero,
    get_pipeline_model_parallel_world_size=_one, get_pipeline_model_parallel_rank=_zero,
    get_context_parallel_world_size=_one, get_context_parallel_rank=_zero,
    get_expert_model_parallel_world_size=_one, get_expert_model_parallel_rank=_zero,
    get_expert_data_parallel_world_size=lambda *a, **k: _world()[1],
    get_expert_data_parallel_rank=lambda *a, **k: _world()[0],
    get_intra_distributed_optimizer_instance_group=lambda *a, **k: _State.intra or dist.group.WORLD,
    get_inter_distributed_optimizer_instance_group=lambda *a, **k: _State.inter,
)


# ---------------------------------------------------------------- tests.unit_tests.test_utilities
class TestModel(torch.nn.Module):
    """Megatron's ``tests/unit_tests/test_utilities.TestModel``, as written there."""

    def __init__(self, input_dim: int, output_dim: int, num_layers: int, bias: bool,
                 shared_embedding: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(input_dim, output_dim, bias) for _ in range(num_layers)])
        if shared_embedding:
            self.layers[-1].weight.shared_embedding = True


class Utils:
    """Megatron's test ``Utils`` on gloo: the world comes from the environment the runner sets."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    inited = False

    @staticmethod
    def initialize_distributed() -> None:
        if not dist.is_initialized():
            store = dist.FileStore(os.environ["MEGATRON_SHIM_STORE"], Utils.world_size)
            dist.init_process_group("gloo", store=store, rank=Utils.rank, world_size=Utils.world_size,
                                    timeout=_TIMEOUT)
        Utils.inited = True

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                                  virtual_pipeline_model_parallel_size: int | None = None, **kwargs: Any) -> None:
        destroy_model_parallel()
        Utils.initialize_distributed()
        initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                  virtual_pipeline_model_parallel_size, **kwargs)
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel() -> None:
        destroy_model_parallel()
        if dist.is_initialized():
            dist.barrier()


def _internal_buffer(*args: Any, **kwargs: Any) -> Any:
    """Megatron's internal ``_ParamAndGradBuffer`` constructor (main's NVFP4 index-map tests build it with mocked
    module internals): not part of optstack's face; the name exists only so the test file imports."""
    raise NotImplementedError("out of scope: Megatron's internal _ParamAndGradBuffer constructor (optstack's face "
                              "offers the wrapper's buffers, model.buffers, not Megatron's buffer class)")


class TransformerConfig:
    """Stand-in for Megatron's ``TransformerConfig`` (a model class, out of scope): holds its keywords."""

    calculate_per_token_loss = False

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class HyperCommGrid:
    """Megatron's ``HyperCommGrid`` (process groups over a named n-d grid of ranks, the first dimension varying
    fastest), without its einops dependency: ``create_pg(dims)`` makes the groups of ranks that differ only in
    ``dims`` (every rank creates every group, in one order) and returns this rank's."""

    def __init__(self, shape: list[int], dim_names: list[str], rank_offset: int = 0, backend: str | None = None
                 ) -> None:
        self.shape, self.dim_names, self.rank_offset = list(shape), list(dim_names), rank_offset
        self.size = int(torch.tensor(self.shape).prod())
        self._pgs: dict[tuple[str, ...], Any] = {}

    def _coords(self, rank: int) -> list[int]:
        coords = []
        for extent in self.shape:
            coords.append(rank % extent)
            rank //= extent
        return coords

    def create_pg(self, dims: str | list[str], **unused: Any) -> Any:
        dims = [dims] if isinstance(dims, str) else list(dims)
        key = tuple(sorted(dims))
        if key in self._pgs:
            raise KeyError(f"process group for {dims} already created")
        axes = [self.dim_names.index(d) for d in dims]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self._coords(r)
            groups.setdefault(tuple(x for i, x in enumerate(c) if i not in axes), []).append(r + self.rank_offset)
        mine = None
        for ranks in groups.values():
            pg = dist.new_group(ranks, timeout=_TIMEOUT)
            if dist.get_rank() in ranks:
                mine = pg
        self._pgs[key] = mine
        return mine

    def get_pg(self, dims: str | list[str]) -> Any:
        return self._pgs[tuple(sorted([dims] if isinstance(dims, str) else dims))]


def install() -> None:
    import optstack.megatron as face
    from optstack.megatron import ddp as face_ddp

    _module("megatron")
    _module("megatron.core")
    _module("megatron.core.parallel_state", **_PARALLEL_STATE)
    _module("megatron.core.distributed", **{n: getattr(face_ddp, n) for n in face_ddp.__all__},
            FullyShardedDataParallel=face.FullyShardedDataParallel)
    _module("megatron.core.distributed.param_and_grad_buffer",
            **{n: getattr(face_ddp, n) for n in ("partition_buckets", "dist_reduce_scatter_func",
                                                 "dist_all_gather_func") if hasattr(face_ddp, n)},
            _ParamAndGradBuffer=_internal_buffer)
    _module("megatron.core.optimizer", **{n: getattr(face, n) for n in face.__all__})
    _module("megatron.core.optimizer.distrib_optimizer", DistributedOptimizer=face.DistributedOptimizer)
    _module("megatron.core.process_groups_config", ProcessGroupCollection=face.ProcessGroupCollection)
    _module("megatron.core.transformer", TransformerConfig=TransformerConfig)
    _module("megatron.core.hyper_comm_grid", HyperCommGrid=HyperCommGrid)
    _module("tests")
    _module("tests.unit_tests")
    _module("tests.unit_tests.test_utilities", Utils=Utils, TestModel=TestModel)
    torch.set_num_threads(1)


install()


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    # the groups a test makes end with it (see shim.destroy_groups): gloo threads stay bounded over a file
    before = shim.process_groups()
    yield
    shim.destroy_groups(keep=before)
