"""Run Megatron-LM's own unit tests against ``optstack.megatron`` on CPU with gloo.

``install(megatron_src)`` prepares one Python process (call it before the test modules are imported, e.g.
from a ``conftest.py``):

- **the face instead of Megatron**: ``megatron.core.optimizer`` (and its submodules),
  ``megatron.core.optimizer_param_scheduler``, ``megatron.core.distributed``, ... resolve to namespaces built
  from ``optstack.megatron`` (``ALIASES``). A submodule the face does not offer is an ``ImportError``, never
  Megatron's own code. Every other ``megatron.*`` module (``parallel_state``, ``utils``, ``transformer``, ...)
  is Megatron's source from ``megatron_src`` (``megatron/core/__init__.py`` runs after the aliases exist, so
  its ``DistributedDataParallel`` is the face's);
- **CUDA -> CPU**: a torch function mode maps every device argument that names CUDA (``'cuda'``,
  ``'cuda:0'``, ``torch.device('cuda')``, an index) to the CPU, ``.cuda()`` and ``pin_memory()`` keep the
  tensor where it is, and ``torch.cuda``'s bookkeeping (``is_available``, ``device_count``, ``set_device``,
  ``synchronize``, ...) answers as one device per rank. Assertions on ``is_cuda`` still fail: they are out of
  scope, not hidden;
- **no Transformer Engine**: ``transformer_engine.pytorch.fp8.fp8_autocast`` exists (Megatron's test_optimizer.py
  imports it at the top) and raises ``ImportError`` when called; the tests that need TE fail with that reason;
- **NCCL -> gloo**: ``init_process_group`` / ``new_group`` get ``gloo`` where NCCL was asked for (NCCL
  options dropped), ``init_device_mesh('cuda', ...)`` builds a CPU mesh;
- **Megatron's test utilities**: ``tests.unit_tests.test_utilities.Utils`` / ``TestModel`` and
  ``tests.unit_tests.test_utils._init_distributed`` / ``_deinit_distributed`` (``TEST_UTILITIES``), on gloo
  with a file-store rendezvous from ``RANK`` / ``WORLD_SIZE`` (one process when unset).
  ``Utils.initialize_model_parallel`` skips a test whose parallel sizes do not divide the world size (a world
  this run cannot give) and notes a tensor-parallel size > 1 (``take_out_of_scope``: the face takes its
  data-parallel group from ``pg_collection`` or the world, not from ``parallel_state``);
- **process groups end with their creator**: ``destroy_groups`` (each gloo group holds threads until
  destroyed and unreferenced).

Nothing in the tests is edited: their assertions run as written.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import math
import os
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["ALIASES", "install", "alias", "Utils"]

#: The face's data-parallel wrapper, its config and its bucket groups (Megatron's distributed package).
_DDP = ("optstack.megatron.ddp", "optstack.megatron.ddp_config", "optstack.megatron.bucket_groups")

#: The face's optimizer classes (Megatron's optimizer modules), with the layer-wise parameter routing
#: (``is_managed_by_layer_wise_optimizer``, ``tag_params_for_buffer_routing``).
_OPTIMIZERS = ("optstack.megatron.optimizers", "optstack.megatron.grad_scaler", "optstack.megatron.chained",
               "optstack.megatron.layer_wise_optimizer", "optstack.megatron.layer_wise")

#: Megatron module -> the optstack modules whose public names it offers (``__all__``, else every name without
#: a leading underscore, plus the private names listed after a ``:``). Extend it for other test files.
ALIASES: dict[str, tuple[str, ...]] = {
    "megatron.core.optimizer": ("optstack.megatron",
                                "optstack.megatron.optimizer:_get_megatron_optimizer_based_on_param_groups"),
    "megatron.core.optimizer.optimizer": (*_OPTIMIZERS, "optstack.megatron.optimizers:_param_group_override_keys"),
    "megatron.core.optimizer.optimizer_config": ("optstack.megatron.config", "optstack.megatron.keys"),
    "megatron.core.optimizer.distrib_optimizer": _OPTIMIZERS,
    "megatron.core.optimizer.layer_wise_optimizer": _OPTIMIZERS,
    "megatron.core.optimizer.cpu_offloading": ("optstack.megatron.torch_optimizers",),
    "megatron.core.optimizer.muon": ("optstack.megatron.torch_optimizers", "optstack.megatron.optimizer"),
    "megatron.core.optimizer.grad_scaler": _OPTIMIZERS,
    "megatron.core.optimizer.clip_grads": _OPTIMIZERS,
    "megatron.core.optimizer_param_scheduler": ("optstack.megatron.scheduler", "optstack.megatron.keys"),
    "megatron.core.distributed": (*_DDP, "optstack.megatron.fsdp"),
    "megatron.core.distributed.param_and_grad_buffer": (
        *_DDP,
        "optstack.megatron.param_and_grad_buffer:_compute_default_per_buffer_param_layout,group_params_for_buffers"),
    "megatron.core.distributed.distributed_data_parallel": _DDP,
    "megatron.core.distributed.distributed_data_parallel_config": _DDP,
    "megatron.core.optimizer.param_layout": ("optstack.megatron.param_and_grad_buffer",),
    # Megatron's training module needs its whole training stack to import; the face offers the one function of
    # it that tests call (wrap_model_chunks_with_ddp)
    "megatron.training.training": ("optstack.megatron.training",),
}

#: Megatron module -> the optstack module registered as it (the same object, not a namespace copy): Megatron's
#: tests patch these modules' functions (``monkeypatch.setattr("megatron.core.optimizer.emerging_optimizers.
#: get_pg_size", ...)``) and expect the classes defined there to see the patch.
MODULES: dict[str, str] = {
    "megatron.core.optimizer.emerging_optimizers": "optstack.megatron.emerging_optimizers",
}

#: NVIDIA Emerging-Optimizers' modules the test files import when ``HAVE_EMERGING_OPTIMIZERS`` (the face's classes
#: with that package's signatures), registered only when the package is not installed.
EMERGING_PACKAGE: dict[str, dict[str, str]] = {
    "emerging_optimizers.soap": {"SOAP": "optstack.megatron.emerging_optimizers:SOAP"},
    "emerging_optimizers.scalar_optimizers": {"Lion": "optstack.megatron.torch_optimizers:Lion"},
}


def _internal_buffer(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("Megatron's internal _ParamAndGradBuffer constructor is not part of optstack's face "
                              "(DistributedDataParallel.buffers offers the wrapper's buffers)")


#: Names added to an alias: Megatron internals the test files import at the top (calling one raises).
ALIAS_EXTRAS: dict[str, dict[str, Any]] = {
    "megatron.core.distributed.param_and_grad_buffer": {"_ParamAndGradBuffer": _internal_buffer},
}

#: Megatron modules imported from its source before the Transformer Engine stub exists, so that their
#: ``HAVE_TE`` probes see no Transformer Engine (those a ref lacks are passed over).
PREIMPORT = ("megatron.core.parallel_state", "megatron.core.utils", "megatron.core.process_groups_config",
             "megatron.core.tensor_parallel", "megatron.core.transformer", "megatron.core.fp8_utils",
             "megatron.core.transformer.transformer_config", "megatron.core.transformer.module")

#: Megatron's model modules that the test files import at the top but that need CUDA-only libraries to import
#: (current main: triton). When Megatron's own import fails, a stand-in offers the names the tests import;
#: calling one raises ``ImportError`` (those tests need Megatron's model classes: out of scope).
#: Packages whose ``__init__`` needs CUDA-only libraries (current main's ``models.gpt`` imports triton) while
#: a light submodule is needed (``TransformerConfig.__post_init__`` imports one): when Megatron's import fails,
#: the package is registered without running its ``__init__``.
BARE_PACKAGES = ("megatron.core.models.gpt",)

STANDINS: dict[str, tuple[str, ...]] = {
    # a triton kernel module that main's TransformerConfig.__post_init__ reaches through models.backends
    "megatron.core.transformer.moe.ops.paged_stash": ("GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel",
                                                      "paged_stash_pop_kernel"),
    "megatron.core.models.gpt.gpt_layer_specs": ("get_gpt_layer_with_transformer_engine_submodules",
                                                 "get_gpt_layer_local_spec"),
    "megatron.core.transformer.multi_latent_attention": ("FusedMLASelfAttention", "MLASelfAttentionSubmodules"),
}


def _public(module: types.ModuleType) -> dict[str, Any]:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    return {n: getattr(module, n) for n in names if hasattr(module, n)}


def alias(name: str, sources: tuple[str, ...], extra: Mapping[str, Any] | None = None) -> types.ModuleType:
    """Register ``name`` in ``sys.modules`` as a namespace of the sources' public names (and ``extra``)."""
    module = types.ModuleType(name, f"{name} as offered by {', '.join(sources)} (optstack's Megatron face)")
    module.__path__ = []  # a package with no files: unoffered submodules fail to import
    for source in sources:
        path, _, private = source.partition(":")
        imported = importlib.import_module(path)
        vars(module).update(_public(imported))
        vars(module).update({n: getattr(imported, n) for n in filter(None, private.split(",")) if hasattr(imported, n)})
    vars(module).update(extra or {})
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


