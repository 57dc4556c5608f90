"""QK-clip: the per-row factors against the head-by-head reference (multi-head and grouped-query), and
``ChainedOptimizer.clip_qk`` on the weights the optimizer holds (fp32, bf16 masters), published to the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer
from optstack.qk_clip import qk_clip_reference, qk_row_factors

HEADS, HEAD_DIM, KV_HEADS, IN = 4, 2, 2, 6
LOGITS = torch.tensor([50.0, 200.0, 90.0, 400.0])  # heads 1 and 3 past a threshold of 100


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(IN, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(IN, KV_HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM + KV_HEADS * HEAD_DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(torch.cat([self.q(x), self.k(x)], dim=-1)))


@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS, 1])
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_row_factors_equal_the_head_by_head_reference(kv_heads: int, alpha: float) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(HEADS * HEAD_DIM, IN, generator=g), torch.randn(kv_heads * HEAD_DIM, IN, generator=g)
    fq, fk = qk_row_factors(tuple(q.shape), tuple(k.shape), LOGITS, 100.0, alpha)
    rq, rk = q.clone(), k.clone()
    qk_clip_reference(rq, rk, LOGITS, 100.0, alpha)
    torch.testing.assert_close(q * fq[:, None], rq)
    torch.testing.assert_close(k * fk[:, None], rk)
    assert torch.equal(fq[:HEAD_DIM], torch.ones(HEAD_DIM))  # head 0 is under the threshold: untouched
    if kv_heads == HEADS and alpha == 0.5:  # q . k of a clipped head lands on the threshold
        assert torch.allclose(fq[2:4] * fk[2:4], torch.full((2,), 100.0 / 200.0))


@pytest.mark.parametrize(("algorithm", "precision"), [("adamw", "fp32"), ("normuon", "fp32"), ("muon", "bf16")])
def test_clip_qk_scales_the_optimizer_weights_and_publishes_them(algorithm: str, precision: str) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = Attention().to(dtype)
    built = build_optimizer(OptimizerConfig(algorithm=algorithm, lr=1e-2, precision=precision), model)
    opt = built.optimizer
    model(torch.randn(5, IN, dtype=dtype)).float().square().mean().backward()
    opt.step()
    held = {n: p for s in opt.stages for g in s.param_groups for n, p in zip(g["param_names"], g["params"],
                                                                              strict=True)}
    before = {n: (s.master_params[i] if precision == "bf16" else held[n]).detach().clone().view(held[n].shape)
              for s in opt.stages for i, n in enumerate(n for g in s.param_groups for n in g["param_names"])}
    assert opt.clip_qk({("q.weight", "k.weight"): LOGITS}, threshold=100.0) == 400.0
    want_q, want_k = before["q.weight"].clone(), before["k.weight"].clone()
    qk_clip_reference(want_q, want_k, LOGITS, 100.0)
    torch.testing.assert_close(model.q.weight.detach().float(), want_q.to(dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(model.k.weight.detach().float(), want_k.to(dtype).float(), rtol=0, atol=0)
    assert torch.equal(model.out.weight.detach().float(), before["out.weight"].to(dtype).float())
    # the next step starts from the clipped weights (they are the optimizer's, not only the model's)
    opt.zero_grad()
    model(torch.randn(5, IN, dtype=dtype)).float().square().mean().backward()
    opt.step()
    assert (model.q.weight.detach().float() - want_q.float()).abs().max() < 0.1


def test_bad_input_is_named() -> None:
    model = Attention()
    opt = build_optimizer(OptimizerConfig(), model).optimizer
    with pytest.raises(ValueError, match="no parameter named 'q.wieght'"):
        opt.clip_qk({("q.wieght", "k.weight"): LOGITS}, threshold=100.0)
    with pytest.raises(ValueError, match="3 heads .* must divide the rows"):
        opt.clip_qk({("q.weight", "k.weight"): LOGITS[:3]}, threshold=100.0)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        opt.clip_qk({("q.weight", "k.weight"): LOGITS}, threshold=0.0)
