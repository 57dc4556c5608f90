"""optstack.megatron keys, overrides and get_param_groups: Megatron's semantics on small models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack.megatron import (
    OptimizerConfig,
    ParamGroupOverride,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    check_config_overrides_consistency,
    combine_param_group_overrides,
    get_mup_config_overrides,
    get_param_groups,
    get_standard_config_overrides,
    param_group_override_to_tuple,
)
from optstack.rules import Never


def build(spec: dict[str, tuple[int, ...]], flags: dict[str, dict[str, object]] | None = None) -> nn.Module:
    """A module whose named_parameters() are exactly ``spec``'s names (in order), with attributes set."""
    root = nn.Module()
    for name, shape in spec.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        param = nn.Parameter(torch.zeros(shape))
        for attr, value in (flags or {}).get(name, {}).items():
            setattr(param, attr, value)
        module.register_parameter(leaf, param)
    return root


GPT = {
    "embedding.word_embeddings.weight": (10, 8),
    "decoder.layers.0.self_attention.linear_qkv.weight": (24, 8),
    "decoder.layers.0.self_attention.linear_qkv.bias": (24,),
    "decoder.layers.0.self_attention.q_layernorm.weight": (8,),
    "decoder.layers.0.self_attention.k_layernorm.weight": (8,),
    "decoder.layers.0.mlp.fc1.weight": (16, 8),
    "decoder.layers.0.mlp.fc1.bias": (16,),
    "decoder.final_layernorm.weight": (8,),
    "decoder.scale": (),
    "output_layer.weight": (10, 8),
}
FLAGS = {
    "embedding.word_embeddings.weight": {"is_embedding_or_output_parameter": True},
    "output_layer.weight": {"is_embedding_or_output_parameter": True},
}


def gpt() -> nn.Module:
    return build(GPT, FLAGS)


def merged(model: nn.Module, overrides: dict) -> dict[str, dict]:
    """Megatron's per-parameter merge: every matching key's override, combined."""
    return {
        n: dict(combine_param_group_overrides([o for k, o in overrides.items() if k.matches(p, n)]))
        for n, p in model.named_parameters()
    }


# -- ParamKey.matches --------------------------------------------------------------------------------------
def p(*shape: int, **attrs: object) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(shape))
    for k, v in attrs.items():
        setattr(param, k, v)
    return param


@pytest.mark.parametrize(
    ("glob", "name", "expected"),
    [
        ("*.bias", "fc.bias", True),
        ("*.bias", "fc.bias_scale", False),
        ("*.bias*", "fc.bias_scale", True),
        ("*.bias*", "fc.bias", True),
        ("*.bias", "bias", False),  # the dot is literal
        ("decoder.*", "decoder.layers.0.fc.weight", True),  # '*' crosses dots
        ("decoder.layers.?.fc.weight", "decoder.layers.1.fc.weight", True),
        ("decoder.layers.?.fc.weight", "decoder.layers.10.fc.weight", False),
    ],
)
def test_name_globs(glob: str, name: str, expected: bool) -> None:
    assert ParamKey(name=glob).matches(p(3), name) is expected


def test_attr_truthiness() -> None:
    key = ParamKey(attr="is_embedding_or_output_parameter")
    assert key.matches(p(3, is_embedding_or_output_parameter=True), "w")
    assert not key.matches(p(3, is_embedding_or_output_parameter=False), "w")
    assert not key.matches(p(3), "w")  # missing attribute


def test_empty_key_matches_nothing() -> None:
    key = ParamKey()
    assert isinstance(key.to_matcher(), Never)
    assert not key.matches(p(3), "anything")
    assert not key.matches(p(2, 2, foo=True), "x.bias")


def test_fields_are_or_ed_and_tuples_are_or_ed() -> None:
    one_d = ParamPredicate(name="1d", fn=lambda t: t.dim() == 1)
    key = ParamKey(name=("a.*", "b.*"), attr=("x", "y"), predicate=one_d)
    assert key.matches(p(2, 2), "a.w") and key.matches(p(2, 2), "b.w")
    assert key.matches(p(2, 2, y=True), "c.w")
    assert key.matches(p(4), "c.w")
    assert not key.matches(p(2, 2), "c.w")
    by_name = ParamWithNamePredicate(name="has_q", fn=lambda t, n: "q" in n)
    big = ParamPredicate(name="big", fn=lambda t: t.numel() > 10)
    key2 = ParamKey(predicate=(one_d, big), with_name_predicate=(by_name,))
    assert key2.matches(p(11, 11), "w") and key2.matches(p(2, 2), "q.w") and not key2.matches(p(2, 2), "w")