# ---------------------------------------------------------------------------------------------- CUDA -> CPU

_CPU = torch.device("cpu")


def _map_device(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    if isinstance(value, str) and value.split(":")[0] == "cuda":
        return _CPU
    return value


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


class CudaToCpu(TorchFunctionMode):
    """Maps device arguments naming CUDA to the CPU for every torch function and tensor method."""

    _SAME = {torch.Tensor.cuda: _keep, torch.Tensor.pin_memory: _keep}
    _TO = (torch.Tensor.to, torch.Tensor.new_empty)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._SAME:
            return self._SAME[func](*args, **kwargs)
        if "device" in kwargs:
            device = kwargs["device"]
            kwargs = {**kwargs, "device": _CPU if isinstance(device, int) else _map_device(device)}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1:  # .to(device[, dtype]) / .to(index)
            first = args[1]
            args = (args[0], _CPU if isinstance(first, int) and not isinstance(first, bool) else _map_device(first),
                    *args[2:])
        return func(*args, **kwargs)


def _patch_cuda(world_size: Callable[[], int]) -> None:
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = world_size
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.memory.empty_cache = lambda: None
    # "cuda" tensors are CPU tensors: their generator is the CPU's (torch.manual_seed calls these back)
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.is_bf16_supported = lambda *a, **k: True
    cuda.get_device_capability = lambda device=None: (9, 0)


# -------------------------------------------------------------------------------------------- NCCL -> gloo


def _gloo(backend: Any) -> Any:
    return "gloo" if backend is None or "nccl" in str(backend).lower() else backend


def _patch_distributed() -> None:
    init, new_group_inner, mesh = dist.init_process_group, dist.new_group, dist.device_mesh.init_device_mesh

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        kwargs.setdefault("timeout", timedelta(seconds=20))
        return init(_gloo(backend), *args, **kwargs)

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  **kwargs: Any) -> Any:
        return new_group_inner(ranks=ranks, timeout=timeout, backend=_gloo(backend), **kwargs)

    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    dist.init_process_group = dist.distributed_c10d.init_process_group = init_process_group
    dist.new_group = new_group
    dist.device_mesh.init_device_mesh = dist.init_device_mesh = init_device_mesh


