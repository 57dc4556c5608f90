"""Grouping resolved parameters: keys, order, group fields, and properties over random models and rules."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from optstack.groups import GroupKey, build_param_groups, group_keys, group_map, param_group_table
from optstack.rules import Always, Attr, Name, Ndim, Rule, resolve, standard_rules

LR, MIN_LR = 1e-3, 1e-5


def P(*shape: int, requires_grad: bool = True, **attrs: object) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape), requires_grad=requires_grad)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _model() -> list[tuple[str, nn.Parameter]]:
    return [
        ("embed.weight", P(10, 4, is_embedding_or_output_parameter=True)),
        ("l0.w", P(4, 4)),
        ("l0.bias", P(4)),
        ("l0.experts.w", P(2, 4, 4, allreduce=False)),
        ("l0.experts.bias", P(2, 4, allreduce=False)),
        ("frozen.w", P(4, 4, requires_grad=False)),
        ("l1.w", P(4, 4)),
        ("l1.bias", P(4)),
        ("norm.weight", P(4)),
        ("output.weight", P(10, 4, is_embedding_or_output_parameter=True)),
    ]


# -- GroupKey ----------------------------------------------------------------------------------------------
def test_group_key_is_canonical_hashable_picklable():
    a = GroupKey((("wd_mult", 0.0), ("algorithm", "sgd")), False)
    b = GroupKey((("algorithm", "sgd"), ("wd_mult", 0.0)), False)
    assert a == b and hash(a) == hash(b) and a.settings == (("algorithm", "sgd"), ("wd_mult", 0.0))
    assert pickle.loads(pickle.dumps(a)) == a
    assert a != GroupKey(a.settings, True)
    assert str(GroupKey((("wd_mult", 0.0),), True)) == "wd_mult=0.0 [expert]"
    assert str(GroupKey()) == "defaults"
    with pytest.raises(ValueError, match="distinct string keys"):
        GroupKey((("a", 1), ("a", 2)))


def test_group_key_order_defaults_first_then_settings_dense_before_expert():
    keys = [
        GroupKey((("wd_mult", 0.0),), True),
        GroupKey((("max_lr", 0.01),), False),
        GroupKey((), True),
        GroupKey((("wd_mult", 0.0),), False),
        GroupKey((("algorithm", "adamw"), ("eps", 1e-8)), False),  # mixed value types sort by repr
        GroupKey((), False),
    ]
    ordered = sorted(keys)
    assert ordered[:2] == [GroupKey((), False), GroupKey((), True)]
    assert ordered.index(GroupKey((("wd_mult", 0.0),), False)) + 1 == ordered.index(
        GroupKey((("wd_mult", 0.0),), True)
    )
    assert all(sorted(random.Random(s).sample(keys, len(keys))) == ordered for s in range(5))


def test_default_config_only_without_lr_keys():
    assert GroupKey((("wd_mult", 0.0), ("eps", 1e-6))).default_config
    for k in ("max_lr", "min_lr", "lr_mult"):
        assert not GroupKey(((k, 0.5),)).default_config


# -- build_param_groups ------------------------------------------------------------------------------------
def test_groups_fields_order_and_membership():
    params = _model()
    rules = standard_rules(decoupled_lr=0.01) + [Rule(Ndim(ge=3), algorithm="adamw", why="3-D")]
    resolved = resolve(params, rules)
    groups = build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR)
    summary = [(g["param_names"], g["is_expert_parallel"]) for g in groups]
    assert summary == [
        (["l0.w", "l1.w"], False),
        (["l0.experts.w"], True),
        (["embed.weight", "output.weight"], False),
        (["l0.bias", "l1.bias", "norm.weight"], False),
        (["l0.experts.bias"], True),
    ]
    g0, g1, g2, g3 = groups[:4]
    assert list(g0) == ["params", "param_names", "is_expert_parallel", "default_config", "wd_mult", "lr_mult",
                        "max_lr", "min_lr"]
    assert (g0["default_config"], g0["wd_mult"], g0["lr_mult"], g0["max_lr"], g0["min_lr"]) == (
        True, 1.0, 1.0, LR, MIN_LR)
    assert g1["algorithm"] == "adamw" and g1["default_config"]
    assert g2["max_lr"] == 0.01 and g2["min_lr"] == MIN_LR and not g2["default_config"]
    assert g3["wd_mult"] == 0.0 and g3["default_config"]
    by_name = dict(params)
    for g in groups:
        assert all(p is by_name[n] for n, p in zip(g["param_names"], g["params"], strict=True))
    # The groups are usable by any torch.optim optimizer (extra keys kept).
    opt = torch.optim.SGD(groups, lr=0.1)
    assert opt.param_groups[2]["max_lr"] == 0.01


def test_given_keys_are_used_exactly_with_empty_groups():
    params = _model()
    resolved = resolve(params, standard_rules())
    extra = GroupKey((("algorithm", "lion"),), False)
    keys = sorted(group_keys(resolved) + [extra])
    groups = build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR, keys=keys)
    assert len(groups) == len(keys)
    empty = groups[keys.index(extra)]
    assert empty["params"] == [] and empty["param_names"] == [] and empty["algorithm"] == "lion"
    reversed_groups = build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR, keys=keys[::-1])
    assert [g["param_names"] for g in reversed_groups] == [g["param_names"] for g in groups][::-1]
    with pytest.raises(ValueError, match="not in `keys`"):
        build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR, keys=[extra])
    with pytest.raises(ValueError, match="keys must be distinct"):
        build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR, keys=keys + [extra])


def test_bad_inputs_raise():
    params = _model()
    resolved = resolve(params, [])
    with pytest.raises(ValueError, match="lr must be a finite number >= 0, got -1"):
        build_param_groups(params, resolved, lr=-1, min_lr=0.0)
    with pytest.raises(ValueError, match="min_lr must be a finite number"):
        build_param_groups(params, resolved, lr=1.0, min_lr=float("nan"))
    with pytest.raises(ValueError, match="'l0.w' is missing from `resolved`"):
        build_param_groups(params, {k: v for k, v in resolved.items() if k != "l0.w"}, lr=LR, min_lr=MIN_LR)
    with pytest.raises(ValueError, match="not trainable parameters of named_params"):
        build_param_groups(params[:3], resolved, lr=LR, min_lr=MIN_LR)


def test_frozen_after_resolve_is_left_out_loudly():
    params = _model()
    resolved = resolve(params, [])
    params[1][1].requires_grad_(False)
    with pytest.raises(ValueError, match="'l0.w'"):
        build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR)


def test_inputs_are_not_mutated_and_modules_and_chunks_work():
    torch.manual_seed(0)
    chunks = [nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), nn.Sequential(nn.Linear(2, 3))]
    rules = standard_rules()
    rules_before = list(rules)
    resolved = resolve(chunks, rules)
    snapshot = {k: (dict(v.settings), v.is_expert) for k, v in resolved.items()}
    groups = build_param_groups(chunks, resolved, lr=LR, min_lr=MIN_LR)
    assert rules == rules_before
    assert {k: (dict(v.settings), v.is_expert) for k, v in resolved.items()} == snapshot
    assert [g["param_names"] for g in groups] == [["chunk0.0.weight", "chunk1.0.weight"],
                                                 ["chunk0.0.bias", "chunk0.1.weight", "chunk0.1.bias",
                                                  "chunk1.0.bias"]]
    groups[0]["params"].clear()  # groups are fresh containers every call
    again = build_param_groups(chunks, resolved, lr=LR, min_lr=MIN_LR)
    assert len(again[0]["params"]) == 2
    single = nn.Linear(2, 2)
    single_groups = build_param_groups(single, resolve(single, rules), lr=LR, min_lr=0.0)
    assert [g["param_names"] for g in single_groups] == [["weight"], ["bias"]]


def test_group_map():
    params = _model()
    groups = build_param_groups(params, resolve(params, standard_rules()), lr=LR, min_lr=MIN_LR)
    mapping = group_map(groups)
    assert mapping["param_to_group"] == {n: i for i, g in enumerate(groups) for n in g["param_names"]}
    assert [(e["index"], e["params"]) for e in mapping["groups"]] == [(i, g["param_names"]) for i, g in
                                                                      enumerate(groups)]
    for entry, group in zip(mapping["groups"], groups, strict=True):
        assert entry["settings"] == {k: v for k, v in group.items() if k not in ("params", "param_names")}
    unnamed = group_map([{"params": [P(1), P(2)], "lr": 0.1}, {"params": [], "lr": 0.2}])
    assert unnamed["param_to_group"] == {"group0.param0": 0, "group0.param1": 0}
    assert [e["settings"] for e in unnamed["groups"]] == [{"lr": 0.1}, {"lr": 0.2}]


def test_param_group_table():
    params = _model()
    groups = build_param_groups(params, resolve(params, standard_rules()), lr=LR, min_lr=MIN_LR)
    rows = param_group_table(groups)
    assert [r["name"] for r in rows] == [n for g in groups for n in g["param_names"]]
    row = next(r for r in rows if r["name"] == "l0.experts.w")
    assert row["shape"] == [2, 4, 4] and row["numel"] == 32 and row["is_expert_parallel"]
    assert "params" not in row["settings"] and row["settings"]["max_lr"] == LR
    bias = next(r for r in rows if r["name"] == "l0.bias")
    assert bias["settings"]["wd_mult"] == 0.0 and groups[bias["group"]]["param_names"][0] == "l0.bias"


# -- properties over random models and rule sets ------------------------------------------------------------
MATCHERS = [Name("*.bias"), Name("a*"), Ndim(lt=2), Ndim(eq=2), Ndim(ge=3), Attr("flag"), Always(),
            ~Name("*.bias") & Ndim(ge=2)]
VALUES = {"wd_mult": [0.0, 0.5], "max_lr": [1e-3, 2e-3], "algorithm": ["adamw", "sgd"], "eps": [1e-8],
          "betas": [(0.9, 0.95)]}

rule_strategy = st.builds(
    lambda m, kv: Rule(m, **dict(kv)),
    st.sampled_from(MATCHERS),
    st.lists(st.sampled_from([(k, v) for k, vs in VALUES.items() for v in vs]), min_size=1, max_size=3,
             unique_by=lambda kv: kv[0]),
)
# (name prefix, leaf, ndim, trainable, expert, flag)
param_strategy = st.tuples(
    st.sampled_from(["a", "b", "c.d"]), st.sampled_from(["weight", "bias"]), st.integers(0, 3),
    st.booleans(), st.booleans(), st.booleans(),
)


def _build(specs) -> list[tuple[str, nn.Parameter]]:
    out = []
    for i, (prefix, leaf, ndim, trainable, expert, flag) in enumerate(specs):
        attrs = {"allreduce": False} if expert else {}
        out.append((f"{prefix}{i}.{leaf}", P(*([2] * ndim), requires_grad=trainable, flag=flag, **attrs)))
    return out


def _conflicts(params, rules) -> bool:
    try:
        resolve(params, rules)
    except ValueError:
        return True
    return False


@settings(max_examples=50, deadline=None)
@given(st.lists(param_strategy, min_size=1, max_size=8), st.lists(rule_strategy, max_size=5), st.randoms())
def test_property_partition_is_exact_and_deterministic(specs, rules, rnd):
    params = _build(specs)
    if _conflicts(params, rules):
        return  # conflict detection is its own property in test_rules.py
    resolved = resolve(params, rules)
    groups = build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR)

    # Every trainable parameter in exactly one group, frozen ones in none, in model order within a group.
    placed = [id(p) for g in groups for p in g["params"]]
    assert sorted(placed) == sorted(id(p) for _, p in params if p.requires_grad)
    order = {n: i for i, (n, _) in enumerate(params)}
    for g in groups:
        idx = [order[n] for n in g["param_names"]]
        assert idx == sorted(idx) and g["params"]  # no empty groups without given keys
        key = GroupKey(tuple((k, g[k]) for k, _ in GroupKey.of(resolved[g["param_names"][0]]).settings),
                       g["is_expert_parallel"])
        for n in g["param_names"]:
            assert GroupKey.of(resolved[n]) == key
            assert g["is_expert_parallel"] == (not getattr(dict(params)[n], "allreduce", True))
    keys = group_keys(resolved)
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    if any(not k.settings for k in keys):
        assert not keys[0].settings

    # Deterministic: rebuilt, and with the rules shuffled, the groups are the same.
    def signature(gs):
        return [(g["param_names"], {k: v for k, v in g.items() if k not in ("params", "param_names")})
                for g in gs]

    shuffled = list(rules)
    rnd.shuffle(shuffled)
    again = build_param_groups(params, resolve(params, shuffled), lr=LR, min_lr=MIN_LR)
    assert signature(again) == signature(groups)
    assert signature(build_param_groups(params, resolved, lr=LR, min_lr=MIN_LR)) == signature(groups)
    # Copies of the model (fresh tensors, same names and flags) give the same groups too.
    clone = _build(specs)
    from_clone = build_param_groups(clone, resolve(clone, rules), lr=LR, min_lr=MIN_LR)
    assert signature(from_clone) == signature(groups)
