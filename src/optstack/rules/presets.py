"""The stock rule sets, with Megatron Core's semantics: standard (no-decay, decoupled LR), MuP, Muon routing.

Plain ``Rule`` values: print, extend or filter them like any user rule list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from optstack.rules.matchers import Attr, Matcher, Name, NamedPredicate, Ndim
from optstack.rules.resolve import Rule, is_number, nonnegative

__all__ = [
    "standard_rules", "mup_rules", "muon_routing_rule", "MupFamily",
    "EMBEDDING", "EMBEDDING_OR_OUTPUT", "VECTOR_LIKE", "MUON_MANAGED",
]

EMBEDDING_OR_OUTPUT = Attr("is_embedding_or_output_parameter")


def _check_lrs(**values: float | None) -> None:
    for field, value in values.items():
        if value is not None:
            nonnegative(field, value)


def standard_rules(
    *,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    apply_wd_to_qk_layernorm: bool = False,
) -> list[Rule]:
    """Megatron's standard overrides: no weight decay on biases and 1-D parameters; decoupled embedding LR.

    Args:
        decoupled_lr: when set, parameters flagged ``is_embedding_or_output_parameter`` get ``max_lr`` = this.
        decoupled_min_lr: their ``min_lr``; only used when ``decoupled_lr`` is set (as in Megatron).
        apply_wd_to_qk_layernorm: keep weight decay on q/k layer-norm parameters (names containing
            ``q_layernorm.`` or ``k_layernorm.``), as Qwen3-Next does.
    """
    _check_lrs(decoupled_lr=decoupled_lr, decoupled_min_lr=decoupled_min_lr)
    no_wd: Matcher = Name("*.bias") | Ndim(eq=1)
    why = "no weight decay on biases and 1-D params"
    if apply_wd_to_qk_layernorm:
        no_wd = no_wd & ~Name("*q_layernorm.*", "*k_layernorm.*")
        why += " (except q/k layer norms)"
    rules = [Rule(no_wd, wd_mult=0.0, why=why)]
    if decoupled_lr is not None:
        rules.append(Rule(EMBEDDING_OR_OUTPUT, why="decoupled LR for embedding and output",
                          **_lrs(decoupled_lr, decoupled_min_lr)))
    return rules


def _lrs(max_lr: float, min_lr: float | None) -> dict[str, float]:
    return {"max_lr": max_lr} if min_lr is None else {"max_lr": max_lr, "min_lr": min_lr}


def _is_embedding(param: torch.Tensor, name: str) -> bool:
    # Megatron's MuP test: explicit flags first, then a conservative name check for unflagged modules.
    if getattr(param, "shared_embedding", False):
        return True
    if hasattr(param, "is_embedding_parameter"):
        return bool(param.is_embedding_parameter)
    return "embedding" in name.lower()


EMBEDDING = NamedPredicate(_is_embedding, "embedding")
#: MuP's vector-like class: 0/1-D parameters and embeddings (their fan-in does not grow with width).
VECTOR_LIKE = Ndim(le=1) | EMBEDDING
#: Muon's matrices: 2-D, or 3-D stacks of matrices (grouped experts, per-head blocks); not embedding/output.
MUON_MANAGED = Ndim(ge=2, le=3) & ~EMBEDDING_OR_OUTPUT

MupFamily = Literal["adam", "adamw", "sgd", "muon", "lion"]


def mup_rules(
    width_mult: float,
    *,
    family: MupFamily,
    lr: float,
    min_lr: float | None,
    eps: float | None = None,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
) -> list[Rule]:
    """MuP learning-rate (and Adam epsilon) scaling by parameter class, with Megatron Core's semantics.

    With ``w = width_mult`` (hidden size / base hidden size); "hidden" = ndim >= 2 and not an embedding
    (``shared_embedding`` / ``is_embedding_parameter`` attribute, else "embedding" in the name):

    - ``adam`` / ``adamw``: hidden params get ``max_lr = lr / w``, ``min_lr = min_lr / w`` and, when ``eps``
      is given, ``eps = eps / w``; vector-like params (ndim <= 1) and embeddings keep the base values. As in
      Megatron, an un-embedding output matrix counts as hidden.
    - ``lion``: Adam's LR rule (its sign update has Adam's per-entry scale); no epsilon, ``eps`` is ignored.
    - ``sgd``: vector-like params (ndim <= 1 and embeddings) get ``lr * w``; ``eps`` is ignored (as in Megatron).
    - ``muon``: 2-D and 3-D non-embedding/output matrices are Muon's and get nothing (Muon scales its own update);
      every other hidden param is stepped by the scalar Adam and gets the Adam rules (Megatron applies no
      eps override for Muon, so its face passes ``eps=None``).

    With ``decoupled_lr`` set, parameters flagged ``is_embedding_or_output_parameter`` are left out of every
    LR rule (they keep ``standard_rules``' decoupled LR, without conflict); the eps rule still applies to the
    hidden ones. Only whether ``decoupled_lr`` is set matters here (``decoupled_min_lr`` is only checked).

    Returns:
        ``[]`` when ``w == 1``, else the rules.

    Raises:
        ValueError: ``width_mult`` <= 0 or non-finite, an unknown family, or a bad LR/eps.
    """
    if not is_number(width_mult) or width_mult <= 0:
        raise ValueError(f"width_mult must be a finite number > 0 (hidden / base width), got {width_mult!r}")
    if family not in ("adam", "adamw", "sgd", "muon", "lion"):
        raise ValueError(f"family must be one of 'adam', 'adamw', 'sgd', 'muon', 'lion'; got {family!r}")
    nonnegative("lr", lr)
    _check_lrs(min_lr=min_lr, eps=eps, decoupled_lr=decoupled_lr, decoupled_min_lr=decoupled_min_lr)
    if width_mult == 1:
        return []
    w = float(width_mult)
    keeps_decoupled, tag = decoupled_lr is not None, f"MuP w={w:g}"

    def lrs(op: Callable[[float], float]) -> dict[str, float]:
        return _lrs(op(lr), None if min_lr is None else op(min_lr))

    if family == "sgd":
        vectors: Matcher = VECTOR_LIKE & ~EMBEDDING_OR_OUTPUT if keeps_decoupled else VECTOR_LIKE
        return [Rule(vectors, why=f"{tag}: SGD vector-like lr*w", **lrs(lambda x: x * w))]

    hidden: Matcher = ~VECTOR_LIKE
    if family == "muon":
        hidden = hidden & ~MUON_MANAGED
    lr_hidden = hidden & ~EMBEDDING_OR_OUTPUT if keeps_decoupled else hidden
    rules = [Rule(lr_hidden, why=f"{tag}: hidden lr/w", **lrs(lambda x: x / w))]
    if eps is not None and family != "lion":
        rules.append(Rule(hidden, eps=eps / w, why=f"{tag}: Adam eps/w"))
    return rules


def muon_routing_rule(scalar_algorithm: str = "adamw") -> Rule:
    """Send what Muon cannot take (vectors, 4-D and higher tensors, embedding/output) to ``scalar_algorithm``.

    2-D matrices and 3-D stacks ``(batch, rows, cols)`` (grouped experts, per-head blocks) stay with Muon, which
    orthogonalises each matrix of a stack on its own. A 3-D tensor that is not a stack of matrices (a Conv1d
    kernel ``(out, in, width)``) needs a rule of its own, e.g. ``Rule(Name("*.conv1d.weight"), algorithm="adamw")``.
    """
    not_for_muon = Ndim(lt=2) | Ndim(gt=3) | EMBEDDING_OR_OUTPUT
    return Rule(not_for_muon, algorithm=scalar_algorithm, why="Muon needs hidden matrices (2-D, or 3-D stacks)")
