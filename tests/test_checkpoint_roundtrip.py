"""Single-process checkpoints: save at step k, load into a fresh stack, continue bit for bit; the layout on
disk (manifest, group map, ``latest``, keep-last-K); lazy state; the version and its migration."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from optstack.checkpoint import CheckpointInfo, load_checkpoint, migrate, save_checkpoint, write_group_map
from optstack.checkpoint.format import FORMAT, VERSION, seal, unseal
from optstack.checkpoint.load import Saved
from optstack.config import LossScaleConfig, OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer
from optstack.schedule import LRSchedule

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    return model.to(dtype)


def _build(model: nn.Module, precision: str, *, lr: float = 1e-2, algorithm: str = "adamw") -> BuiltOptimizer:
    scaler = LossScaleConfig(mode="dynamic", initial=2.0**14, window=2) if precision != "fp32" else LossScaleConfig()
    config = OptimizerConfig(algorithm=algorithm, lr=lr, precision=precision, loss_scale=scaler, clip_grad=1.0)
    # Warmup of 20 steps: every checkpoint below is taken mid-warmup, so the lr changes every step.
    schedule = LRSchedule(init_lr=lr / 10, max_lr=lr, warmup_steps=20, decay_steps=100, style="cosine")
    return build_optimizer(config, model, lr_schedule=schedule)


def _train(model: nn.Module, built: BuiltOptimizer, steps: range) -> list[float]:
    scales = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
        dtype = next(model.parameters()).dtype
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        built.optimizer.scale_loss(loss).backward()
        built.optimizer.step()
        scales.append(built.optimizer.last_result.loss_scale)
        built.optimizer.zero_grad()
        assert built.scheduler is not None
        built.scheduler.step()
    return scales


def _snapshot(model: nn.Module, built: BuiltOptimizer) -> dict:
    buffer = io.BytesIO()  # a deep copy of everything, step tensors included
    assert built.scheduler is not None
    torch.save({"model": model.state_dict(), "optimizer": built.optimizer.state_dict(),
                "scheduler": built.scheduler.state_dict(),
                "lr": [g["lr"] for g in built.optimizer.param_groups]}, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def assert_same(a: object, b: object, where: str = "") -> None:
    """Bitwise equality of nested state (tensors: dtype and every bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_is_bitwise_identical(tmp_path: Path, precision: str) -> None:
    dtype = DTYPES[precision]
    model = _model(dtype)
    built = _build(model, precision)
    _train(model, built, range(4))
    save_checkpoint(tmp_path, built.optimizer, step=4, scheduler=built.scheduler, model=model)
    scales = _train(model, built, range(4, 9))
    expected = _snapshot(model, built)

    fresh_model = _model(dtype, seed=1)  # different weights: everything must come from the checkpoint
    fresh = _build(fresh_model, precision)
    info = load_checkpoint(tmp_path, fresh.optimizer, scheduler=fresh.scheduler, model=fresh_model)
    assert info == CheckpointInfo(tmp_path / "step_00000004", 4, VERSION, 1)
    assert _train(fresh_model, fresh, range(4, 9)) == scales
    assert_same(_snapshot(fresh_model, fresh), expected)
    if precision != "fp32":
        assert len(set(scales)) > 1  # the dynamic scaler really moved


def test_load_into_a_trained_optimizer_replaces_everything(tmp_path: Path) -> None:
    model = _model(torch.bfloat16)
    built = _build(model, "bf16")
    _train(model, built, range(3))
    save_checkpoint(tmp_path, built.optimizer, step=3, scheduler=built.scheduler, model=model)
    expected = _snapshot(model, built)
    other_model = _model(torch.bfloat16, seed=2)
    other = _build(other_model, "bf16")
    _train(other_model, other, range(10, 17))  # more steps, other data: its state differs everywhere
    load_checkpoint(tmp_path, other.optimizer, scheduler=other.scheduler, model=other_model)
    assert_same(_snapshot(other_model, other), expected)


def test_load_without_model_publishes_the_masters(tmp_path: Path) -> None:
    """Without ``model=`` the bf16 parameters still come from the checkpoint: its fp32 masters, rounded."""
    model = _model(torch.bfloat16)
    built = _build(model, "bf16")
    _train(model, built, range(3))
    save_checkpoint(tmp_path, built.optimizer, step=3)
    masters = {n: s.tensors["param"].clone() for n, s in built.optimizer.stages[0].param_shards().items()}
    fresh_model = _model(torch.bfloat16, seed=4)
    fresh = _build(fresh_model, "bf16")
    named = dict(fresh_model.named_parameters())
    assert masters.keys() == named.keys()
    assert not any(torch.equal(p, masters[n].view(p.shape).bfloat16()) for n, p in named.items())
    load_checkpoint(tmp_path, fresh.optimizer)
    for name, param in named.items():
        assert torch.equal(param, masters[name].view(param.shape).bfloat16()), name
    assert torch.equal(torch.cat([p.detach().flatten() for p in named.values()]),
                       torch.cat([p.detach().flatten() for p in model.parameters()]))


def test_lazy_state_before_the_first_step(tmp_path: Path) -> None:
    """A checkpoint taken before any step has no moments; loading it into a trained optimizer drops them,
    and loading a later checkpoint into a fresh optimizer creates them."""
    model = _model(torch.float32)
    built = _build(model, "fp32")
    save_checkpoint(tmp_path / "a", built.optimizer, step=0, scheduler=built.scheduler, model=model)
    manifest = json.loads((tmp_path / "a" / "step_00000000" / "manifest.json").read_text())
    saved = Saved(tmp_path / "a" / "step_00000000", manifest)  # dtypes: in the writers' parts
    assert all(set(saved.state(n, 0, 1)["dtypes"]) == {"param"} for n in manifest["params"])
    _train(model, built, range(2))
    save_checkpoint(tmp_path / "b", built.optimizer, step=2, scheduler=built.scheduler, model=model)

    load_checkpoint(tmp_path / "a", built.optimizer, scheduler=built.scheduler, model=model)
    assert all(not s for stage in built.optimizer.stages for s in stage.optimizer.state.values())  # type: ignore[attr-defined]
    fresh_model = _model(torch.float32, seed=3)
    fresh = _build(fresh_model, "fp32")
    load_checkpoint(tmp_path / "b", fresh.optimizer, scheduler=fresh.scheduler, model=fresh_model)
    state = fresh.optimizer.stages[0].optimizer.state  # type: ignore[attr-defined]
    assert len(state) == 4 and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in state.values())
    assert all(float(s["step"]) == 2.0 for s in state.values())


