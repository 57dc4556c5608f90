"""A hostile file at two ranks: every rank ends in the same clear error within seconds (issue 27: a
self-nested tuple in one rank's .metadata hung that rank, and the other timed out)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

from optstack.checkpoint import load_checkpoint, save_checkpoint
from optstack.checkpoint.format import MANIFEST, seal
from optstack.checkpoint.io import file_checksum

_spec = importlib.util.spec_from_file_location("_reshard_cases", Path(__file__).with_name("test_checkpoint_reshard.py"))
reshard = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = reshard
_spec.loader.exec_module(reshard)
_hostile = importlib.util.spec_from_file_location("_hostile", Path(__file__).parents[1] / "test_checkpoint_hostile.py")
hostile = importlib.util.module_from_spec(_hostile)
sys.modules[_hostile.name] = hostile
_hostile.loader.exec_module(hostile)


def save(root: str) -> None:
    case = reshard.CASES["zero1-adamw-bf16"]
    model, wrapped, built = reshard._stack(case, "zero1", seed=0)
    reshard._train(wrapped, built, range(2))
    save_checkpoint(Path(root), built.optimizer, step=2, scheduler=built.scheduler, model=model)


def load(root: str) -> tuple[str, float]:
    case = reshard.CASES["zero1-adamw-bf16"]
    model, wrapped, built = reshard._stack(case, "zero1", seed=7)
    start = time.perf_counter()
    try:
        load_checkpoint(Path(root), built.optimizer, scheduler=built.scheduler, model=model)
    except ValueError as exc:
        return str(exc), time.perf_counter() - start
    return "loaded", time.perf_counter() - start


def test_a_tuple_bomb_in_one_ranks_metadata_is_every_ranks_error(world2, tmp_path: Path) -> None:
    world2.run(save, str(tmp_path))
    checkpoint = tmp_path / "step_00000002"
    (checkpoint / "rank_00001" / ".metadata").write_bytes(hostile.tuple_key_bomb())
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest.pop("seal")
    for name in manifest["files"]:
        manifest["files"][name] |= file_checksum(checkpoint / name)
    (checkpoint / MANIFEST).write_text(seal(manifest))
    results = world2.run(load, str(tmp_path), timeout_s=60)
    for message, seconds in results:
        assert "rank_00001/.metadata holds a dict key holding a tuple" in message, message
        assert seconds < hostile.SECONDS
    assert results[0][0] == results[1][0]  # the same error on both ranks
