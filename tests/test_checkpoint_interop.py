"""Plain torch.optim state dicts: a checkpoint exported loads into ``torch.optim.AdamW`` and trains on like
optstack; a torch state dict imports into an optstack optimizer of another precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from optstack.checkpoint import export_torch_state_dict, import_torch_state_dict, save_checkpoint
from optstack.config import OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():  # bf16-representable: the fp32 and bf16 stacks start at the same point
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.to(dtype)


def _build(model: nn.Module, precision: str = "fp32") -> BuiltOptimizer:
    return build_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, precision=precision, clip_grad=0.0), model)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 5, generator=gen), torch.randn(16, 2, generator=gen)


def _backward(model: nn.Module, step: int) -> None:
    x, y = _batch(step)
    ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean().backward()


def _trained(tmp_path: Path) -> tuple[nn.Module, BuiltOptimizer, Path]:
    model = _model()
    built = _build(model)
    for step in range(3):
        _backward(model, step)
        built.optimizer.step()
        built.optimizer.zero_grad()
    return model, built, save_checkpoint(tmp_path, built.optimizer, step=3)


def test_export_loads_into_torch_adamw_and_trains_on_alike(tmp_path: Path) -> None:
    model, built, path = _trained(tmp_path)
    names = [n for n, _ in model.named_parameters()]
    exported = export_torch_state_dict(path, names=names)
    groups = exported["param_groups"]
    assert [g["param_names"] for g in groups] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]
    assert [g["params"] for g in groups] == [[0, 1], [2, 3]]
    assert groups[1]["weight_decay"] == 0.0 and groups[0]["betas"] == (0.9, 0.999)
    assert exported["state"][0]["exp_avg"].shape == (8, 5) and float(exported["state"][0]["step"]) == 3.0

    twin = _model()
    twin.load_state_dict(model.state_dict())
    by_name = dict(twin.named_parameters())
    reference = torch.optim.AdamW([{"params": [by_name[n] for n in g["param_names"]]} for g in groups],
                                  foreach=False)
    reference.load_state_dict(exported)
    for step in range(3, 6):
        for m, opt in ((model, built.optimizer), (twin, reference)):
            _backward(m, step)
            opt.step()
            opt.zero_grad()
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=name)


def test_import_round_trip_into_mixed_precision(tmp_path: Path) -> None:
    model, built, path = _trained(tmp_path)
    exported = export_torch_state_dict(path)
    target_model = _model(torch.bfloat16)
    target = _build(target_model, "bf16")
    masters_before = {n: s.tensors["param"].clone() for n, s in target.optimizer.stages[0].param_shards().items()}
    import_torch_state_dict(exported, target.optimizer)
    ours = built.optimizer.stages[0].param_shards()
    for name, shard in target.optimizer.stages[0].param_shards().items():
        assert torch.equal(shard.tensors["exp_avg"], ours[name].tensors["exp_avg"]), name
        assert torch.equal(shard.tensors["exp_avg_sq"], ours[name].tensors["exp_avg_sq"]), name
        assert float(shard.scalars["step"]) == 3.0
        assert torch.equal(shard.tensors["param"], masters_before[name]), name  # masters kept
    assert [g["lr"] for g in target.optimizer.param_groups] == [g["lr"] for g in built.optimizer.param_groups]


def test_import_needs_names_and_the_same_parameters(tmp_path: Path) -> None:
    _, built, path = _trained(tmp_path)
    exported = export_torch_state_dict(path)
    unnamed = {**exported, "param_groups": [{k: v for k, v in g.items() if k != "param_names"}
                                             for g in exported["param_groups"]]}
    fresh = _build(_model())
    with pytest.raises(ValueError, match="no 'param_names'; pass names="):
        import_torch_state_dict(unnamed, fresh.optimizer)
    with pytest.raises(ValueError, match=r"only in the state dict: \['x.weight'\]"):
        import_torch_state_dict(unnamed, fresh.optimizer, names=["0.weight", "x.weight", "0.bias", "2.bias"])
    bad = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": exported["param_groups"]}
    with pytest.raises(ValueError, match=r"state 'exp_avg' of '0.weight' has shape \(3,\)"):
        import_torch_state_dict(bad, fresh.optimizer)
    assert not fresh.optimizer.stages[0].optimizer.state  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="names must list exactly"):
        export_torch_state_dict(path, names=["0.weight"])


def test_export_with_a_key_checks_the_signature_and_every_file(tmp_path: Path) -> None:
    model = _model()
    built = _build(model)
    _backward(model, 0)
    built.optimizer.step()
    plain = save_checkpoint(tmp_path / "plain", built.optimizer, step=1)
    signed = save_checkpoint(tmp_path / "signed", built.optimizer, step=1, key=b"secret")
    ref = export_torch_state_dict(plain)
    got = export_torch_state_dict(signed, key=b"secret")
    assert torch.equal(got["state"][0]["exp_avg"], ref["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="HMAC-SHA256"):
        export_torch_state_dict(signed, key=b"another key")
    with pytest.raises(ValueError, match="not signed"):
        export_torch_state_dict(plain, key=b"secret")
    data = next(p for p in sorted(signed.rglob("*.distcp")))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # a flip the CRC would catch too; with a key the SHA-256 is checked as well
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="fails its"):
        export_torch_state_dict(signed, key=b"secret")
