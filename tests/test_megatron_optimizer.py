"""optstack.megatron.get_megatron_optimizer: Megatron's interface (3-tuple step, loss scale tensor)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from optstack.megatron import (
    OptimizerConfig,
    OptimizerParamScheduler,
    ParamKey,
    get_canonical_lr_for_logging,
    get_megatron_optimizer,
    get_param_groups,
)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.output_layer = nn.Linear(8, 11, bias=False)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.output_layer.weight.is_embedding_or_output_parameter = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.norm(torch.relu(self.fc(self.embedding(tokens)))))


def tiny(dtype: torch.dtype = torch.float32) -> Tiny:
    torch.manual_seed(0)
    return Tiny().to(dtype)


TOKENS = torch.arange(24).remainder(11).reshape(4, 6)


def loss_of(model: nn.Module) -> torch.Tensor:
    logits = model(TOKENS).float()
    return nn.functional.cross_entropy(logits.reshape(-1, 11), TOKENS.roll(1, dims=1).reshape(-1))


def train(opt, model: nn.Module, steps: int) -> list[tuple]:
    results = []
    for _ in range(steps):
        opt.zero_grad()
        opt.scale_loss(loss_of(model)).backward()
        results.append(opt.step())
    return results


def named_groups(opt) -> list[tuple[list[str], dict]]:
    """(parameter names, group) for each of the face's groups: Megatron's group dicts carry no names, the
    core's groups (in the same order) do."""
    return [(core["param_names"], g) for g, core in zip(opt.param_groups, opt.built.optimizer.param_groups,
                                                        strict=True)]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_step_is_megatrons_tuple_and_matches_torch_adamw() -> None:
    model, ref_model = tiny(), tiny()
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, decoupled_lr=3e-2)
    opt = get_megatron_optimizer(cfg, [model])
    ref_groups = [{**g, "lr": g["max_lr"], "weight_decay": 0.1 * g["wd_mult"]}
                  for g in get_param_groups([ref_model], cfg, None)]
    ref = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, fused=True)
    for result in train(opt, model, 5):
        ref.zero_grad()
        loss_of(ref_model).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref_model.parameters()]))
        ref.step()
        assert isinstance(result, tuple) and len(result) == 3
        update_successful, grad_norm, num_zeros = result
        assert update_successful is True and num_zeros is None
        assert grad_norm == pytest.approx(norm.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(ref_model.named_parameters())[name], rtol=1e-6, atol=1e-7)


def test_skips_return_megatrons_values() -> None:
    model = tiny()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, log_num_zeros_in_grad=True), model)
    opt.zero_grad()
    loss_of(model).backward()
    model.fc.weight.grad[0, 0] = float("inf")
    before = params_of(model)
    assert opt.step() == (False, None, None)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    skipping = get_megatron_optimizer(OptimizerConfig(lr=1e-2, grad_norm_skip_threshold=1e-6), model)
    skipping.zero_grad()
    loss_of(model).backward()
    applied, norm, zeros = skipping.step()
    assert applied is False and norm > 1e-6 and zeros is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_num_zeros_in_grad() -> None:
    model = tiny()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, log_num_zeros_in_grad=True), model)
    opt.zero_grad()
    loss_of(model).backward()
    model.fc.weight.grad[:3] = 0.0
    expected = sum(int((p.grad == 0).sum()) for p in model.parameters())
    applied, _, zeros = opt.step()
    assert applied and zeros == expected and expected >= 24


def test_loss_scale_is_a_tensor() -> None:
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), tiny())
    scale = opt.get_loss_scale()
    assert scale.shape == (1,) and scale.dtype == torch.float32 and scale.item() == 1.0
    loss = torch.tensor(2.5)
    assert opt.scale_loss(loss).shape == (1,) and opt.scale_loss(loss).item() == 2.5

    bf16 = tiny(torch.bfloat16)
    opt16 = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, loss_scale=8.0), bf16)
    assert opt16.get_loss_scale().tolist() == [8.0]
    assert opt16.scale_loss(torch.tensor(0.5)).item() == 4.0
    applied, norm, _ = train(opt16, bf16, 1)[0]
    assert applied and norm > 0  # the reported norm is of the unscaled gradients