# ---------------------------------------------------------------------------------- process-group teardown


def process_groups() -> set[dist.ProcessGroup]:
    """The process groups c10d holds now (the default one included)."""
    return set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()


def _holds(value: Any, groups: set[dist.ProcessGroup]) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds(v, groups) for v in value)
    return isinstance(value, dist.ProcessGroup) and value in groups


def destroy_groups(keep: set[dist.ProcessGroup]) -> None:
    """Destroy every process group not in ``keep`` but the default one.

    Megatron's ``destroy_model_parallel`` only forgets its groups: c10d keeps them, and each gloo group keeps
    its threads (about 3 per group; Megatron makes dozens per ``initialize_model_parallel``), so over a test
    file at 2 ranks a process grew to thousands of threads. A group's threads end once it is destroyed and
    unreferenced: ``parallel_state`` is reset when it holds one of them, then garbage is collected.
    """
    if not dist.is_initialized():
        return
    default = dist.distributed_c10d._get_default_group()
    stale = {pg for pg in process_groups() - keep if pg is not default}
    if not stale:
        return
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and any(_holds(v, stale) for v in vars(ps).values()):
        ps.destroy_model_parallel()
    for pg in stale & process_groups():  # resetting parallel_state may have destroyed some
        dist.destroy_process_group(pg)
    gc.collect()


