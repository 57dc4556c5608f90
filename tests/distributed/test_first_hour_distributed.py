"""Habits of a new user that used to hang or pass silently in a world of processes (issue 30): a checkpoint
saved on rank 0 only (item 7), flags set on parameters before FSDP2's ``fully_shard`` (item 9)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer
from optstack.checkpoint import save_checkpoint
from optstack.distributed.comm import world_comm

# -- 7: save_checkpoint on rank 0 only -----------------------------------------------------------------------

ARRIVAL_S = 2.0


def _save_on_rank_0_only(root: str) -> str:
    import optstack.checkpoint.save as save

    save.ARRIVAL_TIMEOUT_S = ARRIVAL_S  # the world's collectives time out after 30 s; the check must come first
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = build_optimizer(OptimizerConfig(), model).optimizer
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    comm = world_comm("checkpoint")
    if comm.rank == 0:  # the single-file habit
        save_checkpoint(root, opt, step=1, comm=comm)
    return "ok"


def _ready() -> None:
    world_comm("ready").barrier()


def test_save_on_rank_0_only_is_a_prompt_error_naming_the_fix(world2, tmp_path: Path) -> None:
    world2.run(_ready)  # the world is up: what is timed below is the save alone
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)failed on ranks \[0\].*rank 0 waited 2 s for the other 1 "
                                             r"rank\(s\).*call save_checkpoint\(\.\.\.\) on every rank, not under "
                                             r"`if rank == 0:`"):
        world2.run(_save_on_rank_0_only, str(tmp_path))  # the world is rebuilt afterwards (a collective is left)
    assert time.monotonic() - start < 20.0  # not the group's 30 s timeout (nor gloo's default 30 minutes)
    assert not (tmp_path / "step_00000001").exists()


def _save_with_rank_0_late(root: str) -> list[str]:
    import optstack.checkpoint.save as save

    save.ARRIVAL_TIMEOUT_S = ARRIVAL_S
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = build_optimizer(OptimizerConfig(), model).optimizer
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    comm = world_comm("checkpoint")
    if comm.rank == 0:
        time.sleep(2 * ARRIVAL_S)  # rank 0 logging or evaluating alone: the others wait for it as long as it takes
    return sorted(p.name for p in Path(save_checkpoint(root, opt, step=1, comm=comm)).parent.iterdir())


def test_a_late_rank_0_is_waited_for(world2, tmp_path: Path) -> None:
    assert world2.run(_save_with_rank_0_late, str(tmp_path)) == [["latest", "step_00000001"]] * 2