def test_fp16_dynamic_scaling() -> None:
    model = tiny(torch.float16)
    cfg = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    opt = get_megatron_optimizer(cfg, model)
    assert opt.get_loss_scale().item() == 1024.0
    assert train(opt, model, 1)[0][0] is True
    opt.zero_grad()
    opt.scale_loss(loss_of(model)).backward()
    model.fc.bias.grad[0] = float("nan")
    assert opt.step() == (False, None, None)
    assert opt.get_loss_scale().item() == 512.0  # backoff 0.5 once hysteresis is used up


def test_scheduler_drives_the_groups() -> None:
    model = tiny()
    cfg = OptimizerConfig(lr=1e-2, min_lr=1e-3, decoupled_lr=5e-2, weight_decay=0.1)
    opt = get_megatron_optimizer(cfg, model)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="constant")
    sched.step(1)
    by_name = {n: g for names, g in named_groups(opt) for n in names}
    assert by_name["fc.weight"]["lr"] == pytest.approx(5e-3)
    assert by_name["embedding.weight"]["lr"] == pytest.approx(2.5e-2)  # warmup to the decoupled max_lr
    assert by_name["fc.bias"]["weight_decay"] == 0.0 and by_name["fc.weight"]["weight_decay"] == 0.1
    assert get_canonical_lr_for_logging(opt.param_groups) == pytest.approx(5e-3)
    train(opt, model, 1)


def test_state_dict_round_trip() -> None:
    model = tiny()
    cfg = OptimizerConfig(lr=1e-2)
    opt = get_megatron_optimizer(cfg, model)
    train(opt, model, 3)
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    train(opt, model, 2)
    resumed = tiny()
    resumed.load_state_dict(saved_model)
    opt2 = get_megatron_optimizer(cfg, resumed)
    opt2.load_state_dict(saved_opt)
    train(opt2, resumed, 2)
    for name, p in resumed.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name]), name


def test_dump_param_group_map(tmp_path) -> None:
    path = tmp_path / "sub" / "map.json"
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), tiny(), dump_param_to_param_group_map=str(path))
    mapping = json.loads(path.read_text())
    assert sorted(mapping) == sorted(n for n, _ in tiny().named_parameters())
    for name, index in mapping.items():
        assert name in named_groups(opt)[index][0]
    assert mapping["fc.bias"] != mapping["fc.weight"]


def test_experts_and_muon_get_their_own_optimizers() -> None:
    model = tiny()
    model.fc.weight.allreduce = False
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), model)
    assert len(opt.built.optimizer.stages) == 2
    assert [g["is_expert_parallel"] for names, g in named_groups(opt) if "fc.weight" in names] == [True]

    muon_model = tiny()
    overrides: dict = {ParamKey(name="*.bias"): {"wd_mult": 0.0}}
    muon = get_megatron_optimizer(OptimizerConfig(lr=2e-2, optimizer="muon"), muon_model, overrides)
    assert overrides == {ParamKey(name="*.bias"): {"wd_mult": 0.0}}  # not modified (Megatron mutates it)
    algorithms = {n: g.get("algorithm", "muon") for names, g in named_groups(muon) for n in names}
    assert algorithms["fc.weight"] == "muon"
    assert {algorithms[n] for n in ("fc.bias", "norm.weight", "embedding.weight", "output_layer.weight")} == {
        "adamw"}
    assert all(r[0] for r in train(muon, muon_model, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(pg_collection=object()), "pg_collection"),
        (dict(config_overrides={ParamKey(name="*"): {"optimizer": "sgd"}}), "should not be overridden"),
    ],
)
def test_bad_input(kwargs: dict, match: str) -> None:
    args = dict(config=OptimizerConfig(lr=1e-3), model_chunks=[tiny()])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        get_megatron_optimizer(**args)  # type: ignore[arg-type]


