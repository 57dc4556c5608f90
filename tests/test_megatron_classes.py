"""Megatron's optimizer classes in optstack.megatron, used as Megatron code uses them (one process)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from optstack.distributed.parallel import ParallelGroups
from optstack.megatron import (
    ChainedOptimizer,
    ConstantGradScaler,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    HybridDeviceOptimizer,
    MegatronOptimizer,
    OptimizerConfig,
    ProcessGroupCollection,
    TensorParallelMuon,
    _get_param_groups,
    get_megatron_muon_optimizer,
    get_megatron_optimizer,
    param_group_identifier_keys,
)


def mlp(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


X = torch.linspace(-1, 1, 30).reshape(5, 6)


def backward(model: nn.Module, scale: float = 1.0) -> None:
    (model(X.to(next(model.parameters()).dtype)).float().pow(2).sum() * scale).backward()


def test_chained_torch_optimizers_share_groups_and_state() -> None:
    model = mlp()
    params = list(model.parameters())
    adam = torch.optim.Adam(params[:2], lr=0.01)
    sgd = torch.optim.SGD(params[2:], lr=0.1, momentum=0.9)
    chained = ChainedOptimizer([adam, sgd])
    assert chained.chained_optimizers == [adam, sgd]
    chained.param_groups[0]["lr"] = 0.02  # the groups are the torch optimizers' own dicts
    assert adam.param_groups[0]["lr"] == 0.02
    assert len(chained.state) == 0 and chained.get_parameters() == params

    ref_model = mlp()
    ref_params = list(ref_model.parameters())
    ref = [torch.optim.Adam(ref_params[:2], lr=0.02), torch.optim.SGD(ref_params[2:], lr=0.1, momentum=0.9)]
    for _ in range(3):
        chained.zero_grad()
        backward(model, 10.0)  # large gradients: the chain of plain torch optimizers does not clip
        assert chained.step()[0] is True
        for o in ref:
            o.zero_grad()
        backward(ref_model, 10.0)
        for o in ref:
            o.step()
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q)
    assert len(chained.state) == 4 and set(chained.state[(1, params[2])]) == {"momentum_buffer"}
    key = next(iter(chained.state))
    chained.state[key] = {"marker": 1}  # writes reach the torch optimizer's state
    assert adam.state[key[1]] == {"marker": 1}


def test_chained_megatron_optimizers_clip_one_global_norm() -> None:
    config = OptimizerConfig(lr=0.1, clip_grad=0.5, weight_decay=0.0)
    model, whole = mlp(), mlp()
    params, whole_params = list(model.parameters()), list(whole.parameters())
    chained = ChainedOptimizer([FP32Optimizer(torch.optim.SGD(params[:2], lr=0.1), config),
                                FP32Optimizer(torch.optim.SGD(params[2:], lr=0.1), config)])
    alone = FP32Optimizer(torch.optim.SGD(whole_params, lr=0.1), config)
    for opt, m in ((chained, model), (alone, whole)):
        opt.zero_grad()
        backward(m)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in whole_params])).item()
    applied, norm, zeros = chained.step()
    assert applied is True and zeros is None and norm == pytest.approx(expected, rel=1e-6) and norm > 0.5
    assert alone.step()[1] == pytest.approx(norm, rel=1e-6)
    for p, q in zip(params, whole_params, strict=True):
        torch.testing.assert_close(p, q)


def test_fp32_optimizer_skips_non_finite_and_counts_zeros() -> None:
    model = mlp()
    opt = FP32Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                        OptimizerConfig(lr=1e-2, log_num_zeros_in_grad=True))
    assert opt.get_loss_scale().tolist() == [1.0] and opt.optimizer.param_groups[0]["params"][0] is model[0].weight
    backward(model)
    model[0].bias.grad[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.step() == (False, None, None)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    opt.zero_grad()
    backward(model)
    model[2].weight.grad[0] = 0.0
    applied, _, zeros = opt.step()
    assert applied and zeros == sum(int((p.grad == 0).sum()) for p in model.parameters()) >= 8


def test_float16_optimizer_steps_fp32_masters_and_reloads_them() -> None:
    model, ref = mlp(torch.bfloat16), mlp()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = Float16OptimizerWithFloat16Params(torch_opt, OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.0),
                                            ConstantGradScaler(4.0), None)
    masters = opt.get_parameters()
    assert all(m.dtype == torch.float32 for m in masters) and opt.optimizer is torch_opt
    assert all(m is not p for m, p in zip(masters, model.parameters(), strict=True))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            p.copy_(q.float())
    for _ in range(2):
        opt.zero_grad()
        opt.scale_loss(model(X.bfloat16()).float().pow(2).sum()).backward()
        assert opt.step()[0] is True
        ref_opt.zero_grad()
        backward(ref)
        ref_opt.step()
    for m, q in zip(masters, ref.parameters(), strict=True):
        torch.testing.assert_close(m, q, rtol=0.05, atol=0.02)  # bf16 forward/backward vs fp32
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    opt.reload_model_params()
    assert all(torch.equal(m, torch.full_like(m, 2.0)) for m in masters)
    with pytest.raises(ValueError, match="matched by parameter name"):
        opt.reload_model_params({"0.weight": torch.zeros(8, 6)})

    # Built by get_megatron_optimizer, the masters reload from a state dict too (Megatron's distributed one).
    built = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [model])
    built.reload_model_params({n: torch.full_like(p, 3.0, dtype=torch.float32) for n, p in model.named_parameters()})
    assert all(torch.equal(m, torch.full_like(m, 3.0)) for m in built.get_parameters())
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())


def test_get_megatron_optimizer_returns_megatrons_classes() -> None:
    fp32 = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [mlp()])
    assert isinstance(fp32, ChainedOptimizer)
    assert [type(o) for o in fp32.chained_optimizers] == [FP32Optimizer]
    assert all("param_names" not in g for g in fp32.param_groups)  # Megatron's group dicts
    expert = mlp()
    expert[0].weight.allreduce = False
    chained = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [expert])
    assert len(chained.chained_optimizers) == 2
    backward(expert)
    chained.step()
    for member in chained.chained_optimizers:  # each member's state dict holds its own part only
        own = member.state_dict()
        assert len(own["param_groups"]) == len(member.param_groups)
        assert len(own["state"]) == len(member.get_parameters())

    # bf16 parameters with bf16=False: Megatron builds it; optstack steps fp32 masters of them.
    model = mlp(torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    assert [type(o) for o in opt.chained_optimizers] == [Float16OptimizerWithFloat16Params]
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    backward(model)
    before = model[0].weight.detach().clone()
    assert opt.step()[0] is True and not torch.equal(before, model[0].weight)


def test_distributed_optimizer_from_a_torch_optimizer_and_reload() -> None:
    model = DistributedDataParallel(None, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    mlp(torch.bfloat16), pg_collection=ParallelGroups.single())
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = DistributedOptimizer(torch_opt, OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=True),
                               None, None, model_chunks=[model])
    shards = opt.get_parameters()
    assert all(s.dim() == 1 and s.dtype == torch.float32 for s in shards)  # flat fp32 ranges, as Megatron's
    assert sum(s.numel() for s in shards) == sum(p.numel() for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    backward(model)
    assert opt.step()[0] is True
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    opt.reload_model_params()
    assert all(torch.equal(s, torch.full_like(s, 2.0)) for s in shards)
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(torch.optim.AdamW(mlp().parameters()), OptimizerConfig(lr=1e-2), None, None,
                             model_chunks=[mlp()])


def test_chained_state_dict_is_megatrons_list() -> None:
    """Megatron's ChainedOptimizer.state_dict(): the one member's dict, or a list with each member's."""
    def build(seed: int) -> tuple[nn.Module, ChainedOptimizer]:
        model = mlp(seed=seed)
        model[0].weight.allreduce = False  # an expert parameter: a second chained optimizer
        return model, get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])

    model, opt = build(0)
    backward(model)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert isinstance(saved, list) and len(saved) == 2
    assert [len(s["state"]) for s in saved] == [len(o.get_parameters()) for o in opt.chained_optimizers]
    assert isinstance(opt.sharded_state_dict()["optimizer"], dict)  # one dict over the whole chain
    for form in (saved, dict(enumerate(saved)), copy.deepcopy(opt.sharded_state_dict()["optimizer"])):
        other_model, other = build(1)
        other.load_state_dict(form)
        for mine, theirs in zip(opt.get_parameters(), other.get_parameters(), strict=True):
            state, loaded = opt.state[(0, mine)] or opt.state[(1, mine)], other.state[(0, theirs)] or \
                other.state[(1, theirs)]
            assert torch.equal(state["exp_avg"], loaded["exp_avg"])
    with pytest.raises(ValueError, match="expected 2 entries"):
        other.load_state_dict(saved[:1])
    single = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [mlp()])
    assert isinstance(single.state_dict(), dict) and "param_groups" in single.state_dict()


