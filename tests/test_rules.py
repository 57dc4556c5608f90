"""Matchers, rules, resolve/explain, and the stock rule sets (standard, MuP, Muon routing)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from optstack.rules import (
    Always,
    And,
    Attr,
    Matcher,
    Name,
    NamedPredicate,
    Ndim,
    Never,
    Not,
    Or,
    Predicate,
    Rule,
    Shape,
    explain,
    format_explain,
    muon_routing_rule,
    mup_rules,
    named_parameters_of,
    resolve,
    standard_rules,
)


def P(*shape: int, requires_grad: bool = True, **attrs: object) -> nn.Parameter:
    """A tiny parameter carrying Megatron-style flags (as Megatron models set them)."""
    p = nn.Parameter(torch.zeros(shape), requires_grad=requires_grad)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


# -- matchers ----------------------------------------------------------------------------------------------
def test_name_globs_are_case_sensitive_fnmatch_and_any_of():
    p = P(3)
    assert Name("*.bias")(p, "layer.0.bias")
    assert not Name("*.bias")(p, "layer.0.bias_scale")
    assert Name("*.bias*")(p, "layer.0.bias_scale")
    assert not Name("*.Bias")(p, "layer.0.bias")
    assert Name("x", "layers.?.w")(p, "layers.3.w")
    assert not Name("x", "layers.?.w")(p, "layers.10.w")


def test_attr_is_truthiness_of_any_attribute():
    assert Attr("flag")(P(2, flag=True), "n")
    assert not Attr("flag")(P(2, flag=False), "n")
    assert not Attr("flag")(P(2), "n")
    assert Attr("a", "b")(P(2, b=1), "n")
    assert not Attr("a", "b")(P(2, a=0, b=None), "n")


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"eq": 2}, [False, False, True, False]),
        ({"lt": 2}, [True, True, False, False]),
        ({"le": 1}, [True, True, False, False]),
        ({"gt": 1}, [False, False, True, True]),
        ({"ge": 2}, [False, False, True, True]),
        ({"ge": 1, "le": 2}, [False, True, True, False]),
    ],
)
def test_ndim_bounds(kw, expected):
    params = [P(), P(2), P(2, 2), P(2, 2, 2)]
    assert [Ndim(**kw)(p, "n") for p in params] == expected


def test_shape_predicate_named_predicate_always_never():
    p = P(4, 8)
    assert Shape(4, 8)(p, "n") and not Shape(8, 4)(p, "n") and Shape()(P(), "n")
    assert Predicate(lambda t: t.numel() == 32, "32 elements")(p, "n")
    assert not Predicate(lambda t: t.numel() == 3, "3 elements")(p, "n")
    assert NamedPredicate(lambda t, n: n.startswith("enc") and t.dim() == 2, "enc matrix")(p, "enc.w")
    assert not NamedPredicate(lambda t, n: n.startswith("enc"), "enc")(p, "dec.w")
    assert Always()(p, "n") and not Never()(p, "n")


def test_composition_truth_table_and_flattening():
    a, b, c = Name("a*"), Ndim(eq=2), Attr("f")
    p2, p1f = P(2, 2), P(2, f=True)
    for m, name, p, want in [
        (a & b, "ax", p2, True), (a & b, "ax", p1f, False), (a & b, "bx", p2, False),
        (a | b, "bx", p2, True), (a | b, "bx", p1f, False), (a | c, "bx", p1f, True),
        (~a, "ax", p2, False), (~a, "bx", p2, True), (~(a | b) & c, "bx", p1f, True),
    ]:
        assert m(p, name) is want, (m, name)
    assert (a | b | c) == Or(a, b, c) and (a & b & c) == And(a, b, c)
    assert ((a | b) | (c | a)).parts == (a, b, c, a)
    assert ~~a == a


def test_repr_reads_like_the_expression():
    assert repr(Name("*.bias") | Ndim(lt=2)) == "Name('*.bias') | Ndim(lt=2)"
    assert repr((Name("a") | Name("b")) & ~Attr("x")) == "(Name('a') | Name('b')) & ~Attr('x')"
    assert repr(~(Ndim(eq=2) & Shape(2, 3))) == "~(Ndim(eq=2) & Shape(2, 3))"
    assert repr(Predicate(len, "len")) == "Predicate('len')"
    assert repr(Ndim(ge=1, le=3)) == "Ndim(le=3, ge=1)"


def test_matchers_are_frozen_values():
    assert Name("a", "b") == Name("a", "b") and Name("a") != Name("b") and Name("a") != Attr("a")
    assert len({Name("a"), Name("a"), Ndim(eq=1), Ndim(eq=1), Always(), Always()}) == 3
    with pytest.raises(AttributeError):
        Name("a").globs = ("b",)  # type: ignore[misc]
    m = Name("*.bias") | Ndim(lt=2) & ~Shape(3)
    assert pickle.loads(pickle.dumps(m)) == m
    assert isinstance(m, Matcher)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Name(), "one or more non-empty strings"),
        (lambda: Attr(""), "one or more non-empty strings"),
        (lambda: Ndim(), "at least one of eq"),
        (lambda: Ndim(eq=1.5), "must be an int"),
        (lambda: Shape(-1), "non-negative ints"),
        (lambda: Predicate(3, "x"), "needs a callable"),
        (lambda: NamedPredicate(len, ""), "non-empty label"),
        (lambda: Name("a") | "b", "both sides must be Matchers"),
        (lambda: Not("a"), "both sides must be Matchers"),
    ],
)
def test_bad_matchers_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# -- rules -------------------------------------------------------------------------------------------------
def test_rule_value_semantics_and_canonical_settings():
    r = Rule(Name("*.bias"), why="biases", wd_mult=0, betas=[0.9, [0.95]], algorithm="adamw")
    assert dict(r.settings) == {"algorithm": "adamw", "betas": (0.9, (0.95,)), "wd_mult": 0.0}
    assert isinstance(r.settings["wd_mult"], float) and list(r.settings) == ["algorithm", "betas", "wd_mult"]
    with pytest.raises(TypeError):
        r.settings["wd_mult"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        r.why = "x"  # type: ignore[misc]
    assert r.label == "biases" and Rule(Ndim(lt=2), wd_mult=0.0).label == "Ndim(lt=2)"
    assert r == Rule(Name("*.bias"), why="biases", algorithm="adamw", betas=(0.9, (0.95,)), wd_mult=0.0)
    assert hash(r) == hash(pickle.loads(pickle.dumps(r))) and pickle.loads(pickle.dumps(r)) == r
    assert repr(Rule(Name("*.bias"), wd_mult=0.0, why="b")) == "Rule(Name('*.bias'), wd_mult=0.0, why='b')"
    assert Rule(Always(), eps=1e-8, dtype=torch.bfloat16, flag=None).settings["dtype"] is torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"params": []}, "'params' is set by the group builder"),
        ({"param_names": ()}, "protected keys"),
        ({"is_expert_parallel": True}, "'is_expert_parallel'"),
        ({"default_config": False}, "'default_config'"),
        ({"lr": 0.1}, "set max_lr / min_lr"),
        ({"weight_decay": 0.1}, "set wd_mult"),
        ({"optimizer": "adam"}, "algorithm="),
        ({"max_lr": -1.0}, "max_lr must be a finite number >= 0, got -1.0"),
        ({"min_lr": math.inf}, "min_lr must be a finite number"),
        ({"lr_mult": math.nan}, "lr_mult must be a finite number"),
        ({"wd_mult": True}, "wd_mult must be a finite number"),
        ({"start_wd": "0.1"}, "start_wd must be a finite number"),
        ({"algorithm": ""}, "non-empty optimizer name"),
        ({"algorithm": torch.optim.AdamW}, "non-empty optimizer name"),
        ({"eps": math.nan}, "nan is not allowed"),
        ({"extra": {"a": 1}}, "has type dict"),
        ({"extra": torch.ones(1)}, "has type Tensor"),
    ],
)
def test_bad_rule_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rule(Always(), **kwargs)


def test_rule_needs_a_matcher():
    with pytest.raises(ValueError, match="needs a Matcher"):
        Rule("*.bias", wd_mult=0.0)  # type: ignore[arg-type]


# -- resolve -----------------------------------------------------------------------------------------------
def _model() -> list[tuple[str, nn.Parameter]]:
    return [
        ("embed.weight", P(10, 4, is_embedding_or_output_parameter=True)),
        ("layers.0.q_layernorm.weight", P(4)),
        ("layers.0.linear.weight", P(4, 4)),
        ("layers.0.linear.bias", P(4)),
        ("layers.0.norm.weight", P(4)),
        ("layers.0.experts.w", P(2, 4, 4, allreduce=False)),
        ("frozen.weight", P(4, 4, requires_grad=False)),
        ("output.weight", P(10, 4, is_embedding_or_output_parameter=True)),
    ]


def test_resolve_merges_all_matching_rules_and_records_sources():
    nd = Rule(Name("*.bias") | Ndim(lt=2), wd_mult=0.0, why="no decay")
    bias_too = Rule(Name("*.bias"), wd_mult=0.0, eps=1e-6, why="bias eps")
    matrices = Rule(Ndim(eq=2) & ~Attr("is_embedding_or_output_parameter"), algorithm="muon", why="muon")
    out = resolve(_model(), [nd, bias_too, matrices])
    assert "frozen.weight" not in out
    assert list(out) == [n for n, p in _model() if p.requires_grad]
    b = out["layers.0.linear.bias"]
    assert dict(b.settings) == {"eps": 1e-6, "wd_mult": 0.0}
    assert b.sources["wd_mult"] == (nd, bias_too) and b.sources["eps"] == (bias_too,)
    assert dict(out["layers.0.linear.weight"].settings) == {"algorithm": "muon"}
    assert dict(out["embed.weight"].settings) == {} and out["embed.weight"].shape == (10, 4)
    assert out["layers.0.experts.w"].is_expert and not out["embed.weight"].is_expert


def test_conflict_names_parameter_both_rules_and_both_values():
    a = Rule(Ndim(lt=2), wd_mult=0.0, why="vectors")
    b = Rule(Name("*.bias"), wd_mult=0.5, why="half-decay biases")
    with pytest.raises(ValueError) as e:
        resolve(_model(), [a, b])
    msg = str(e.value)
    for part in ("'layers.0.linear.bias'", "'vectors'", "'half-decay biases'", "wd_mult=0.0", "wd_mult=0.5"):
        assert part in msg
    c = Rule(Name("*.bias"), algorithm="sgd")  # no why: the label is the matcher's repr
    with pytest.raises(ValueError, match=r"Name\('\*\.bias'\)"):
        resolve(_model(), [Rule(Ndim(lt=2), algorithm="adamw"), c])


def test_strict_names_the_rule_that_matches_nothing():
    typo = Rule(Name("*.baes"), wd_mult=0.0, why="typo'd biases")
    assert resolve(_model(), [typo])["layers.0.linear.bias"].settings == {}
    with pytest.raises(ValueError, match="typo'd biases"):
        resolve(_model(), [typo], strict=True)
    only_frozen = Rule(Name("frozen.*"), wd_mult=0.0)
    with pytest.raises(ValueError, match=r"Name\('frozen\.\*'\)"):
        resolve(_model(), [only_frozen], strict=True)
    resolve(_model(), [Rule(Name("*.bias"), wd_mult=0.0)], strict=True)


def test_resolve_rejects_non_rules():
    with pytest.raises(ValueError, match="must be Rule objects"):
        resolve(_model(), [Name("*.bias")])  # type: ignore[list-item]


def test_named_parameters_of_module_chunks_pairs():
    torch.manual_seed(0)
    a, b = nn.Linear(2, 2), nn.Linear(2, 3)
    assert [n for n, _ in named_parameters_of(a)] == ["weight", "bias"]
    # Shared names across chunks: every name gets its chunk prefix.
    assert [n for n, _ in named_parameters_of([a, b])] == ["chunk0.weight", "chunk0.bias", "chunk1.weight",
                                                            "chunk1.bias"]
    # Unique names across chunks are kept as they are.
    c, d = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Identity(), nn.Linear(2, 2))
    assert [n for n, _ in named_parameters_of([c, d])] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    # A tied tensor is kept once, under its first name.
    w = P(2, 2)
    assert [n for n, _ in named_parameters_of([("emb", w), ("out", w), ("x", P(1))])] == ["emb", "x"]
    with pytest.raises(ValueError, match="two different tensors are named 'x'"):
        named_parameters_of([("x", P(1)), ("x", P(1))])
    assert [n for n, _ in named_parameters_of([P(1), P(2)])] == ["param.0", "param.1"]  # model.parameters()
    with pytest.raises(ValueError, match="nn.Module, a list of nn.Modules, "):
        named_parameters_of([("x", P(1)), P(1)])
    assert list(resolve([a, b], [Rule(Name("chunk1.*"), wd_mult=0.0)])["chunk1.bias"].settings) == ["wd_mult"]


# -- explain -----------------------------------------------------------------------------------------------
def test_explain_and_table():
    rules = standard_rules(decoupled_lr=0.01)
    ex = explain(_model(), rules)
    e = ex["layers.0.linear.bias"]
    assert dict(e.settings) == {"wd_mult": 0.0} and e.sources == {"wd_mult": (rules[0].label,)}
    assert e.shape == (4,) and not e.is_expert
    assert dict(ex["output.weight"].sources) == {"max_lr": ("decoupled LR for embedding and output",)}
    assert ex["layers.0.experts.w"].is_expert
    table = format_explain(ex)
    lines = table.splitlines()
    assert lines[0].split() == ["parameter", "shape", "expert", "settings", "set", "by"]
    assert len(lines) == 2 + len(ex) and "frozen.weight" not in table
    row = next(line for line in lines if line.startswith("output.weight"))
    assert "10x4" in row and "max_lr=0.01" in row and "max_lr <- decoupled LR" in row
    assert "yes" in next(line for line in lines if line.startswith("layers.0.experts.w"))
    with pytest.raises(ValueError, match="match no trainable parameter"):
        explain(_model(), [Rule(Name("nope"), eps=1.0)], strict=True)


# -- standard rules ----------------------------------------------------------------------------------------
def _settings(rules: list[Rule], params=None) -> dict[str, dict]:
    return {n: dict(r.settings) for n, r in resolve(params or _model(), rules).items()}


def test_standard_rules_no_decay_on_biases_and_vectors():
    s = _settings(standard_rules())
    assert s == {
        "embed.weight": {},
        "layers.0.q_layernorm.weight": {"wd_mult": 0.0},
        "layers.0.linear.weight": {},
        "layers.0.linear.bias": {"wd_mult": 0.0},
        "layers.0.norm.weight": {"wd_mult": 0.0},
        "layers.0.experts.w": {},
        "output.weight": {},
    }
    # A 2-D tensor named *.bias has no decay either; a 0-D scalar keeps it (Megatron: len(shape) == 1).
    extra = [("a.bias", P(2, 2)), ("scale", P())]
    assert _settings(standard_rules(), extra) == {"a.bias": {"wd_mult": 0.0}, "scale": {}}


def test_standard_rules_keep_decay_on_qk_layernorm_when_asked():
    params = _model() + [("layers.0.k_layernorm.bias", P(4)), ("layers.0.attn.linear_q.bias", P(4))]
    s = _settings(standard_rules(apply_wd_to_qk_layernorm=True), params)
    assert s["layers.0.q_layernorm.weight"] == {} and s["layers.0.k_layernorm.bias"] == {}
    assert s["layers.0.norm.weight"] == {"wd_mult": 0.0}
    assert s["layers.0.attn.linear_q.bias"] == {"wd_mult": 0.0}


def test_standard_rules_decoupled_lr_only_for_flagged_params():
    s = _settings(standard_rules(decoupled_lr=0.01))
    assert s["embed.weight"] == {"max_lr": 0.01} and s["output.weight"] == {"max_lr": 0.01}
    assert all("max_lr" not in v for k, v in s.items() if k not in ("embed.weight", "output.weight"))
    s = _settings(standard_rules(decoupled_lr=0.01, decoupled_min_lr=0.001))
    assert s["embed.weight"] == {"max_lr": 0.01, "min_lr": 0.001}
    # Megatron ignores decoupled_min_lr without decoupled_lr.
    assert len(standard_rules(decoupled_min_lr=0.001)) == 1
    with pytest.raises(ValueError, match="decoupled_lr must be a finite number >= 0"):
        standard_rules(decoupled_lr=-1.0)


# -- MuP ---------------------------------------------------------------------------------------------------
def _mup_model() -> list[tuple[str, nn.Parameter]]:
    return [
        ("embedding.word_embeddings.weight", P(10, 4, is_embedding_or_output_parameter=True)),
        ("wte.weight", P(10, 4, is_embedding_parameter=True)),
        ("tied.weight", P(10, 4, shared_embedding=True)),
        ("not_embedding.weight", P(4, 4, is_embedding_parameter=False)),  # the flag wins over the name
        ("layers.0.fc1.weight", P(8, 4)),
        ("layers.0.fc1.bias", P(8)),
        ("layers.0.experts.w", P(2, 4, 4)),
        ("output_layer.weight", P(10, 4, is_embedding_or_output_parameter=True)),
    ]


HIDDEN_2D = ["not_embedding.weight", "layers.0.fc1.weight"]
LR, MIN_LR, EPS, W = 0.02, 0.002, 1e-8, 4.0


def test_mup_width_one_and_bad_inputs():
    assert mup_rules(1.0, family="adam", lr=LR, min_lr=MIN_LR, eps=EPS) == []
    for bad in (0.0, -2.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="width_mult must be a finite number > 0"):
            mup_rules(bad, family="adam", lr=LR, min_lr=MIN_LR)
    with pytest.raises(ValueError, match="family must be one of"):
        mup_rules(2.0, family="rmsprop", lr=LR, min_lr=MIN_LR)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr must be a finite number"):
        mup_rules(2.0, family="adam", lr=-1.0, min_lr=MIN_LR)


@pytest.mark.parametrize("family", ["adam", "adamw"])
def test_mup_adam_scales_hidden_lr_and_eps(family):
    s = _settings(mup_rules(W, family=family, lr=LR, min_lr=MIN_LR, eps=EPS), _mup_model())
    hidden = {"max_lr": LR / W, "min_lr": MIN_LR / W, "eps": EPS / W}
    # Megatron: without decoupled_lr an (un-named) output matrix counts as hidden.
    for name in HIDDEN_2D + ["layers.0.experts.w", "output_layer.weight"]:
        assert s[name] == hidden, name
    for name in ("embedding.word_embeddings.weight", "wte.weight", "tied.weight", "layers.0.fc1.bias"):
        assert s[name] == {}, name


def test_mup_adam_with_decoupled_lr_leaves_embedding_output_lr_to_standard_rules():
    rules = standard_rules(decoupled_lr=0.05) + mup_rules(
        W, family="adam", lr=LR, min_lr=MIN_LR, eps=EPS, decoupled_lr=0.05
    )
    s = _settings(rules, _mup_model())  # no conflict
    assert s["output_layer.weight"] == {"max_lr": 0.05, "eps": EPS / W}  # eps still scales
    assert s["embedding.word_embeddings.weight"] == {"max_lr": 0.05}
    assert s["layers.0.fc1.weight"] == {"max_lr": LR / W, "min_lr": MIN_LR / W, "eps": EPS / W}
    assert s["layers.0.fc1.bias"] == {"wd_mult": 0.0}


def test_mup_without_eps_or_min_lr():
    s = _settings(mup_rules(W, family="adam", lr=LR, min_lr=None), _mup_model())
    assert s["layers.0.fc1.weight"] == {"max_lr": LR / W}


def test_mup_lion_scales_hidden_lr_only():
    s = _settings(mup_rules(W, family="lion", lr=LR, min_lr=MIN_LR, eps=EPS), _mup_model())  # no eps in Lion
    for name in HIDDEN_2D + ["output_layer.weight"]:
        assert s[name] == {"max_lr": LR / W, "min_lr": MIN_LR / W}
    assert s["layers.0.fc1.bias"] == {} and s["wte.weight"] == {}


def test_mup_sgd_scales_vector_like_lr_up():
    s = _settings(mup_rules(W, family="sgd", lr=LR, min_lr=MIN_LR, eps=EPS), _mup_model())  # eps ignored
    up = {"max_lr": LR * W, "min_lr": MIN_LR * W}
    for name in ("embedding.word_embeddings.weight", "wte.weight", "tied.weight", "layers.0.fc1.bias"):
        assert s[name] == up, name
    for name in HIDDEN_2D + ["layers.0.experts.w", "output_layer.weight"]:
        assert s[name] == {}, name
    s = _settings(mup_rules(W, family="sgd", lr=LR, min_lr=MIN_LR, decoupled_lr=0.05), _mup_model())
    assert s["embedding.word_embeddings.weight"] == {} and s["wte.weight"] == up


def test_mup_muon_leaves_muon_matrices_alone():
    rules = mup_rules(W, family="muon", lr=LR, min_lr=MIN_LR, eps=EPS)
    s = _settings(rules, _mup_model())
    for name in HIDDEN_2D + ["layers.0.experts.w"]:  # 3-D stacks of matrices (experts) are Muon's too
        assert s[name] == {}, name
    # Matrices Muon cannot take are stepped by the scalar Adam and get the Adam rules.
    hidden = {"max_lr": LR / W, "min_lr": MIN_LR / W, "eps": EPS / W}
    assert s["output_layer.weight"] == hidden
    assert s["layers.0.fc1.bias"] == {} and s["wte.weight"] == {}
    s = _settings(mup_rules(W, family="muon", lr=LR, min_lr=MIN_LR, decoupled_lr=0.05), _mup_model())
    assert s["output_layer.weight"] == {}
    assert s["layers.0.experts.w"] == {}


def test_muon_routing_rule():
    r = muon_routing_rule()
    assert r.why == "Muon needs hidden matrices (2-D, or 3-D stacks)" and dict(r.settings) == {"algorithm": "adamw"}
    s = _settings([r], _mup_model() + [("conv.weight", P(2, 2, 3, 3))])
    routed = {n for n, v in s.items() if v}  # the 3-D experts stay with Muon; 4-D goes to the scalar optimizer
    assert routed == {"embedding.word_embeddings.weight", "layers.0.fc1.bias", "output_layer.weight", "conv.weight"}
    assert muon_routing_rule("lion").settings["algorithm"] == "lion"


# -- property: conflicts are always detected ---------------------------------------------------------------
MATCHERS = [Name("*.bias"), Name("a.*"), Ndim(lt=2), Ndim(eq=2), Attr("flag"), Always(), ~Name("*.bias")]
VALUES = {"wd_mult": [0.0, 1.0], "max_lr": [1e-3, 2e-3], "algorithm": ["adamw", "sgd"], "eps": [1e-8]}

rule_strategy = st.builds(
    lambda m, kv: Rule(m, **dict(kv)),
    st.sampled_from(MATCHERS),
    st.lists(st.sampled_from([(k, v) for k, vs in VALUES.items() for v in vs]), min_size=1, max_size=2,
             unique_by=lambda kv: kv[0]),
)
param_strategy = st.tuples(
    st.sampled_from(["a.", "b.", "c.d."]), st.sampled_from(["weight", "bias"]), st.integers(0, 3),
    st.booleans(), st.booleans(),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(param_strategy, min_size=1, max_size=6), st.lists(rule_strategy, max_size=5))
def test_property_conflicts_always_detected(param_specs, rules):
    params = [
        (f"{prefix}{i}.{leaf}", P(*([2] * ndim), requires_grad=trainable, flag=flag))
        for i, (prefix, leaf, ndim, trainable, flag) in enumerate(param_specs)
    ]
    expected_conflict = False
    for name, p in params:
        if not p.requires_grad:
            continue
        seen: dict[str, object] = {}
        for r in rules:
            if r.matcher(p, name):
                for k, v in r.settings.items():
                    expected_conflict |= k in seen and seen[k] != v
                    seen[k] = v
    if expected_conflict:
        with pytest.raises(ValueError, match="conflicting rules for parameter"):
            resolve(params, rules)
    else:
        out = resolve(params, rules)
        assert set(out) == {n for n, p in params if p.requires_grad}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.mid = nn.Linear(3, 3)
        self.lm_head = nn.Linear(3, 4, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: named_parameters keeps 'embed.weight' only


def test_a_rule_naming_a_tied_alias_applies_to_the_shared_parameter():
    model = _Tied()
    resolved = resolve(model, [Rule(Name("lm_head.weight"), lr_mult=0.5)], strict=True)
    assert dict(resolved["embed.weight"].settings) == {"lr_mult": 0.5}
    assert "lm_head.weight" not in resolved and dict(resolved["mid.weight"].settings) == {}
    with pytest.raises(ValueError, match=r"conflicting rules for parameter 'embed.weight'.*lm_head.weight"):
        resolve(model, [Rule(Name("lm_head.weight"), lr_mult=0.5), Rule(Name("embed.weight"), lr_mult=2.0)])
    chunks = resolve([model, _Tied()], [Rule(Name("chunk1.lm_head.weight"), lr_mult=0.5)], strict=True)
    assert dict(chunks["chunk1.embed.weight"].settings) == {"lr_mult": 0.5}
    assert dict(chunks["chunk0.embed.weight"].settings) == {}
