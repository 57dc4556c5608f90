"""The algorithm registry: built-in names, plug-ins by import path, registration and error messages."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from optstack.algorithms import SGD, AdamW, Lion, algorithm_names, get_algorithm, register, registry


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made in a test do not leak into others."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.fixture
def builtins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry as optstack registers it, without what other code (the Megatron face's SOAP, plug-ins)
    registered in this process."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    registry._register_builtins()


@pytest.mark.usefixtures("builtins_only")
def test_builtin_names() -> None:
    assert algorithm_names() == ["adam", "adamuon", "adamw", "adaptive_muon", "lion", "muon", "normuon",
                                 "schedule_free_adamw", "schedule_free_sgd", "sgd", "soap"]


@pytest.mark.parametrize(
    ("name", "cls", "family", "defaults", "offloadable"),
    [
        ("adamw", AdamW, "adam", {"decoupled": True}, True),
        ("adam", AdamW, "adam", {"decoupled": False}, True),
        ("sgd", SGD, "sgd", {}, True),
        ("lion", Lion, "lion", {}, False),
    ],
)
def test_builtin_specs(name: str, cls: type, family: str, defaults: dict, offloadable: bool) -> None:
    spec = get_algorithm(name)
    assert (spec.name, spec.cls, spec.family, dict(spec.defaults), spec.offloadable) == (
        name, cls, family, defaults, offloadable,
    )


def test_adam_spec_builds_l2_adam() -> None:
    """The defaults fixed by the name are what make "adam" Adam and not AdamW."""
    p, q = torch.ones(3), torch.ones(3)
    p.grad, q.grad = torch.full((3,), 0.1), torch.full((3,), 0.1)
    spec = get_algorithm("adam")
    spec.cls([p], lr=0.1, weight_decay=0.5, **spec.defaults).step()
    torch.optim.Adam([q], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(p, q)


def test_muon_is_registered_lazily() -> None:
    spec = get_algorithm("muon")
    assert spec.cls.__name__ == "Muon" and spec.family == "muon" and not spec.offloadable
    assert issubclass(spec.cls, torch.optim.Optimizer)
    code = "import sys, optstack.algorithms; print('optstack.algorithms.muon' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_torch_optim_plugin() -> None:
    spec = get_algorithm("torch.optim.RMSprop")
    assert spec.cls is torch.optim.RMSprop and spec.family == "other" and not spec.offloadable
    assert dict(spec.defaults) == {}


def test_module_class_plugin() -> None:
    spec = get_algorithm("torch.optim.adagrad:Adagrad")
    assert spec.cls is torch.optim.Adagrad and spec.family == "other"
    assert get_algorithm("optstack.algorithms.lion:Lion").cls is Lion


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("torch.optim.Nope", "module 'torch.optim' has no attribute 'Nope'"),
        ("collections:OrderedDict", "is not a torch.optim.Optimizer subclass"),
        ("no_such_package.mod:Opt", "cannot import module 'no_such_package.mod'"),
    ],
)
def test_bad_plugins(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_algorithm(name)


@pytest.mark.usefixtures("builtins_only")
def test_unknown_name_lists_known_names_and_plugin_forms() -> None:
    with pytest.raises(ValueError) as info:
        get_algorithm("adamm")
    message = str(info.value)
    known = ("adam, adamuon, adamw, adaptive_muon, lion, muon, normuon, schedule_free_adamw, schedule_free_sgd, sgd, "
             "soap")
    assert "'adamm'" in message and known in message
    assert "'torch.optim.<Class>'" in message and "'package.module:Class'" in message


@pytest.mark.usefixtures("scratch_registry")
def test_register_a_class_and_a_lazy_path() -> None:
    register("rmsprop", torch.optim.RMSprop, family="other", defaults={"alpha": 0.9})
    register("lion_lazy", "optstack.algorithms.lion:Lion", family="lion", offloadable=True)
    assert "rmsprop" in algorithm_names() and "lion_lazy" in algorithm_names()
    assert dict(get_algorithm("rmsprop").defaults) == {"alpha": 0.9}
    lazy = get_algorithm("lion_lazy")
    assert lazy.cls is Lion and lazy.offloadable


@pytest.mark.usefixtures("scratch_registry")
@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("adamw", AdamW), {"family": "adam"}, "already registered"),
        (("mine", dict), {"family": "other"}, "not a torch.optim.Optimizer subclass"),
        (("mine", AdamW), {"family": "adamish"}, "family must be one of"),
        (("torch.optim.Mine", AdamW), {"family": "other"}, "name must be plain"),
        (("mine", "optstack.algorithms.AdamW"), {"family": "adam"}, "'package.module:Class'"),
    ],
)
def test_bad_registrations(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        register(*args, **kwargs)


def test_spec_is_frozen() -> None:
    spec = get_algorithm("sgd")
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.defaults["lr"] = 1.0  # type: ignore[index]


# -- constructor kwargs from the config ---------------------------------------------------------------
def test_builtin_kwargs_come_from_their_config_section() -> None:
    from optstack.config import AdamConfig, LionConfig, MuonConfig, OptimizerConfig, SGDConfig

    cfg = OptimizerConfig(
        lr=0.5, weight_decay=0.25, adam=AdamConfig(beta1=0.8, beta2=0.9, eps=1e-6, exp_avg_dtype="bf16"),
        sgd=SGDConfig(momentum=0.7, nesterov=True), lion=LionConfig(beta1=0.5, beta2=0.6),
        muon=MuonConfig(momentum=0.9, ns_steps=3, coefficients="simple", scale_mode="unit_rms_norm",
                        tp_mode="blockwise"),
    )
    base = {"lr": 0.5, "weight_decay": 0.25}
    adam = {"betas": (0.8, 0.9), "eps": 1e-6, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.float32}
    assert get_algorithm("adamw").kwargs(cfg) == base | adam | {"decoupled": True}
    assert get_algorithm("adam").kwargs(cfg) == base | adam | {"decoupled": False}
    assert get_algorithm("sgd").kwargs(cfg) == base | {"momentum": 0.7, "nesterov": True}
    assert get_algorithm("lion").kwargs(cfg) == base | {"betas": (0.5, 0.6)}
    assert get_algorithm("muon").kwargs(cfg) == base | {
        "momentum": 0.9, "nesterov": False, "ns_steps": 3, "ns_coefficients": "simple",
        "scale_mode": "unit_rms_norm", "extra_scale_factor": 1.0, "matmul_precision": "medium",
        "tp_mode": "blockwise"}
    assert get_algorithm("torch.optim.RMSprop").kwargs(cfg) == base  # a plug-in gets only lr / weight_decay
    for name in ("adamw", "sgd", "lion", "muon", "torch.optim.RMSprop"):  # every set builds its optimizer
        get_algorithm(name).cls([torch.zeros(2, 2, requires_grad=True)], **get_algorithm(name).kwargs(cfg))


def test_factory_algorithm_kwargs_delegates_to_the_spec() -> None:
    from optstack.config import OptimizerConfig
    from optstack.factory import algorithm_kwargs

    cfg = OptimizerConfig(lr=0.1)
    assert algorithm_kwargs("adam", cfg) == get_algorithm("adam").kwargs(cfg)


def test_muon_kwargs_are_resolved_lazily_with_its_class() -> None:
    from optstack.algorithms import muon

    assert get_algorithm("muon").kwargs_from_config is muon.kwargs_from_config
    assert isinstance(registry._REGISTRY["muon"].kwargs, str)


@pytest.mark.usefixtures("scratch_registry")
def test_register_with_kwargs_and_a_lazy_kwargs_path() -> None:
    from optstack.config import OptimizerConfig

    register("rmsprop", torch.optim.RMSprop, family="other", kwargs=lambda config: {"alpha": config.adam.beta2})
    register("lion_lazy", "optstack.algorithms.lion:Lion", family="lion",
             kwargs="optstack.algorithms.lion:kwargs_from_config")
    cfg = OptimizerConfig(lr=0.1, weight_decay=0.0)
    assert get_algorithm("rmsprop").kwargs(cfg) == {"lr": 0.1, "weight_decay": 0.0, "alpha": 0.999}
    assert get_algorithm("lion_lazy").kwargs(cfg) == get_algorithm("lion").kwargs(cfg)


@pytest.mark.usefixtures("scratch_registry")
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ("optstack.algorithms.lion.kwargs_from_config", "'package.module:function'"),
        ({"alpha": 0.9}, "kwargs must be a function of the config"),
    ],
)
def test_bad_kwargs_registrations(kwargs: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        register("mine", torch.optim.RMSprop, family="other", kwargs=kwargs)  # type: ignore[arg-type]


@pytest.mark.usefixtures("scratch_registry")
def test_a_lazy_kwargs_path_that_is_not_a_function_fails_on_lookup() -> None:
    register("mine", torch.optim.RMSprop, family="other", kwargs="optstack.algorithms.lion:__all__")
    with pytest.raises(ValueError, match="is not a function of the config"):
        get_algorithm("mine")


@pytest.mark.usefixtures("scratch_registry")
def test_a_registered_whole_matrix_algorithm_gets_layerwise_and_refuses_vectors_naming_the_fix() -> None:
    from optstack import OptimizerConfig, build_optimizer, wrap_data_parallel
    from optstack.config import DistributedConfig
    from optstack.rules import Name, Rule

    register("whole_sgd", torch.optim.SGD, family="other",
             capabilities=registry.Capabilities(elementwise=False, whole_matrices=True))
    config = OptimizerConfig(algorithm="whole_sgd", distributed=DistributedConfig(sharding="layerwise"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    built = build_optimizer(config, wrap_data_parallel(config, model))
    assert [type(s.optimizer).__name__ for s in built.optimizer.stages] == ["SGD", "AdamW"]  # vectors routed
    with pytest.raises(ValueError, match=r"algorithm 'whole_sgd' needs whole matrices of 2 or 3 dims.*parameter "
                                         r"'0.bias' has shape \(6,\).*Rule\(Ndim\(lt=2\), algorithm=\"adamw\"\)"):
        build_optimizer(OptimizerConfig(algorithm="whole_sgd"), torch.nn.Sequential(torch.nn.Linear(4, 6)),
                        rules=[Rule(Name("*"), algorithm="whole_sgd")])


def test_matrix_state_numel_counts_a_square_per_side_up_to_the_declared_limit() -> None:
    caps = get_algorithm("soap").capabilities  # GG_left, GG_right, Q_left, Q_right; limit max_precond_dim
    assert caps.matrix_state_numel((96, 64), {"max_precond_dim": 8192}) == 2 * 96**2 + 2 * 64**2
    assert caps.matrix_state_numel((96, 64), {"max_precond_dim": 64}) == 2 * 64**2  # rows above: not kept
    assert caps.matrix_state_numel((3, 8, 4), {"max_precond_dim": 8}) == 3 * (2 * 8**2 + 2 * 4**2)  # a stack
    assert get_algorithm("muon").capabilities.matrix_state_numel((96, 64), {}) == 0
    with pytest.raises(ValueError, match="matrix_state_max_side='max_precond_dim' needs matrix_state"):
        registry.Capabilities(elementwise=False, whole_matrices=True, matrix_state_max_side="max_precond_dim")