def test_state_dict_and_sharded_state_dict_round_trip() -> None:
    model = mlp()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    for _ in range(2):
        opt.zero_grad()
        backward(model)
        opt.step()
    sharded = opt.sharded_state_dict(model.state_dict())
    assert "state" in sharded["optimizer"] and sharded["optimizer"]["state"]
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    opt.zero_grad()
    backward(model)
    opt.step()
    resumed = mlp(seed=5)
    resumed.load_state_dict(weights)
    opt2 = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [resumed])
    opt2.load_state_dict(saved)
    opt2.zero_grad()
    backward(resumed)
    opt2.step()
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_process_group_collection_checks_are_megatrons() -> None:
    model = mlp()
    with pytest.raises(ValueError, match="dp process group is required"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model], pg_collection=ProcessGroupCollection())
    groups = ProcessGroupCollection(dp=None, expt_dp=None)
    with pytest.raises(ValueError, match="intra_dist_opt process group is required"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model], pg_collection=groups)
    with pytest.raises(ValueError, match="Unknown attribute"):
        ProcessGroupCollection(nonsense=None)
    assert groups.tp is None and not groups.is_set("tp")


def test_muon_getter_checks_the_layer_wise_name() -> None:
    with pytest.raises(ValueError, match="dist_ prefix"):
        get_megatron_muon_optimizer(OptimizerConfig(lr=1e-3, optimizer="muon"), [mlp()],
                                    layer_wise_distributed_optimizer=True)
    opt = get_megatron_muon_optimizer(OptimizerConfig(lr=1e-3, optimizer="muon"), [mlp()])
    assert len(opt.chained_optimizers) == 2  # Muon's matrices and the scalar optimizer's rest