# ------------------------------------------------------------------------------- Megatron's test utilities


def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_out_of_scope: list[str] = []  # why the running test is out of scope, if it is (Utils.initialize_model_parallel)


def take_out_of_scope() -> str | None:
    """Why the test just run is out of scope (a tensor-parallel size > 1), or None; clears
    the note for the next test."""
    note = "; ".join(dict.fromkeys(_out_of_scope)) or None
    _out_of_scope.clear()
    return note


class Utils:
    """Megatron's ``tests.unit_tests.test_utilities.Utils`` on gloo (the methods the tests call)."""

    rank, world_size = _world()
    local_rank = rank
    inited = False
    groups_before: set[dist.ProcessGroup] = set()  # c10d's groups before initialize_model_parallel

    @staticmethod
    def initialize_distributed() -> None:
        if not dist.is_initialized():
            store_path = os.environ.get("OPTSTACK_MEGATRON_STORE") or tempfile.mktemp(prefix="mlm-store-")
            store = dist.FileStore(store_path, Utils.world_size)
            dist.init_process_group("gloo", store=store, rank=Utils.rank, world_size=Utils.world_size,
                                    timeout=timedelta(seconds=20))
            dist.barrier()
        Utils.inited = True

    @staticmethod
    def set_world_size(world_size: int | None = None, rank: int | None = None) -> None:
        Utils.world_size = _world()[1] if world_size is None else world_size
        Utils.rank = _world()[0] if rank is None else rank

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                                  virtual_pipeline_model_parallel_size: int | None = None, **kwargs: Any) -> None:
        sizes = {"tensor_model_parallel_size": tensor_model_parallel_size,
                 "pipeline_model_parallel_size": pipeline_model_parallel_size,
                 "context_parallel_size": kwargs.get("context_parallel_size", 1)}
        instances = kwargs.get("num_distributed_optimizer_instances", 1)
        world, needed = _world()[1], math.prod(sizes.values()) * instances
        if world % needed:
            pytest.skip(f"needs a world size divisible by {needed} (tensor x pipeline x context parallel x "
                        f"num_distributed_optimizer_instances); this run has {world} processes")
        if tensor_model_parallel_size > 1:  # issue 14's acceptance: tensor parallelism only (CP / PP must pass)
            _out_of_scope.append(f"tensor_model_parallel_size={tensor_model_parallel_size} > 1")
        ps = importlib.import_module("megatron.core.parallel_state")
        if Utils.inited:  # Megatron forgets the previous groups here: end them
            destroy_groups(keep=Utils.groups_before)
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        Utils.groups_before = process_groups()
        ps.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size, **kwargs)
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel() -> None:
        if not Utils.inited:
            return
        dist.barrier()
        importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()
        destroy_groups(keep=Utils.groups_before)
        Utils.inited = False

    @staticmethod
    def fake_initialize_model_parallel(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("fake_initialize_model_parallel is not part of the shim")


class TestModel(torch.nn.Module):
    """Megatron's ``tests.unit_tests.test_utilities.TestModel``, as written there (its module imports Megatron's
    training package)."""

    __test__ = False  # not a test class

    def __init__(self, input_dim: int, output_dim: int, num_layers: int, bias: bool,
                 shared_embedding: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(input_dim, output_dim, bias) for _ in range(num_layers)])
        if shared_embedding:
            self.layers[-1].weight.shared_embedding = True


def _init_distributed(world: int, rank: int) -> None:
    Utils.initialize_distributed()
    assert dist.get_rank() == rank and torch.cuda.device_count() == world
    dist.barrier()


def _deinit_distributed() -> None:
    assert dist.is_initialized()
    dist.barrier()


#: Megatron's test-utility modules -> what the shim offers for them.
TEST_UTILITIES: dict[str, dict[str, Any]] = {
    "tests.unit_tests.test_utilities": {"Utils": Utils, "TestModel": TestModel},
    "tests.unit_tests.test_utils": {"_init_distributed": _init_distributed, "_deinit_distributed": _deinit_distributed},
}


