"""The demo GPT: shapes, causality, parameter names and flags the rules rely on, generation."""

from __future__ import annotations

import pytest
import torch

from optstack.demo.gpt import GPT, GPTConfig, build_demo_model, generate

TINY = dict(n_layer=2, n_head=2, d_model=16, seq_len=12)


def test_forward_shapes_and_causality() -> None:
    torch.manual_seed(0)
    model = build_demo_model(**TINY)
    idx = torch.randint(0, 256, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    # positions before the change see the same prefix, so their logits are unchanged
    assert torch.allclose(model(changed)[:, :7], logits[:, :7], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 7:], logits[:, 7:])
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 13, dtype=torch.long))


def test_names_and_embedding_flags() -> None:
    model = build_demo_model(**TINY, qk_layernorm=True)
    names = dict(model.named_parameters())
    assert "blocks.0.attn.qkv.weight" in names and names["blocks.0.attn.qkv.weight"].shape == (48, 16)
    assert "blocks.1.attn.q_layernorm.weight" in names and "blocks.1.attn.k_layernorm.bias" in names
    flagged = {n for n, p in names.items() if getattr(p, "is_embedding_or_output_parameter", False)}
    assert flagged == {"tok_emb.weight", "pos_emb.weight", "head.weight"}
    assert "head.bias" not in names  # untied head without bias
    assert names["head.weight"].data_ptr() != names["tok_emb.weight"].data_ptr()
    assert "blocks.0.attn.q_layernorm.weight" not in dict(build_demo_model(**TINY).named_parameters())


def test_default_size_and_bad_sizes() -> None:
    n = sum(p.numel() for p in GPT(GPTConfig()).parameters())
    assert 1_000_000 < n < 3_000_000
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=10, n_head=3)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="unknown model size"):
        build_demo_model(width=3)


def test_generate_is_seeded() -> None:
    torch.manual_seed(0)
    model = build_demo_model(**TINY)
    prompt = torch.tensor([100, 101, 102])
    a = generate(model, prompt, 20, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 20, generator=torch.Generator().manual_seed(1))
    assert a.shape == (23,) and torch.equal(a, b) and torch.equal(a[:3], prompt)
    assert model.training  # generation restores the mode


def test_fp32_compute_gives_bf16_params_the_rounded_fp32_gradients() -> None:
    torch.manual_seed(0)
    stored = build_demo_model(**TINY, compute_dtype="fp32").bfloat16()  # bf16 weights, fp32 arithmetic
    reference = build_demo_model(**TINY)  # fp32 weights holding exactly the bf16 values
    reference.load_state_dict({k: v.float() for k, v in stored.state_dict().items()})
    idx = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    logits = stored(idx)
    assert logits.dtype == torch.float32 and torch.equal(logits, reference(idx))
    logits.square().mean().backward()
    reference(idx).square().mean().backward()
    for (name, p), q in zip(stored.named_parameters(), reference.parameters(), strict=True):
        assert p.dtype == p.grad.dtype == torch.bfloat16, name  # the optimizer sees bf16 params and grads
        assert torch.equal(p.grad, q.grad.bfloat16()), name
    # the default computes in the parameters' dtype
    assert build_demo_model(**TINY).bfloat16()(idx).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model.compute_dtype must be 'param' or 'fp32'"):
        GPTConfig(compute_dtype="fp16")