def test_lr_none_builds_and_the_scheduler_must_set_it() -> None:
    # Megatron builds with OptimizerConfig(lr=None); its scheduler sets every group's lr before the first step.
    model = tiny()
    opt = get_megatron_optimizer(OptimizerConfig(), [model])
    assert all(g["lr"] is None for g in opt.param_groups)
    loss_of(model).backward()
    with pytest.raises(ValueError, match="lr is None"):
        opt.step()
    OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                            lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=10,
                            wd_incr_style="constant").step(1)
    before = params_of(model)
    assert opt.step()[0] is True
    assert not torch.equal(before["fc.weight"], model.fc.weight)


def test_works_inside_a_one_rank_process_group(tmp_path) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = tiny()
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model],
                                     dump_param_to_param_group_map=str(tmp_path / "map.json"))
        assert all(r[0] for r in train(opt, model, 2))
        assert len(get_param_groups([model], OptimizerConfig(lr=1e-2), None)) == 2
    finally:
        dist.destroy_process_group()


def test_overrides_match_the_chunks_own_names_and_groups_use_the_core_names() -> None:
    from optstack.distributed.parallel import ParallelGroups
    from optstack.megatron import DistributedDataParallel, DistributedDataParallelConfig

    model = DistributedDataParallel(None, DistributedDataParallelConfig(), tiny(),
                                    pg_collection=ParallelGroups.single())
    overrides = {ParamKey(name="module.fc.*"): {"lr_mult": 0.5}}  # Megatron's name for a wrapped chunk
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model], overrides)
    slow = [g["param_names"] for g in opt.built.param_groups if g["lr_mult"] == 0.5]
    assert slow == [["fc.weight", "fc.bias"]]  # the names the factory and checkpoints use
    assert [g["param_names"] for g in get_param_groups([model], OptimizerConfig(lr=1e-2), overrides)
            if g["lr_mult"] == 0.5] == slow
    assert all(r[0] for r in train(opt, model, 2))


def test_offload_optimizer_states_frees_the_state_after_each_step_and_changes_no_number() -> None:
    def run(offload: bool) -> tuple[nn.Module, object]:
        model = tiny(torch.bfloat16)
        cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=True, offload_optimizer_states=offload)
        opt = get_megatron_optimizer(cfg, [model])
        for _ in range(3):
            opt.zero_grad()
            opt.scale_loss(loss_of(model)).backward()
            opt.step()
            held = [t for o in opt.chained_optimizers for s in o.optimizer.state.values()
                    for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
            held += [t for o in opt.chained_optimizers for g in o.optimizer.param_groups for t in g["params"]]
            assert held and all((t.untyped_storage().nbytes() == 0) == offload for t in held)
        return model, opt

    model, opt = run(True)
    ref, _ = run(False)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    opt.reload_states()  # by hand too: the masters are back, equal to the parameters' values
    masters = [t for o in opt.chained_optimizers for g in o.optimizer.param_groups for t in g["params"]]
    assert all(t.untyped_storage().nbytes() > 0 for t in masters)
    assert opt.offload_states() > 0


def test_uint8_moments_are_8bit_block_quantized_and_track_fp32_moments() -> None:
    def run(dtype: torch.dtype) -> nn.Module:
        model = tiny(torch.bfloat16)
        cfg = OptimizerConfig(lr=1e-2, bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype=dtype,
                              exp_avg_sq_dtype=dtype)
        opt = get_megatron_optimizer(cfg, [model])
        train(opt, model, 3)
        if dtype == torch.uint8:
            keys = {k for o in opt.chained_optimizers for s in o.optimizer.state.values() for k in s}
            assert "exp_avg_codes" in keys and "exp_avg" not in keys
        return model

    eight, ref, start = run(torch.uint8), run(torch.float32), tiny(torch.bfloat16)
    for (name, p), q, p0 in zip(eight.named_parameters(), ref.parameters(), start.parameters(), strict=True):
        moved = (q.float() - p0.float()).norm()
        assert (p.float() - q.float()).norm() <= 0.1 * moved + 1e-2, name