def _rearrange(array: Any, pattern: str, **sizes: int) -> Any:
    """``einops.rearrange`` for the one pattern form Megatron's ``HyperCommGrid`` uses (core_v0.16.1):
    ``"(a b c) -> (c a) (b)"``, each name one axis of the given size (first name outermost)."""
    source, target = ([g.split() for g in side.replace("(", "").split(")") if g.strip()]
                      for side in pattern.split("->"))
    names = source[0]
    arranged = array.reshape([sizes[n] for n in names]).transpose([names.index(n) for g in target for n in g])
    return arranged.reshape([math.prod(sizes[n] for n in g) for g in target])


# ------------------------------------------------------------------------------------------------- install


def _no_te(*args: Any, **kwargs: Any) -> Any:
    raise ImportError("Transformer Engine is not installed (optstack's Megatron test shim): this test needs it")


def _standin(name: str, names: tuple[str, ...], why: BaseException) -> None:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{name} does not import without CUDA-only libraries ({why}); this test needs "
                          "Megatron's model classes")

    module = types.ModuleType(name, f"stand-in for {name} (optstack's Megatron test shim)")
    vars(module).update(dict.fromkeys(names, missing))
    sys.modules[name] = module


def _stub_transformer_engine() -> None:
    """``from transformer_engine.pytorch.fp8 import fp8_autocast`` at the top of Megatron's test_optimizer.py
    must import for its other tests to run; calling it (or importing anything else of TE) fails."""
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.fp8"):
        module = _package(name, None)
        module.__optstack_stub__ = True
    sys.modules["transformer_engine"].__version__ = "0.0.0"  # every is_te_min_version(...) probe: False
    sys.modules["transformer_engine.pytorch.fp8"].fp8_autocast = _no_te


def _package(name: str, path: Path | None) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__path__ = [str(path)] if path is not None else []
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:  # reachable by attribute too (monkeypatch.setattr("megatron.core.....", ...))
        setattr(sys.modules[parent], child, module)
    return module


def install(megatron_src: Path, aliases: Mapping[str, tuple[str, ...]] = ALIASES,
            extra: Mapping[str, Mapping[str, Any]] | None = None) -> CudaToCpu:
    """Set this process up for Megatron's tests; returns the (entered) CUDA -> CPU mode.

    Args:
        megatron_src: the folder holding Megatron's ``megatron/`` package.
        aliases: Megatron module -> optstack modules (``ALIASES``).
        extra: Megatron module -> more names to put in its alias (e.g. flags Megatron's ``__init__`` sets).
    """
    _patch_distributed()
    if importlib.util.find_spec("einops") is None:  # core_v0.16.1's HyperCommGrid needs it for one call
        _package("einops", None).rearrange = _rearrange
    _package("megatron", megatron_src / "megatron")
    _package("megatron.core", megatron_src / "megatron" / "core")
    for name in sorted(aliases):  # parents before children
        alias(name, aliases[name], {**ALIAS_EXTRAS.get(name, {}), **(extra or {}).get(name, {})})
    for name, source in MODULES.items():
        module = sys.modules[name] = importlib.import_module(source)
        setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], module)
    if importlib.util.find_spec("emerging_optimizers") is None:
        _package("emerging_optimizers", None)
        for name, names in EMERGING_PACKAGE.items():
            module = _package(name, None)
            for attr, target in names.items():
                path, _, cls = target.partition(":")
                setattr(module, attr, getattr(importlib.import_module(path), cls))
    core = sys.modules["megatron.core"]  # Megatron's __init__, now that the aliases answer its DDP import
    init = megatron_src / "megatron" / "core" / "__init__.py"
    spec = importlib.util.spec_from_file_location("megatron.core", init, submodule_search_locations=core.__path__)
    spec.loader.exec_module(core)
    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a module this ref does not have
            if not name.startswith(str(exc.name)):
                raise
    for name, names in STANDINS.items():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            _standin(name, names, exc)
    for name in BARE_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            _package(name, megatron_src.joinpath(*name.split(".")))
    _stub_transformer_engine()
    _patch_cuda(lambda: _world()[1])  # after the imports: their module-level CUDA probes see the real answer
    _package("tests", None)
    _package("tests.unit_tests", None)
    for name, names in TEST_UTILITIES.items():
        module = types.ModuleType(name)
        vars(module).update(names)
        sys.modules[name] = module
    mode = CudaToCpu()
    mode.__enter__()
    return mode
