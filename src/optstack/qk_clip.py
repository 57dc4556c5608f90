"""QK-clip (Kimi K2's MuonClip; Megatron's ``qk_clip.py``): keep attention logits bounded by rescaling the query
and key weights of the heads whose largest pre-softmax logit went past a threshold.

Per head ``h`` with ``S_h`` the largest logit ``q . k`` seen in the step's forward (over the batch and, under data
parallelism, over the ranks: the caller reduces it with ``all_reduce(MAX)`` as Megatron does), and
``gamma_h = min(1, threshold / S_h)``::

    W_q[rows of head h] *= gamma_h ** alpha
    W_k[rows of head h] *= gamma_h ** (1 - alpha)          # alpha = 0.5: sqrt each, so q . k scales by gamma_h

so the next step's logits of head ``h`` are at most ``threshold`` for the same inputs. Grouped-query attention
(fewer key heads than query heads): a key head shared by several query heads takes the smallest of their factors.
This module computes the per-row factors (pure functions); ``ChainedOptimizer.clip_qk`` applies them after the
step to the weights the optimizer holds, on any placement without a gather (a rank scales the elements it holds
by their rows' factors, ``Placement.element_rows``), and publishes them as a step does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["qk_clip_reference", "qk_row_factors"]


def qk_row_factors(q_shape: tuple[int, ...], k_shape: tuple[int, ...], max_logits: Tensor, threshold: float,
                   alpha: float = 0.5) -> tuple[Tensor, Tensor]:
    """The per-row factors ``(q_rows,)``, ``(k_rows,)`` (fp32, on ``max_logits``' device) of one attention's query
    and key weights (``(heads * head_dim, in)``, ``(kv_heads * head_dim, in)``) for ``max_logits`` of shape
    ``(heads,)``.

    Raises:
        ValueError: a threshold <= 0, alpha outside [0, 1], or shapes the heads do not divide.
    """
    if not threshold > 0:
        raise ValueError(f"qk_clip: threshold must be > 0, got {threshold!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"qk_clip: alpha must be in [0, 1], got {alpha!r}")
    heads = max_logits.numel()
    if heads == 0 or len(q_shape) != 2 or len(k_shape) != 2 or q_shape[0] % heads:
        raise ValueError(f"qk_clip: {heads} heads (max_logits' length) must divide the rows of a 2-D query weight, "
                         f"got shape {tuple(q_shape)}")
    head_dim = q_shape[0] // heads
    kv_heads = k_shape[0] // head_dim if head_dim and k_shape[0] % head_dim == 0 else 0
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"qk_clip: the key weight's rows ({k_shape[0]}) must be a number of heads of {head_dim} "
                         f"rows dividing the {heads} query heads, got key shape {tuple(k_shape)}")
    gamma = (threshold / max_logits.detach().float()).clamp(max=1.0)
    q = gamma.pow(alpha).repeat_interleave(head_dim)
    k = gamma.pow(1 - alpha).view(kv_heads, heads // kv_heads).amin(dim=1).repeat_interleave(head_dim)
    return q, k


def qk_clip_reference(q_weight: Tensor, k_weight: Tensor, max_logits: Tensor, threshold: float,
                      alpha: float = 0.5) -> None:
    """QK-clip on whole weights, in place, head by head (the test oracle)."""
    heads = max_logits.numel()
    head_dim = q_weight.size(0) // heads
    groups = heads // (k_weight.size(0) // head_dim)
    with torch.no_grad():
        for h in range(heads):
            gamma = min(1.0, threshold / float(max_logits[h]))
            q_weight[h * head_dim : (h + 1) * head_dim] *= gamma**alpha
        for g in range(k_weight.size(0) // head_dim):
            gammas = [min(1.0, threshold / float(max_logits[h])) for h in range(g * groups, (g + 1) * groups)]
            k_weight[g * head_dim : (g + 1) * head_dim] *= min(gammas) ** (1 - alpha)


def row_factors_of(max_logits: Mapping[tuple[str, str], Tensor], shapes: Mapping[str, tuple[int, ...]],
                   threshold: float, alpha: float) -> dict[str, Tensor]:
    """``{parameter name: per-row factor}`` for ``{(query name, key name): max_logits}``; a name not in
    ``shapes`` (the model's parameters) is an error naming it."""
    out: dict[str, Tensor] = {}
    for (q_name, k_name), logits in max_logits.items():
        for name in (q_name, k_name):
            if name not in shapes:
                raise ValueError(f"qk_clip: no parameter named {name!r} in this optimizer; pass (query weight name, "
                                 "key weight name) pairs of its parameters, e.g. ('layers.0.attn.q.weight', "
                                 "'layers.0.attn.k.weight')")
            if name in out:
                raise ValueError(f"qk_clip: parameter {name!r} is in two pairs")
        out[q_name], out[k_name] = qk_row_factors(shapes[q_name], shapes[k_name], logits, threshold, alpha)
    return out
