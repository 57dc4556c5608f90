"""Many small tensors are packed into a few DCP items (``checkpoint/pack.py``) and read back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optim_harness import shard_numbers
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from optstack.checkpoint import load_checkpoint, pack, save_checkpoint
from optstack.checkpoint.format import FORMAT, migrate, unseal
from optstack.checkpoint.load import Saved, read_manifest, read_model, read_ranges
from optstack.checkpoint.storage import Chunk
from optstack.config import OptimizerConfig
from optstack.factory import BuiltOptimizer, build_optimizer


class _Experts(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.experts = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(n)])
        self.big = nn.Parameter(torch.randn(200, 100))  # 80 KB: an item of its own


def _stack(seed: int, n: int = 300) -> tuple[nn.Module, BuiltOptimizer]:
    torch.manual_seed(seed)
    model = _Experts(n)
    built = build_optimizer(OptimizerConfig(lr=1e-2), model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    built.optimizer.step()
    return model, built


def _numbers(model: nn.Module, built: BuiltOptimizer) -> dict[str, torch.Tensor]:
    return shard_numbers(built.optimizer, model, scalars=False)


@pytest.mark.parametrize("segment_bytes", [pack.SEGMENT_BYTES, 1000])
def test_small_tensors_are_packed_and_load_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   segment_bytes: int) -> None:
    monkeypatch.setattr(pack, "SEGMENT_BYTES", segment_bytes)
    model, built = _stack(seed=0)
    path = save_checkpoint(tmp_path, built.optimizer, step=1, model=model)
    manifest = unseal((path / "manifest.json").read_text(), "manifest")
    segments = Saved(path, manifest).part(0)["packs"]  # rank 0's part of the manifest
    packed = {key for _, items in segments for key, _, _ in items}
    assert len(packed) == 300 * 3 + 300  # every expert's param, exp_avg, exp_avg_sq and model tensor; not 'big'
    assert "optim/big/param" not in packed and "model/big" not in packed
    stored = set(FileSystemReader(path / "rank_00000").read_metadata().state_dict_metadata)
    assert stored == {f"pack/{i}" for i in range(len(segments))} | {"optim/big/param", "optim/big/exp_avg",
                                                                    "optim/big/exp_avg_sq", "model/big"}
    if segment_bytes == 1000:
        assert len(segments) > 10
    fresh_model, fresh = _stack(seed=1)
    load_checkpoint(tmp_path, fresh.optimizer, model=fresh_model)
    want, got = _numbers(model, built), _numbers(fresh_model, fresh)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # Parts of packed ranges, as a load at another data-parallel size reads them.
    directory, manifest = read_manifest(tmp_path)
    parts = read_ranges(directory, manifest, {"experts.7": (1, 3), "big": (5, 9)})
    assert torch.equal(parts["experts.7"]["exp_avg"], want["experts.7.exp_avg"][1:3])
    assert torch.equal(parts["big"]["param"], want["big.param"][5:9])
    assert torch.equal(read_model(directory, manifest, ["experts.299"])["experts.299"], want["model.experts.299"])


def test_few_small_tensors_stay_items_of_their_own(tmp_path: Path) -> None:
    model, built = _stack(seed=0, n=10)
    path = save_checkpoint(tmp_path, built.optimizer, step=1)
    assert Saved(path, unseal((path / "manifest.json").read_text(), "manifest")).part(0)["packs"] == []
    assert "optim/experts.3/exp_avg" in FileSystemReader(path / "rank_00000").read_metadata().state_dict_metadata


@pytest.mark.parametrize("packs", [{"0": "x"}, {"0": [["float32", [["k", -1, 3]]]]}, {"0": [[["float32"], []]]},
                                   {"0": [["complex32", []]]}])
def test_damaged_packs_are_refused(tmp_path: Path, packs: dict) -> None:
    with pytest.raises(ValueError, match="packs of rank 0|unknown dtype"):
        pack.read_packed(tmp_path, packs, {0: [Chunk("k", torch.empty(3), 0, 3)]})


def test_version_1_manifests_migrate_to_no_packs() -> None:
    assert migrate({"format": FORMAT, "version": 1, "params": {}})["packs"] == {}