def test_predicates_compare_and_hash_by_name() -> None:
    a = ParamPredicate(name="s1", fn=lambda t: t.dim() == 1)
    b = ParamPredicate(name="s1", fn=lambda t: False)
    assert a == b and len({a, b}) == 1
    assert ParamKey(predicate=a) == ParamKey(predicate=b)
    assert {ParamKey(name="*.bias"): 1}[ParamKey(name="*.bias")] == 1


def test_key_translates_to_a_readable_matcher() -> None:
    key = ParamKey(name="*.bias", predicate=ParamPredicate(name="param_len_1", fn=lambda t: t.dim() == 1))
    assert repr(key.to_matcher()) == "Name('*.bias') | Predicate('param_len_1')"


@pytest.mark.parametrize("bad", [dict(name=["*.bias"]), dict(attr=3), dict(predicate=lambda t: True)])
def test_malformed_key_is_a_value_error(bad: dict) -> None:
    with pytest.raises(ValueError, match="ParamKey"):
        ParamKey(**bad).matches(p(3), "x")


# -- combine / tuple / consistency -------------------------------------------------------------------------
def test_combine_merges_and_detects_conflicts() -> None:
    combined = combine_param_group_overrides([{"wd_mult": 0.0}, None, {"max_lr": 1.0, "wd_mult": 0.0}])
    assert combined == {"wd_mult": 0.0, "max_lr": 1.0}
    with pytest.raises(ValueError, match="Conflicting overrides for wd_mult: 0.0 and 0.5"):
        combine_param_group_overrides([{"wd_mult": 0.0}, {"wd_mult": 0.5}])
    assert combine_param_group_overrides([]) == {}


def test_override_to_tuple_is_sorted_and_hashable() -> None:
    assert param_group_override_to_tuple(None) is None
    t = param_group_override_to_tuple(ParamGroupOverride(wd_mult=0.0, max_lr=1.0))
    assert t == (("max_lr", 1.0), ("wd_mult", 0.0))
    assert t == param_group_override_to_tuple({"max_lr": 1.0, "wd_mult": 0.0}) and hash(t)


@pytest.mark.parametrize(
    ("field", "value"),
    [("optimizer", "sgd"), ("optimizer_cpu_offload", True),
     ("overlap_param_gather_with_optimizer_step", True)],
)
def test_overrides_may_not_change_protected_fields(field: str, value: object) -> None:
    cfg = OptimizerConfig(lr=1e-3)
    with pytest.raises(ValueError, match=f"Field {field} should not be overridden"):
        check_config_overrides_consistency(cfg, {ParamKey(name="*"): {field: value}})
    assert check_config_overrides_consistency(cfg, {ParamKey(name="*"): {field: getattr(cfg, field)}})
    assert check_config_overrides_consistency(cfg, None)


# -- standard and MuP overrides ----------------------------------------------------------------------------
ATTN = "decoder.layers.0.self_attention."
QK_NORMS = {ATTN + "q_layernorm.weight", ATTN + "k_layernorm.weight"}
NO_WD = {ATTN + "linear_qkv.bias", *QK_NORMS, "decoder.layers.0.mlp.fc1.bias",
         "decoder.final_layernorm.weight"}
EMB_OUT = {"embedding.word_embeddings.weight", "output_layer.weight"}


def test_standard_overrides_default() -> None:
    got = merged(gpt(), get_standard_config_overrides(OptimizerConfig(lr=1e-3)))
    assert got == {n: ({"wd_mult": 0.0} if n in NO_WD else {}) for n in GPT}  # the 0-d scale keeps wd


def test_standard_overrides_with_decoupled_lr_and_qk_layernorm() -> None:
    cfg = OptimizerConfig(lr=1e-3, decoupled_lr=1e-2, decoupled_min_lr=1e-3, apply_wd_to_qk_layernorm=True)
    overrides = get_standard_config_overrides(cfg)
    assert ParamKey(attr="is_embedding_or_output_parameter") in overrides  # Megatron's key, replaceable
    got = merged(gpt(), overrides)
    expected = {n: {} for n in GPT}
    for n in NO_WD - QK_NORMS:
        expected[n] = {"wd_mult": 0.0}
    for n in EMB_OUT:
        expected[n] = {"max_lr": 1e-2, "min_lr": 1e-3}
    assert got == expected


def test_standard_decoupled_min_lr_only_with_decoupled_lr() -> None:
    overrides = get_standard_config_overrides(OptimizerConfig(lr=1e-3, decoupled_lr=5e-3))
    assert overrides[ParamKey(attr="is_embedding_or_output_parameter")] == {"max_lr": 5e-3}
    assert len(get_standard_config_overrides(OptimizerConfig(lr=1e-3, decoupled_min_lr=1e-4))) == 1


