"""The built-in small GPT that ``optstack train`` and ``optstack groups`` use.

A plain decoder-only transformer over bytes (vocab 256): token + learned position embedding, pre-LayerNorm
blocks (fused ``attn.qkv`` projection, causal ``scaled_dot_product_attention``, GELU MLP), a final LayerNorm
and an untied output head. Parameter names follow the Megatron conventions the rules look for
(``*.bias``, ``q_layernorm.`` / ``k_layernorm.``), and the embedding and output weights carry the model's own
``is_embedding_or_output_parameter`` flag, so the standard and MuP rules treat them as such.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "build_demo_model", "generate"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Size of the demo GPT (the defaults: ~1.9M parameters, ~13k tokens/s training on 2 CPU cores).

    Attributes:
        vocab_size: number of token ids (256 for bytes).
        n_layer: transformer blocks.
        n_head: attention heads; must divide ``d_model``.
        d_model: residual width.
        seq_len: longest context (size of the position embedding).
        qk_layernorm: LayerNorm on each head's queries and keys (``q_layernorm`` / ``k_layernorm``).
        compute_dtype: 'param': forward and backward run in the parameters' dtype; 'fp32': the weights are
            upcast to fp32 inside ``forward`` (the parameters stay as stored, e.g. bf16, and autograd hands
            them gradients in their own dtype), so bf16 optimizer settings can be compared on a CPU without
            fast bf16 matmuls: the optimizer sees exactly the bf16 parameters and gradients, only the
            model's arithmetic is more precise than a bf16 GPU run's.
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 6
    d_model: int = 192
    seq_len: int = 128
    qk_layernorm: bool = False
    compute_dtype: Literal["param", "fp32"] = "param"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.compute_dtype not in ("param", "fp32"):
            raise ValueError(f"model.compute_dtype must be 'param' or 'fp32', got {self.compute_dtype!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )


class Attention(nn.Module):
    """Causal multi-head self-attention with one fused q/k/v projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # Per-head norms, as in Megatron's qk_layernorm: they stabilise attention logits at high lr.
        self.q_layernorm = nn.LayerNorm(self.head_dim) if cfg.qk_layernorm else nn.Identity()
        self.k_layernorm = nn.LayerNorm(self.head_dim) if cfg.qk_layernorm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, self.head_dim).transpose(1, 3).unbind(2)
        q, k = self.q_layernorm(q), self.k_layernorm(k)  # (b, n_head, t, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small byte-level GPT.

    Args:
        cfg: the model size.

    ``forward(idx)`` takes token ids of shape (batch, t) with t <= ``cfg.seq_len`` (int64) and returns logits
    of shape (batch, t, vocab_size) in the parameters' dtype (fp32 with ``compute_dtype='fp32'``).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # The model's own flag (Megatron's convention), read by the standard (decoupled lr) and MuP rules.
        for p in (self.tok_emb.weight, self.pos_emb.weight, self.head.weight):
            p.is_embedding_or_output_parameter = True
        # MuP tells embeddings (vector-like: lr not scaled by width) from the output matrix (hidden) by this.
        for p in (self.tok_emb.weight, self.pos_emb.weight):
            p.is_embedding_parameter = True
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02); residual projections scaled by depth so the residual stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim >= 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self._run(self.tok_emb, idx) + self._run(self.pos_emb, pos)
        for block in self.blocks:
            x = self._run(block, x)
        return self._run(self.head, self._run(self.ln_f, x))

    def _run(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``; with ``compute_dtype='fp32'``, on fp32 copies of its low-precision weights (the
        casts are differentiable: each parameter's gradient comes back in its own dtype, once per step)."""
        if self.cfg.compute_dtype == "param":
            return module(x)
        upcast = {n: p.float() for n, p in module.named_parameters() if p.dtype != torch.float32}
        return torch.func.functional_call(module, upcast, (x,), strict=False) if upcast else module(x)

    def size(self) -> dict[str, int | bool]:
        """The size arguments that rebuild this model with ``build_demo_model(**size)``."""
        return asdict(self.cfg)


def build_demo_model(**size: int | bool) -> GPT:
    """Build the demo GPT; keyword arguments are ``GPTConfig`` fields (unknown names are an error).

    This is the factory behind ``--model optstack.demo.gpt:build_demo_model``.
    """
    allowed = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(size) - allowed)
    if unknown:
        raise ValueError(f"unknown model size argument(s) {unknown}; allowed: {sorted(allowed)}")
    return GPT(GPTConfig(**size))  # type: ignore[arg-type]


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample a continuation of ``prompt`` (int64 ids, shape (t,)); returns prompt + new ids, shape (t+n,)."""
    was_training = model.training
    model.eval()
    ids = prompt.clone()
    for _ in range(max_new_tokens):
        # Sampling on the CPU: the generator is a CPU generator whatever the model's device.
        logits = model(ids[-model.cfg.seq_len :].unsqueeze(0))[0, -1].float().cpu() / max(temperature, 1e-6)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt.to(ids.device)])
    model.train(was_training)
    return ids
