"""optstack.megatron against megatron-core itself, side by side: groups, config defaults, the scheduler.

Skipped unless ``megatron.core`` imports (it is not a dependency; CI skips this file). To run it, install
megatron-core into a separate environment with the CPU torch pinned (see shared/PEERS.md)::

    .venv-peers/bin/pip install -c constraints.txt megatron-core==0.16.1 pytest
    PYTHONPATH=src .venv-peers/bin/python -m pytest -q tests/parity/ -p no:cacheprovider

Megatron's ``_get_param_groups`` all-gathers its group keys, so a gloo world of one process is set up here.
Differences the face documents are asserted explicitly (``test_expected_difference_*``); everything else
must be equal.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    mco = pytest.importorskip("megatron.core.optimizer")
    mcs = pytest.importorskip("megatron.core.optimizer_param_scheduler")

import optstack.megatron as face  # noqa: E402
from optstack.demo.gpt import build_demo_model  # noqa: E402

# The two namespaces an override factory builds its keys from.
THEIRS = SimpleNamespace(
    ParamKey=mco.ParamKey, ParamPredicate=mco.ParamPredicate,
    ParamWithNamePredicate=mco.ParamWithNamePredicate, OptimizerConfig=mco.OptimizerConfig,
    get_standard_config_overrides=mco.get_standard_config_overrides,
    get_param_groups=mco._get_param_groups,
)
OURS = SimpleNamespace(
    ParamKey=face.ParamKey, ParamPredicate=face.ParamPredicate,
    ParamWithNamePredicate=face.ParamWithNamePredicate, OptimizerConfig=face.OptimizerConfig,
    get_standard_config_overrides=face.get_standard_config_overrides,
    get_param_groups=face.get_param_groups,
)


@pytest.fixture(scope="module", autouse=True)
def gloo_world(tmp_path_factory: pytest.TempPathFactory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# -- models ------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.q_layernorm = nn.LayerNorm(4)
        self.k_layernorm = nn.LayerNorm(4)


class Toy(nn.Module):
    """Biases, norms, q/k layer norms, flagged embedding/output, an expert layer seen before the dense ones,
    a length-1 parameter and a frozen layer (no parameters directly on the module: they would come first)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.expert_fc = nn.Linear(8, 8)
        self.attn = Attention()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.gate = nn.Linear(8, 1, bias=False)
        self.gate.scale = nn.Parameter(torch.ones(1))  # a length-1 parameter that is not a bias
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.output = nn.Linear(8, 16, bias=False)
        # Megatron's own conventions for these flags (set by its layers); test models only.
        for p in (self.embedding.weight, self.output.weight):
            p.is_embedding_or_output_parameter = True
        for p in self.expert_fc.parameters():
            p.allreduce = False


def gpt() -> list[nn.Module]:
    torch.manual_seed(0)
    return [build_demo_model(n_layer=2, d_model=32, n_head=2, qk_layernorm=True)]


def toy() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Toy()]


def two_chunks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Toy(), Toy()]  # the same names in both chunks, as virtual pipeline stages have


MODELS = {"gpt": gpt, "toy": toy, "two_chunks": two_chunks}


# -- overrides, built once per side from that side's classes ------------------------------------------------
Overrides = Callable[[SimpleNamespace, Any], dict | None]