# 2-D and not an embedding (the output matrix counts as hidden, as in Megatron)
HIDDEN = {ATTN + "linear_qkv.weight", "decoder.layers.0.mlp.fc1.weight", "output_layer.weight"}
VECTOR_LIKE = set(GPT) - HIDDEN  # ndim <= 1 and the embedding ("embedding" in its name)


def approx(d: dict) -> dict:
    return {n: {k: pytest.approx(v, rel=1e-12) for k, v in o.items()} for n, o in d.items()}


def test_mup_adam() -> None:
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, adam_eps=1e-8)
    got = merged(gpt(), get_mup_config_overrides(cfg, 4.0, "adam"))
    hidden = {"max_lr": 2.5e-4, "min_lr": 2.5e-5, "eps": 2.5e-9}
    assert got == approx({n: (hidden if n in HIDDEN else {}) for n in GPT})


def test_mup_adam_with_decoupled_lr_keeps_embedding_output_lr() -> None:
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, adam_eps=1e-8, decoupled_lr=1e-2)
    got = merged(gpt(), get_mup_config_overrides(cfg, 4.0, "adam"))
    expected = {n: {} for n in GPT}
    for n in HIDDEN:
        expected[n] = {"max_lr": 2.5e-4, "min_lr": 2.5e-5, "eps": 2.5e-9}
    expected["output_layer.weight"] = {"eps": 2.5e-9}  # no LR scaling on decoupled params, eps still scaled
    assert got == approx(expected)
    # together with the standard overrides there is no conflict
    both = {**get_standard_config_overrides(cfg), **get_mup_config_overrides(cfg, 4.0, "adam")}
    assert merged(gpt(), both)["output_layer.weight"] == approx({"x": {"max_lr": 1e-2, "eps": 2.5e-9}})["x"]


def test_mup_sgd_scales_vector_like_up() -> None:
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4)
    got = merged(gpt(), get_mup_config_overrides(cfg, 4.0, "sgd"))
    assert got == approx({n: ({"max_lr": 4e-3, "min_lr": 4e-4} if n in VECTOR_LIKE else {}) for n in GPT})


def test_mup_muon_leaves_muon_matrices_alone() -> None:
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, optimizer="muon")
    got = merged(gpt(), get_mup_config_overrides(cfg, 4.0, "muon"))
    # qkv and fc1 are Muon's; the output matrix goes to the scalar Adam: lr/w, and no eps (as Megatron)
    assert got == approx({n: ({"max_lr": 2.5e-4, "min_lr": 2.5e-5} if n == "output_layer.weight" else {})
                          for n in GPT})


def test_mup_width_one_and_bad_inputs() -> None:
    cfg = OptimizerConfig(lr=1e-3)
    assert get_mup_config_overrides(cfg, 1.0) == {}
    got = merged(gpt(), get_mup_config_overrides(cfg, 2.0, "lion"))  # non-Adam: hidden lr/w, no eps
    assert got["decoder.layers.0.mlp.fc1.weight"] == approx({"x": {"max_lr": 5e-4}})["x"]
    with pytest.raises(ValueError, match="config.lr"):
        get_mup_config_overrides(OptimizerConfig(), 2.0)
    with pytest.raises(ValueError, match="width_mult"):
        get_mup_config_overrides(cfg, 0.0)


# -- get_param_groups --------------------------------------------------------------------------------------
FIELDS = ["params", "param_names", "is_expert_parallel", "default_config", "wd_mult", "lr_mult",
          "is_decoupled_lr", "max_lr", "min_lr"]


def test_none_means_standard_overrides_and_empty_means_none() -> None:
    model = gpt()
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=1e-2)
    groups = get_param_groups([model], cfg, None)
    assert [list(g) for g in groups] == [FIELDS, FIELDS, FIELDS]
    default, decoupled, no_wd = groups
    order = [n for n, _ in model.named_parameters()]  # model order (a module's own params before children's)
    assert default["param_names"] == [n for n in order if n not in NO_WD | EMB_OUT]
    assert (default["default_config"], default["wd_mult"], default["max_lr"], default["min_lr"]) == (
        True, 1.0, 1e-3, 1e-5)
    # ('max_lr', ...) sorts before ('wd_mult', ...): Megatron's order of the sorted override items
    assert decoupled["param_names"] == [n for n in order if n in EMB_OUT] and decoupled["max_lr"] == 1e-2
    assert decoupled["default_config"] is False and decoupled["min_lr"] == 1e-5
    assert no_wd["param_names"] == [n for n in order if n in NO_WD] and no_wd["wd_mult"] == 0.0
    assert no_wd["default_config"] is True
    params = dict(model.named_parameters())
    assert all(p is params[n] for g in groups for n, p in zip(g["param_names"], g["params"], strict=True))

    (only,) = get_param_groups([model], cfg, {})
    assert only["param_names"] == order and only["wd_mult"] == 1.0 and only["default_config"] is True


