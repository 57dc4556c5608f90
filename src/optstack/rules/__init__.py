"""Which settings each parameter gets: matchers, rules, their merge, ``explain``, and the stock rule sets.

A ``Matcher`` tests a tensor and its ``named_parameters`` name and composes with ``&``, ``|``, ``~``; a
``Rule`` is a matcher, the settings it applies and a reason. ``resolve`` merges every rule matching a
parameter (two different values for one key raise); ``explain`` shows the result and who decided it::

    rules = [Rule(Name("*.bias") | Ndim(lt=2), wd_mult=0.0, why="biases and norms"),
             Rule(~Ndim(eq=2) | Attr("is_embedding_or_output_parameter"), algorithm="adamw")]
    print(format_explain(explain(model, rules)))

Modules: ``matchers``, ``resolve`` (Rule, resolve, explain), ``presets`` (standard, MuP, Muon routing).
Grouping the result is ``optstack.groups``.
"""

from optstack.rules.matchers import (
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
    Shape,
    uses_name,
)
from optstack.rules.presets import (
    EMBEDDING,
    EMBEDDING_OR_OUTPUT,
    MUON_MANAGED,
    VECTOR_LIKE,
    MupFamily,
    muon_routing_rule,
    mup_rules,
    standard_rules,
)
from optstack.rules.resolve import (
    LR_KEYS,
    PROTECTED_KEYS,
    Explanation,
    Resolved,
    Rule,
    check_names_available,
    explain,
    format_explain,
    named_parameters_of,
    resolve,
)

__all__ = [
    "Matcher", "Name", "Attr", "Ndim", "Shape", "Predicate", "NamedPredicate", "Always", "Never", "And", "Or", "Not",
    "Rule", "Resolved", "Explanation", "resolve", "explain", "format_explain", "named_parameters_of", "LR_KEYS",
    "PROTECTED_KEYS", "standard_rules", "mup_rules", "muon_routing_rule", "MupFamily", "EMBEDDING",
    "EMBEDDING_OR_OUTPUT", "VECTOR_LIKE", "MUON_MANAGED", "uses_name", "check_names_available",
]