def test_hybrid_device_optimizer_matches_the_plain_one() -> None:
    model, ref = mlp(), mlp()
    hybrid = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.7, cpu_optimizer_cls=torch.optim.AdamW,
                                   gpu_optimizer_cls=torch.optim.AdamW, overlap_cpu_optimizer_d2h_h2d=False,
                                   lr=1e-2, bias_correction=True)  # a TE-only argument is left out for torch
    assert 0 < len(hybrid.offloaded) < 4
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for opt, m in ((hybrid, model), (plain, ref)):
        for _ in range(2):
            opt.zero_grad()
            backward(m)
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _bf16_with_an_fp32_vector() -> nn.Module:
    model = mlp(torch.bfloat16)
    model.register_parameter("scale", nn.Parameter(torch.linspace(0.5, 1.5, 3)))  # kept fp32, as Megatron marks
    return model


def _loss(model: nn.Module) -> torch.Tensor:
    return ((model(X.bfloat16()).float() * model.scale) ** 2).sum()


def test_hybrid_device_optimizer_steps_bf16_parameters_through_fp32_copies() -> None:
    """param_update_in_fp32: bf16 parameters are stepped as fp32 copies (offloaded ones on the host) and
    rounded back, exactly as torch's Adam over fp32 masters; the copies travel in the state dict."""
    def hybrid(m: nn.Module) -> HybridDeviceOptimizer:
        return HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, cpu_optimizer_cls=torch.optim.Adam,
                                     param_update_in_fp32=True, overlap_cpu_optimizer_d2h_h2d=False, lr=1e-2)

    model, ref = _bf16_with_an_fp32_vector(), _bf16_with_an_fp32_vector()
    opt = hybrid(model)
    low = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert set(opt.param_to_fp32_param) == set(low) and 0 < len(opt.offloaded) < 5
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = torch.optim.Adam(masters, lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()
        ref.zero_grad()
        _loss(ref).backward()
        for master, p in zip(masters, ref.parameters(), strict=True):
            master.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for master, p in zip(masters, ref.parameters(), strict=True):
                p.copy_(master)
    for p, q, master in zip(model.parameters(), ref.parameters(), masters, strict=True):
        assert torch.equal(p, q)
        if p.dtype == torch.bfloat16:
            assert opt.param_to_fp32_param[p].dtype == torch.float32
            assert torch.equal(opt.param_to_fp32_param[p], master)  # not the rounded value
    saved = copy.deepcopy(opt.state_dict())
    assert set(opt.state) == set(model.parameters())
    assert all(sorted(e) == ["exp_avg", "exp_avg_sq", "master_param", "step"] for e in saved["state"].values())
    restored = _bf16_with_an_fp32_vector()
    restored.load_state_dict(model.state_dict())
    restored_opt = hybrid(restored)
    restored_opt.load_state_dict(saved)
    for p, q in zip(model.parameters(), restored.parameters(), strict=True):
        if p.dtype == torch.bfloat16:
            assert torch.equal(restored_opt.param_to_fp32_param[q], opt.param_to_fp32_param[p])
    for o, m in ((opt, model), (restored_opt, restored)):
        o.zero_grad()
        _loss(m).backward()
        o.step()
    for p, q in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(p, q)


def test_tensor_parallel_muon_is_muon_with_megatrons_defaults() -> None:
    from optstack.algorithms.muon import Muon

    model, ref = mlp(), mlp()
    mats = [p for p in model.parameters() if p.dim() == 2]
    tpm = TensorParallelMuon(mats, lr=0.02)
    assert tpm.defaults["nesterov"] is True and tpm.defaults["weight_decay"] == 0.01
    muon = Muon([p for p in ref.parameters() if p.dim() == 2], lr=0.02, nesterov=True, weight_decay=0.01,
                matmul_precision="medium")
    for opt, m in ((tpm, model), (muon, ref)):
        opt.zero_grad()
        backward(m)
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    split = TensorParallelMuon(mats, split_qkv=True, is_qkv_fn=lambda p: p.shape[0] == 8, qkv_split_shapes=[2, 1, 1])
    assert [g.get("qkv_split_shapes") for g in split.param_groups] == [None, (2, 1, 1)]
    with pytest.raises(ValueError, match="use_decoupled_weight_decay"):
        TensorParallelMuon(mats, use_decoupled_weight_decay=False)


def test_param_group_identifiers_match_saved_groups() -> None:
    assert {"max_lr", "min_lr", "start_wd", "end_wd", "wd_mult", "optimizer"} <= set(param_group_identifier_keys)
    assert not {"lr", "weight_decay", "step"} & set(param_group_identifier_keys)
    current = [{"params": [], "wd_mult": 1.0, "max_lr": 2e-5}, {"params": [], "wd_mult": 1.0, "max_lr": 1e-4}]
    saved = [{"params": [0], "wd_mult": 1.0, "max_lr": 1e-4, "lr": 7.0},
             {"params": [1], "pre_wd_mult": 1.0, "max_lr": 2e-5, "lr": 3.0}]
    matched = MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    assert [g["lr"] for g in matched] == [3.0, 7.0] and [g["params"] for g in matched] == [[0], [1]]
    with pytest.raises(ValueError, match="Could not find parameter group"):
        MegatronOptimizer._filter_and_reorder_param_groups([{"params": [], "max_lr": 9.0}], saved)


def test_private_get_param_groups_has_megatrons_keys() -> None:
    groups = _get_param_groups([mlp()], OptimizerConfig(lr=0.01), {})
    assert groups[0].keys() == {"params", "is_expert_parallel", "default_config", "wd_mult", "lr_mult",
                                "is_decoupled_lr", "max_lr", "min_lr"}


class _Protocol:
    """An optimizer implementing Megatron's step protocol itself (as Megatron's tests mock one)."""

    def __init__(self, param: torch.Tensor, config: OptimizerConfig, norm: float) -> None:
        self.config, self.param, self.norm, self.stepped = config, param, norm, False
        self.param_groups = [{"params": [param]}]

    def prepare_grads(self) -> bool:
        return False

    def get_grad_norm(self) -> float:
        return self.norm

    def get_parameters(self) -> list[torch.Tensor]:
        return [self.param]

    def step_with_ready_grads(self) -> bool:
        self.stepped = True
        return True


def test_chain_of_megatron_protocol_objects_skips_as_one() -> None:
    param = nn.Parameter(torch.ones(2, 2))
    param.grad = torch.ones_like(param)
    skipping = _Protocol(param, OptimizerConfig(clip_grad=0.0, grad_norm_skip_threshold=1.0), 2.0)
    assert ChainedOptimizer([skipping]).step() == (False, 2.0, None) and not skipping.stepped
    assert torch.equal(param.grad, torch.ones_like(param))
    params = [nn.Parameter(torch.ones(2)) for _ in range(2)]
    for p in params:
        p.grad = torch.ones_like(p)
    clipping = [_Protocol(p, OptimizerConfig(clip_grad=1.0), n) for p, n in zip(params, (3.0, 4.0), strict=True)]
    applied, norm, _ = ChainedOptimizer(clipping).step()
    assert applied and norm == 5.0 and all(o.stepped for o in clipping)
    for p in params:  # clipped by the one total norm
        torch.testing.assert_close(p.grad, torch.full_like(p, 0.2), rtol=1e-5, atol=0)
