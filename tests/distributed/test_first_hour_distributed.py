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


# -- 9: flags set before fully_shard ---------------------------------------------------------------------------


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.emb(x))))


def _sharded_lm(flag_before: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _LM()
    if flag_before:  # the Megatron habit
        model.emb.weight.is_embedding_or_output_parameter = True
        model.head.weight.is_embedding_or_output_parameter = True
    mesh = init_device_mesh("cpu", (world_comm().size,))
    for layer in (model.emb, model.hidden, model.head):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _algorithms(built) -> dict[str, str]:
    return {n: g.get("algorithm", "muon") for g in built.param_groups for n in g["param_names"]}


def _flags_and_fully_shard() -> dict[str, object]:
    from optstack import default_rules
    from optstack.rules import Name, Rule

    config = OptimizerConfig(algorithm="muon", lr=1e-2)
    out: dict[str, object] = {}
    try:
        build_optimizer(config, _sharded_lm(flag_before=True))
    except ValueError as error:
        out["error"] = str(error)
    model = _sharded_lm(flag_before=False)  # flags set on the sharded parameters are kept
    model.emb.weight.is_embedding_or_output_parameter = True
    model.head.weight.is_embedding_or_output_parameter = True
    out["flagged after"] = _algorithms(build_optimizer(config, model))
    rules = default_rules(config) + [Rule(Name("emb.weight", "head.weight"), algorithm="adamw")]
    by_name = build_optimizer(config, _sharded_lm(flag_before=True), rules=rules)
    out["by name"] = _algorithms(by_name)
    model = _sharded_lm(flag_before=False)
    opt = build_optimizer(config, model, rules=rules).optimizer  # and it trains
    model(torch.randint(0, 32, (4, 5))).sum().backward()
    opt.step()
    out["applied"] = opt.last_result.applied
    try:
        build_optimizer(OptimizerConfig(lr=1e-2, decoupled_lr=1e-3), _sharded_lm(flag_before=True))
    except ValueError as error:
        out["decoupled error"] = str(error)
    return out


def test_flags_set_before_fully_shard_are_not_silently_lost(world2) -> None:
    for out in world2.run(_flags_and_fully_shard):
        assert "'emb.weight' is an nn.Embedding's weight, and it would go to Muon" in out["error"]
        assert "fully_shard replaces every parameter" in out["error"]
        assert "model.emb.weight.is_embedding_or_output_parameter = True" in out["error"]
        expected = {"emb.weight": "adamw", "head.weight": "adamw", "head.bias": "adamw", "hidden.weight": "muon",
                    "hidden.bias": "adamw"}
        assert out["flagged after"] == expected and out["by name"] == expected
        assert out["applied"]
        assert "decoupled_lr=0.001 applies to the parameters flagged is_embedding_or_output_parameter" in \
            out["decoupled error"] and "fully_shard replaces every parameter" in out["decoupled error"]