OVERRIDES: dict[str, Overrides] = {
    "none": lambda ns, cfg: None,
    "empty": lambda ns, cfg: {},
    "standard": lambda ns, cfg: ns.get_standard_config_overrides(cfg),
    "name_glob": lambda ns, cfg: {
        ns.ParamKey(name=("*.fc.*", "fc.*", "head.weight")): {"max_lr": 2e-3, "min_lr": 2e-5},
    },
    "attr": lambda ns, cfg: {ns.ParamKey(attr="is_embedding_or_output_parameter"): {"wd_mult": 0.5}},
    "predicate": lambda ns, cfg: {
        ns.ParamKey(predicate=ns.ParamPredicate("big", lambda p: p.numel() > 100)): {"eps": 1e-6},
    },
    "name_predicate": lambda ns, cfg: {
        ns.ParamKey(with_name_predicate=ns.ParamWithNamePredicate("attn", lambda p, n: "attn." in n)):
            {"betas": (0.8, 0.9)},
    },
    "key_any_of": lambda ns, cfg: {
        ns.ParamKey(name="*.bias", attr="allreduce", predicate=ns.ParamPredicate("v", lambda p: p.ndim == 1)):
            {"start_wd": 0.0, "end_wd": 0.0},
    },
    "standard_plus_user": lambda ns, cfg: {
        **ns.get_standard_config_overrides(cfg),
        ns.ParamKey(name="*.weight"): {"start_wd": 0.05, "end_wd": 0.1},
        ns.ParamKey(name="*layernorm*"): {"max_lr": 5e-3, "eps": 1e-5},
        ns.ParamKey(name="*.bias"): {"optimizer": "adam"},  # may repeat the config's optimizer
    },
    # "lr" in a key (lr_mult, is_decoupled_lr is not) makes default_config False.
    "lr_mult": lambda ns, cfg: {
        ns.ParamKey(name="*.weight"): {"lr_mult": 0.5}, ns.ParamKey(name="*norm*"): {"is_decoupled_lr": True},
    },
}

CONFIGS = {
    "no_lr": dict(),
    "plain": dict(lr=1e-3),
    "min_lr": dict(lr=1e-3, min_lr=1e-5),
    "decoupled": dict(lr=1e-3, min_lr=1e-5, decoupled_lr=3e-3),
    "decoupled_min": dict(lr=1e-3, min_lr=1e-5, decoupled_lr=3e-3, decoupled_min_lr=1e-4),
    "qk_wd": dict(lr=1e-3, min_lr=1e-5, apply_wd_to_qk_layernorm=True),
    "qk_wd_decoupled": dict(lr=1e-3, decoupled_lr=3e-3, apply_wd_to_qk_layernorm=True),
}


def labels_of(chunks: list[nn.Module]) -> dict[int, str]:
    """Each tensor's name as ``chunk:name``, under its first chunk."""
    labels: dict[int, str] = {}
    for i, chunk in enumerate(chunks):
        for n, p in chunk.named_parameters():
            labels.setdefault(id(p), f"{i}:{n}")
    return labels


def describe(groups: list[dict[str, Any]], labels: dict[int, str]) -> list[tuple[dict[str, Any], list[str]]]:
    """Each group as (every field but params / param_names, its parameters' names)."""
    return [
        (
            {k: v for k, v in g.items() if k not in ("params", "param_names")},
            [labels[id(p)] for p in g["params"]],
        )
        for g in groups
    ]


def theirs_groups(chunks: list[nn.Module], overrides: dict | None, **config: Any) -> list[dict[str, Any]]:
    return mco._get_param_groups(chunks, mco.OptimizerConfig(**{"lr": 1e-3, **config}), overrides)


def ours_groups(chunks: list[nn.Module], overrides: dict | None, **config: Any) -> list[dict[str, Any]]:
    return face.get_param_groups(chunks, face.OptimizerConfig(**{"lr": 1e-3, **config}), overrides)


def both_groups(model: str, config: str, overrides: str) -> tuple[list, list, list[nn.Module]]:
    chunks = MODELS[model]()
    results = []
    for ns in (THEIRS, OURS):
        cfg = ns.OptimizerConfig(**CONFIGS[config])
        results.append(ns.get_param_groups(chunks, cfg, OVERRIDES[overrides](ns, cfg)))
    return results[0], results[1], chunks