def test_groups_skip_frozen_split_experts_and_keep_megatron_defaults() -> None:
    spec = {"a.weight": (4, 4), "a.bias": (4,), "experts.w": (4, 4), "experts.b": (4,), "frozen.w": (4, 4)}
    model = build(spec, {"experts.w": {"allreduce": False}, "experts.b": {"allreduce": False}})
    model.frozen.w.requires_grad_(False)
    groups = get_param_groups(model, OptimizerConfig(), None)  # lr None stays None, as in Megatron
    assert [(g["param_names"], g["is_expert_parallel"]) for g in groups] == [
        (["a.weight"], False), (["experts.w"], True), (["a.bias"], False), (["experts.b"], True)]
    assert all(g["max_lr"] is None and g["min_lr"] is None and g["is_decoupled_lr"] is False for g in groups)


def test_group_order_follows_sorted_override_items() -> None:
    model = build({"x.a": (2, 2), "x.b": (2, 2), "x.c": (2, 2), "x.d": (2, 2)})
    overrides = {
        ParamKey(name="x.a"): {"wd_mult": 0.5},
        ParamKey(name="x.b"): {"max_lr": 1e-5},
        ParamKey(name="x.c"): {"max_lr": 1e-3},
    }
    groups = get_param_groups([model], OptimizerConfig(lr=1e-2), overrides)
    # numeric order of the values (1e-5 < 1e-3), not their repr
    assert [g["param_names"] for g in groups] == [["x.d"], ["x.b"], ["x.c"], ["x.a"]]
    assert [g["default_config"] for g in groups] == [True, False, False, True]


def test_incomparable_override_values_fall_back_to_a_deterministic_order() -> None:
    model = build({"x.a": (2, 2), "x.b": (2, 2)})
    overrides = {ParamKey(name="x.a"): {"eps": None}, ParamKey(name="x.b"): {"eps": 1e-6}}  # None vs float
    groups = get_param_groups([model], OptimizerConfig(lr=1.0), overrides)
    assert sorted(g["param_names"][0] for g in groups) == ["x.a", "x.b"]
    assert groups == get_param_groups([model], OptimizerConfig(lr=1.0), dict(reversed(overrides.items())))


def test_overrides_merge_translate_and_report_conflicts() -> None:
    model = build({"x.w": (2, 2), "x.bias": (2,)})
    cfg = OptimizerConfig(lr=1e-3, decoupled_weight_decay=False)
    overrides = {ParamKey(name="*.bias"): {"optimizer": "adam", "eps": 1e-6}, ParamKey(attr="nope"): {}}
    override_copy = dict(overrides)
    groups = get_param_groups([model], cfg, overrides)
    assert overrides == override_copy  # the caller's dict is untouched
    assert groups[1]["param_names"] == ["x.bias"]
    assert groups[1]["optimizer"] == "adam" and groups[1]["eps"] == 1e-6
    with pytest.raises(ValueError, match="conflicting rules for parameter 'x.bias'"):
        get_param_groups([model], cfg, {ParamKey(name="*.bias"): {"wd_mult": 0.0},
                                        ParamKey(name="x.*"): {"wd_mult": 1.0}})
    for key in ("lr", "weight_decay", "params"):
        with pytest.raises(ValueError, match=repr(key)):
            get_param_groups([model], cfg, {ParamKey(name="*"): {key: 0.1}})


def test_chunks_match_their_own_names() -> None:
    spec = {"decoder.w": (2, 2), "decoder.b": (2,)}
    chunks = [build(spec), build(spec)]
    groups = get_param_groups(chunks, OptimizerConfig(lr=1.0), {ParamKey(name="decoder.b"): {"wd_mult": 0.0}})
    assert [g["param_names"] for g in groups] == [["chunk0.decoder.w", "chunk1.decoder.w"],
                                                  ["chunk0.decoder.b", "chunk1.decoder.b"]]
    assert groups[1]["params"][1] is chunks[1].decoder.b
    with pytest.raises(ValueError, match="model_chunks"):
        get_param_groups([], OptimizerConfig(lr=1.0), None)