def test_layout_latest_group_map_and_keep_last(tmp_path: Path) -> None:
    model = _model(torch.float32)
    built = _build(model, "fp32")
    for step in (1, 2, 3, 4):
        _train(model, built, range(step - 1, step))
        path = save_checkpoint(tmp_path, built.optimizer, step=step, keep_last=2)
        assert path == tmp_path / f"step_{step:08d}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    ckpt = tmp_path / "step_00000004"
    assert {p.name for p in ckpt.iterdir()} == {"manifest.json", "group_map.json", "rank_00000"}
    group_map = json.loads((ckpt / "group_map.json").read_text())
    assert group_map["param_to_group"] == {"0.weight": 0, "2.weight": 0, "0.bias": 1, "2.bias": 1}
    assert [g["wd_mult"] for g in group_map["groups"]] == [1.0, 0.0]  # biases: no weight decay
    assert group_map["groups"][0]["algorithm"] == "AdamW"
    assert write_group_map(tmp_path / "map.json", built.optimizer) == group_map
    assert json.loads((tmp_path / "map.json").read_text()) == group_map
    with pytest.raises(ValueError, match="already exists"):
        save_checkpoint(tmp_path, built.optimizer, step=4)
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, built.optimizer, step=5, keep_last=0)


def test_manifest_is_name_keyed_and_sealed(tmp_path: Path) -> None:
    model = _model(torch.bfloat16)
    built = _build(model, "bf16")
    _train(model, built, range(2))
    path = save_checkpoint(tmp_path, built.optimizer, step=2, scheduler=built.scheduler)
    manifest = unseal((path / "manifest.json").read_text(), "manifest")
    assert manifest["format"] == FORMAT and manifest["version"] == VERSION
    weight = manifest["params"]["0.weight"]
    assert weight["shape"] == [10, 6] and weight["chunks"] == [[0, 0, 60]]
    state = Saved(path, manifest).state("0.weight", 0, 60)  # its writer's part of the manifest
    assert state["dtypes"] == {"param": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"}
    assert state["scalars"] == {"step": {"tensor": "float32", "value": 2.0}}
    assert manifest["scaler"]["kind"] == "dynamic" and manifest["scheduler"]["num_steps"] == 2
    assert manifest["model"] is None


def test_migrate_and_seal() -> None:
    current = {"format": FORMAT, "version": VERSION, "params": {}}
    assert migrate(dict(current)) == current
    with pytest.raises(ValueError, match="newer optstack"):
        migrate({**current, "version": VERSION + 1})
    with pytest.raises(ValueError, match="not an optstack checkpoint"):
        migrate({"format": "other", "version": 1})
    with pytest.raises(ValueError, match="version must be an int"):
        migrate({"format": FORMAT, "version": "1"})
    text = seal(current)
    assert unseal(text, "m") == current
    with pytest.raises(ValueError, match="fails its checksum"):
        unseal(text.replace('"params"', '"paramz"'), "m")
    with pytest.raises(ValueError, match="not valid JSON"):
        unseal(text[:-5], "m")


def _as_version_2(checkpoint: Path) -> None:
    """Rewrite a checkpoint as version 2 wrote it: every parameter's dtypes and scalars and every rank's packs
    in the manifest, no parts."""
    manifest = unseal((checkpoint / "manifest.json").read_text(), "manifest")
    saved = Saved(checkpoint, manifest)
    for name, entry in manifest["params"].items():
        entry |= saved.state(name, 0, 1)
    parts = [name for name in manifest["files"] if name.endswith("/state.json")]
    ranks = [int(name.split("/")[0].removeprefix("rank_")) for name in parts]
    manifest["packs"] = {str(rank): saved.part(rank)["packs"] for rank in ranks}
    for name in parts:
        (checkpoint / name).unlink()
        del manifest["files"][name]
    manifest["version"] = 2
    (checkpoint / "manifest.json").write_text(seal(manifest))


def test_version_2_checkpoints_still_load(tmp_path: Path) -> None:
    """A version-2 checkpoint (dtypes, scalars and packs in the manifest) loads as the same state in version 3."""
    model = _model(torch.bfloat16)
    built = _build(model, "bf16")
    _train(model, built, range(2))
    save_checkpoint(tmp_path / "v3", built.optimizer, step=2, scheduler=built.scheduler, model=model)
    path = save_checkpoint(tmp_path / "v2", built.optimizer, step=2, scheduler=built.scheduler, model=model)
    _as_version_2(path)
    assert json.loads((path / "manifest.json").read_text())["version"] == 2
    snapshots = []
    for version in ("v3", "v2"):
        fresh_model = _model(torch.bfloat16, seed=3)
        fresh = _build(fresh_model, "bf16")
        info = load_checkpoint(tmp_path / version, fresh.optimizer, scheduler=fresh.scheduler, model=fresh_model)
        assert info.version == VERSION  # migrated
        snapshots.append(_snapshot(fresh_model, fresh))
    assert_same(snapshots[1], snapshots[0])


def test_an_empty_parameter_round_trips(tmp_path: Path) -> None:
    """A parameter of no elements has no data, but a writer of its state entry (its dtypes and step)."""
    def build(seed: int) -> tuple[nn.Module, BuiltOptimizer]:
        model = _model(torch.float32, seed)
        model.register_parameter("empty", nn.Parameter(torch.zeros(0, 3)))
        return model, _build(model, "fp32")

    model, built = build(0)
    _train(model, built, range(2))
    save_checkpoint(tmp_path, built.optimizer, step=2, scheduler=built.scheduler, model=model)
    fresh_model, fresh = build(3)
    load_checkpoint(tmp_path, fresh.optimizer, scheduler=fresh.scheduler, model=fresh_model)
    assert_same(_snapshot(fresh_model, fresh)["model"], _snapshot(model, built)["model"])