def dense_before_expert(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Megatron's order with the face's documented tie-break: at an equal override, dense before expert.

    Megatron sorts by override only and its sort is stable, so a dense and an expert group with the same
    override are adjacent, in the order first seen; such a pair (every field equal but params and
    is_expert_parallel) is put dense first.
    """
    def same_override(a: dict[str, Any], b: dict[str, Any]) -> bool:
        drop = ("params", "is_expert_parallel")
        return {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}

    out = list(groups)
    for i in range(len(out) - 1):
        a, b = out[i], out[i + 1]
        if a["is_expert_parallel"] and not b["is_expert_parallel"] and same_override(a, b):
            out[i], out[i + 1] = b, a
    return out


# -- groups --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", sorted(set(OVERRIDES) - {"empty"}))
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_param_groups_match_megatron(model: str, config: str, overrides: str) -> None:
    theirs, ours, chunks = both_groups(model, config, overrides)
    labels = labels_of(chunks)
    # Every field but param_names, its value, the groups' order and membership.
    assert describe(ours, labels) == describe(dense_before_expert(theirs), labels)
    for g in ours:  # the one key the face adds
        assert len(g["param_names"]) == len(g["params"])
    if len(chunks) == 1:
        assert [n for g in ours for n in g["param_names"]] == [
            labels[id(p)][2:] for g in ours for p in g["params"]
        ]


def test_override_helpers_agree() -> None:
    overrides = [{"wd_mult": 0.0}, None, {"max_lr": 1.0, "wd_mult": 0.0}]
    assert face.combine_param_group_overrides(overrides) == mcs.combine_param_group_overrides(overrides)
    for fn in (face.combine_param_group_overrides, mcs.combine_param_group_overrides):
        with pytest.raises(ValueError, match="wd_mult"):
            fn([{"wd_mult": 0.0}, {"wd_mult": 1.0}])
    for override in (None, {}, {"min_lr": 0.1, "eps": 1e-6, "max_lr": 1.0}):
        assert face.param_group_override_to_tuple(override) == mcs.param_group_override_to_tuple(override)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_standard_overrides_select_what_megatrons_select(config: str) -> None:
    chunks = toy() + gpt()
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    got = {}
    for ns in (THEIRS, OURS):
        overrides = ns.get_standard_config_overrides(ns.OptimizerConfig(**CONFIGS[config]))
        got[ns is OURS] = [
            (dataclasses.astuple(k)[:2], dict(v), [n for n, p in named if k.matches(p, n)])
            for k, v in overrides.items()
        ]
    assert got[True] == got[False]


def test_expected_difference_dense_before_expert_at_equal_override() -> None:
    # Toy's expert layer comes before its dense layers: Megatron keeps first-seen order among groups with
    # the same override (expert first here), the face orders dense first (documented in get_param_groups).
    theirs, ours, chunks = both_groups("toy", "plain", "none")
    labels = labels_of(chunks)
    flags = lambda groups: [(g["wd_mult"], g["is_expert_parallel"]) for g in groups]  # noqa: E731
    assert flags(theirs) == [(1.0, False), (1.0, True), (0.0, True), (0.0, False)]
    assert flags(ours) == [(1.0, False), (1.0, True), (0.0, False), (0.0, True)]
    assert describe(ours, labels) == describe(dense_before_expert(theirs), labels)


def test_expected_difference_empty_override_makes_no_group() -> None:
    # Megatron: parameters matched only by an override that sets nothing form a group of their own (key
    # ()), which has the default fields; the face puts them in the group without overrides.
    chunks = toy()
    labels = labels_of(chunks)
    got = {}
    for ns in (THEIRS, OURS):
        cfg = ns.OptimizerConfig(lr=1e-3)
        got[ns is OURS] = describe(ns.get_param_groups(chunks, cfg, {ns.ParamKey(name="fc.*"): {}}), labels)
    theirs, ours = got[False], got[True]
    assert len(theirs) == len(ours) + 1
    fields, names = theirs[2]  # () sorts after None, before any real override
    assert names == ["0:fc.weight", "0:fc.bias"] and fields == theirs[0][0]
    merged = sorted(theirs[0][1] + names)
    assert ours[0][0] == theirs[0][0] and sorted(ours[0][1]) == merged
    assert ours[1:] == theirs[1:2]


def test_expected_difference_shared_tensor_is_grouped_once() -> None:
    # Megatron walks each chunk's named_parameters, so a tensor in two chunks is listed twice (torch.optim
    # then refuses the groups); the face groups it once, under its first chunk (documented in groups.py).
    first, second = toy()[0], nn.Module()
    second.tied = first.output  # the same Linear in both chunks
    labels = labels_of([first, second])
    got = {}
    for ns in (THEIRS, OURS):
        cfg = ns.OptimizerConfig(lr=1e-3)
        got[ns is OURS] = describe(ns.get_param_groups([first, second], cfg, {}), labels)
    theirs, ours = got[False], got[True]
    assert theirs[0][1].count("0:output.weight") == 2  # labels_of names the tensor by its first chunk
    assert ours[0][1] == [n for n in theirs[0][1] if n != "0:output.weight"] + ["0:output.weight"]
    assert ours[1:] == theirs[1:]


def test_expected_difference_lr_and_weight_decay_overrides_are_rejected() -> None:
    # Megatron copies them into the group, where the scheduler overwrites them at every step; the face
    # says so and points at max_lr / min_lr and wd_mult / start_wd / end_wd (documented).
    chunks = toy()
    for key in ("lr", "weight_decay"):
        theirs = theirs_groups(chunks, {mco.ParamKey(name="fc.*"): {key: 0.1}})
        assert [g.get(key) for g in theirs] == [None, None, 0.1]
        with pytest.raises(ValueError, match=key):
            ours_groups(chunks, {face.ParamKey(name="fc.*"): {key: 0.1}})


def test_expected_difference_incomparable_override_values_keep_an_order() -> None:
    # Megatron sorts group keys by their items, and None vs a float raises TypeError there; the face keeps
    # a deterministic order instead (documented in get_param_groups).
    chunks = toy()
    def make(ns: SimpleNamespace) -> dict:
        return {ns.ParamKey(name="fc.*"): {"eps": None}, ns.ParamKey(name="norm.*"): {"eps": 1e-6}}

    with pytest.raises(TypeError):
        theirs_groups(chunks, make(THEIRS))
    first = ours_groups(chunks, make(OURS))
    again = ours_groups(chunks, make(OURS))
    assert [g["param_names"] for g in first] == [g["param_names"] for g in again]
    assert sorted(g.get("eps", 0.0) or 0.0 for g in first) == [0.0, 0.0, 0.0, 1e-6]


def test_expected_difference_list_values_become_tuples() -> None:
    # Megatron hashes the override items, so a list value is a TypeError there; the face takes it as a tuple
    # (documented in get_param_groups).
    chunks = toy()
    with pytest.raises(TypeError, match="unhashable"):
        theirs_groups(chunks, {mco.ParamKey(name="fc.*"): {"betas": [0.9, 0.95]}})
    ours = ours_groups(chunks, {face.ParamKey(name="fc.*"): {"betas": [0.9, 0.95]}})
    theirs = theirs_groups(chunks, {mco.ParamKey(name="fc.*"): {"betas": (0.9, 0.95)}})
    labels = labels_of(chunks)
    assert describe(ours, labels) == describe(theirs, labels)


def test_expected_difference_protected_and_invalid_override_values() -> None:
    # Megatron copies any override into the group (after the defaults); the face refuses the fields it
    # derives itself and schedule values that are not finite numbers >= 0 (documented in get_param_groups).
    chunks = toy()
    refused = ({"is_expert_parallel": True}, {"default_config": False}, {"max_lr": -1.0}, {"wd_mult": None})
    for override in refused:
        theirs = theirs_groups(chunks, {mco.ParamKey(name="fc.*"): override})
        key, value = next(iter(override.items()))
        assert theirs[-1][key] == value
        with pytest.raises(ValueError, match=key):
            ours_groups(chunks, {face.ParamKey(name="fc.*"): override})


def test_empty_overrides_dict_means_one_group_per_expert_flag() -> None:
    theirs, ours, chunks = both_groups("toy", "plain", "empty")
    labels = labels_of(chunks)
    assert describe(ours, labels) == describe(theirs, labels)
    assert [g["is_expert_parallel"] for g in ours] == [False, True]


def test_conflicting_overrides_are_errors_in_both() -> None:
    chunks = toy()
    for ns in (THEIRS, OURS):
        cfg = ns.OptimizerConfig(lr=1e-3)
        overrides = {ns.ParamKey(name="fc.*"): {"wd_mult": 0.5}, ns.ParamKey(name="*.bias"): {"wd_mult": 0.0}}
        with pytest.raises(ValueError, match="wd_mult"):
            ns.get_param_groups(chunks, cfg, overrides)


def test_check_config_overrides_consistency_agrees() -> None:
    for overrides, ok in (
        ({"optimizer": "adam"}, True), ({"optimizer": "sgd"}, False),
        ({"optimizer_cpu_offload": True}, False), ({"overlap_param_gather_with_optimizer_step": False}, True),
    ):
        for ns, check in ((THEIRS, mco.check_config_overrides_consistency),
                          (OURS, face.check_config_overrides_consistency)):
            cfg = ns.OptimizerConfig(lr=1e-3)
            given = {ns.ParamKey(name="*"): overrides}
            if ok:
                assert check(cfg, given) is True
            else:
                with pytest.raises(ValueError, match=next(iter(overrides))):
                    check(cfg, given)


@pytest.mark.parametrize("optimizer_type", ["adam", "sgd", "muon", "lion"])
@pytest.mark.parametrize("config", ["min_lr", "decoupled_min"])
def test_mup_overrides_match_megatron(config: str, optimizer_type: str) -> None:
    theirs_fn = getattr(mco, "get_mup_config_overrides", None)
    if theirs_fn is None:
        pytest.skip("this megatron-core has no get_mup_config_overrides (added after 0.16)")
    chunks = gpt()
    labels = labels_of(chunks)
    got = {}
    for ns, fn in ((THEIRS, theirs_fn), (OURS, face.get_mup_config_overrides)):
        cfg = ns.OptimizerConfig(**CONFIGS[config])
        overrides = {**ns.get_standard_config_overrides(cfg), **fn(cfg, 4.0, optimizer_type)}
        got[ns is OURS] = describe(ns.get_param_groups(chunks, cfg, overrides), labels)
    for (theirs_fields, theirs_names), (ours_fields, ours_names) in zip(got[False], got[True], strict=True):
        assert ours_names == theirs_names
        assert ours_fields.keys() == theirs_fields.keys()
        for k, v in theirs_fields.items():
            assert ours_fields[k] == pytest.approx(v) if isinstance(v, float) else ours_fields[k] == v, k


# -- OptimizerConfig -----------------------------------------------------------------------------------------
def test_config_fields_shared_with_megatron_have_its_defaults_and_order() -> None:
    theirs = [f.name for f in dataclasses.fields(mco.OptimizerConfig)]
    ours = [f.name for f in dataclasses.fields(face.OptimizerConfig)]
    assert [n for n in theirs if n not in ours] == []  # every Megatron field is accepted
    shared = [n for n in theirs if n in ours]
    assert [n for n in ours if n in theirs] == shared  # in Megatron's order
    t, o = mco.OptimizerConfig(), face.OptimizerConfig()
    assert {n: getattr(o, n) for n in shared} == {n: getattr(t, n) for n in shared}


@pytest.mark.parametrize("name", ["AdamOptimizerConfig", "SGDOptimizerConfig"])
def test_config_subclasses_have_megatrons_defaults(name: str) -> None:
    theirs, ours = getattr(mco, name)(), getattr(face, name)()
    shared = [f.name for f in dataclasses.fields(theirs) if hasattr(ours, f.name)]
    assert {n: getattr(ours, n) for n in shared} == {n: getattr(theirs, n) for n in shared}
    assert isinstance(ours, face.OptimizerConfig)
    assert face.to_core(dataclasses.replace(ours, lr=1e-3)).algorithm == {"adam": "adamw", "sgd": "sgd"}[
        ours.optimizer
    ]


@pytest.mark.parametrize(
    "name",
    ["get_standard_config_overrides", "check_config_overrides_consistency", "get_megatron_optimizer",
     "combine_param_group_overrides", "param_group_override_to_tuple"],
)
def test_function_signatures_match_megatron(name: str) -> None:
    theirs = getattr(mco, name, None) or getattr(mcs, name)
    assert _params(getattr(face, name)) == _params(theirs)


def test_scheduler_and_get_param_groups_signatures_match_megatron() -> None:
    assert _params(face.OptimizerParamScheduler) == _params(mcs.OptimizerParamScheduler)
    assert _params(face.get_param_groups) == _params(mco._get_param_groups)


def _params(fn: Callable) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter: what a caller relies on (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_muon_use_nesterov_is_megatron_016s_name() -> None:
    assert face.to_core(face.OptimizerConfig(lr=1e-3, muon_use_nesterov=True)).muon.nesterov
    assert face.to_core(face.OptimizerConfig(lr=1e-3, muon_nesterov=True)).muon.nesterov
    assert not face.to_core(face.OptimizerConfig(lr=1e-3)).muon.nesterov


# -- OptimizerParamScheduler ---------------------------------------------------------------------------------
class Holder:
    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = groups


SCHEDULES = [
    dict(lr_decay_style=s, lr_warmup_steps=w) for s in ("constant", "linear", "cosine", "inverse-square-root")
    for w in (0, 5)
] + [
    dict(lr_decay_style="WSD", lr_warmup_steps=5, wsd_decay_steps=d, lr_wsd_decay_style=s)
    for d in (10, 40) for s in ("linear", "cosine", "exponential", "minus_sqrt")
]


def both_schedulers(schedule: dict[str, Any], wd_style: str) -> tuple[Any, Any]:
    chunks = toy()
    made = []
    for ns, cls in ((THEIRS, mcs.OptimizerParamScheduler), (OURS, face.OptimizerParamScheduler)):
        cfg = ns.OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=3e-3, decoupled_min_lr=1e-4)
        overrides = ns.get_standard_config_overrides(cfg)
        if wd_style != "constant":  # Megatron asserts start_wd == end_wd per group for 'constant'
            overrides[ns.ParamKey(name="fc.*")] = {"start_wd": 0.0}
        groups = ns.get_param_groups(chunks, cfg, overrides)
        made.append(cls(
            Holder(groups), init_lr=1e-4, max_lr=1e-3, min_lr=1e-5, lr_decay_steps=40, start_wd=0.02,
            end_wd=0.02 if wd_style == "constant" else 0.1, wd_incr_steps=30, wd_incr_style=wd_style,
            use_checkpoint_opt_param_scheduler=False, **schedule,
        ))
    return made[0], made[1]


def values(scheduler: Any) -> list[float]:
    """lr, weight_decay, lr, weight_decay, ... over the scheduler's groups."""
    return [v for g in scheduler.optimizer.param_groups for v in (g["lr"], g["weight_decay"])]


@pytest.mark.parametrize("wd_style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_scheduler_trajectories_match_megatron(schedule: dict[str, Any], wd_style: str) -> None:
    theirs, ours = both_schedulers(schedule, wd_style)
    for step in range(50):
        assert values(ours) == pytest.approx(values(theirs), rel=1e-12, abs=0.0), step
        assert ours.get_wd() == pytest.approx(theirs.get_wd(), rel=1e-12)
        theirs.step(1)
        ours.step(1)
    assert ours.state_dict() == theirs.state_dict()


def test_scheduler_state_dicts_load_across() -> None:
    schedule = dict(lr_decay_style="WSD", lr_warmup_steps=5, wsd_decay_steps=10, lr_wsd_decay_style="cosine")
    theirs, ours = both_schedulers(schedule, "linear")
    for s in (theirs, ours):
        s.step(17)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    fresh_theirs, fresh_ours = both_schedulers(schedule, "linear")
    fresh_theirs.load_state_dict(ours.state_dict())
    fresh_ours.load_state_dict(theirs.state_dict())
    assert fresh_ours.num_steps == fresh_theirs.num_steps == 17
    assert values(fresh_ours) == pytest.approx(values(fresh_theirs), rel=1e-12)
    assert values(fresh_ours) == pytest.approx(values(theirs), rel=1e-12)


@pytest.mark.parametrize("policy", ["use_checkpoint", "override", "match"])
def test_scheduler_checkpoint_policies_match_megatron(policy: str) -> None:
    chunks = toy()
    saved = {"max_lr": 2e-3, "lr_warmup_steps": 3, "num_steps": 12, "lr_decay_style": "linear",
             "lr_decay_steps": 30, "min_lr": 2e-5, "start_wd": 0.01, "end_wd": 0.05, "wd_incr_style": "linear",
             "wd_incr_steps": 20}
    made = []
    for ns, cls in ((THEIRS, mcs.OptimizerParamScheduler), (OURS, face.OptimizerParamScheduler)):
        groups = ns.get_param_groups(chunks, ns.OptimizerConfig(lr=1e-3, min_lr=1e-5), {})
        made.append(cls(
            Holder(groups), init_lr=1e-4, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=5, lr_decay_steps=40,
            lr_decay_style="cosine", start_wd=0.02, end_wd=0.1, wd_incr_steps=30, wd_incr_style="cosine",
            use_checkpoint_opt_param_scheduler=policy == "use_checkpoint",
            override_opt_param_scheduler=policy == "override",
        ))
    theirs, ours = made
    if policy == "match":
        with pytest.raises(AssertionError):
            theirs.load_state_dict(saved)
        with pytest.raises(ValueError, match="max_lr"):
            ours.load_state_dict(saved)
        return
    theirs.load_state_dict(saved)
    ours.load_state_dict(saved)
    assert ours.state_dict() == theirs.state_dict()
    for _ in range(25):
        theirs.step(1)
        ours.step(1)
        assert values(ours) == pytest.approx(values(theirs), rel=1e-12)


def test_expected_difference_load_sets_the_step() -> None:
    # Megatron adds the checkpoint's step to its current count; the face sets it (documented).
    schedule = dict(lr_decay_style="cosine", lr_warmup_steps=5)
    theirs, ours = both_schedulers(schedule, "linear")
    saved = theirs.state_dict() | {"num_steps": 10}
    for s in (theirs, ours):
        s.step(3)
        s.load_state_dict(saved)
    assert (theirs.num_steps, ours.num_steps) == (13, 10)


def test_expected_difference_lr_mult_is_applied() -> None:
    # Megatron's groups carry lr_mult (1.0 unless overridden) and its scheduler ignores it; the face
    # multiplies the group's lr by it (documented in OptimizerParamScheduler).
    chunks = toy()
    got = {}
    for ns, cls in ((THEIRS, mcs.OptimizerParamScheduler), (OURS, face.OptimizerParamScheduler)):
        cfg = ns.OptimizerConfig(lr=1e-3, min_lr=1e-5)
        groups = ns.get_param_groups(chunks, cfg, {ns.ParamKey(name="fc.*"): {"lr_mult": 0.5}})
        sched = cls(Holder(groups), init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=0,
                    lr_decay_steps=10, lr_decay_style="linear", start_wd=0.01, end_wd=0.01, wd_incr_steps=10,
                    wd_incr_style="constant")
        sched.step(4)
        got[ns is OURS] = [(g["lr_mult"], g["lr"]) for g in groups]
    theirs, ours = got[False], got[True]
    assert [m for m, _ in ours] == [m for m, _ in theirs] == [1.0, 1.0, 0.5]
    assert [lr for _, lr in ours] == pytest.approx([lr * m for m, lr in theirs], rel=1e-12)
    assert theirs[2][1] == pytest.approx(theirs[0][1], rel=1e-12)


def test_expected_difference_groups_without_max_lr_use_the_schedulers() -> None:
    # OptimizerConfig(lr=None) gives groups max_lr=None: Megatron's scheduler fails on them, the face's
    # falls back to its own max_lr / min_lr (documented in OptimizerParamScheduler).
    chunks = toy()
    kwargs = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=2, lr_decay_steps=10,
                  lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=10,
                  wd_incr_style="constant")
    with pytest.raises(TypeError):
        mcs.OptimizerParamScheduler(Holder(theirs_groups(chunks, {}, lr=None)), **kwargs)
    ours = face.OptimizerParamScheduler(Holder(ours_groups(chunks, {}, lr=None)), **kwargs)
    reference = mcs.OptimizerParamScheduler(Holder([{"params": []}]), **kwargs)
    for _ in range(12):
        expected = reference.optimizer.param_groups[0]["lr"]
        assert [g["lr"] for g in ours.optimizer.param_groups] == [expected, expected]
        ours.step(1)
        reference.step(1)


def test_canonical_lr_for_logging_agrees() -> None:
    groups = [{"default_config": False, "lr": 1.0}, {"default_config": True, "lr": 2.0}]
    assert face.get_canonical_lr_for_logging(groups) == mcs.get_canonical_lr_for_logging(groups) == 2.0
    assert face.get_canonical_lr_for_logging(groups[:1]) is None
    assert mcs.get_canonical_lr_for_logging(groups[:1]) is None
