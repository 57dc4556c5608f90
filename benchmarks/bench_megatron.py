"""optstack's Megatron face vs megatron-core itself: ``optimizer.step()`` of what ``get_megatron_optimizer``
returns, on the same model, gradients and config, each in a fresh process on CPU.

Run: .venv/bin/python benchmarks/bench_megatron.py --mirror /path/to/Megatron-LM.git [--ref core_v0.16.1]
     (or --megatron-src /path/to/Megatron-LM; --params-m 8 --layers 8 --steps 12 --rounds 2 --configs ...)

megatron-core's optimizers assert CUDA, so both sides run under ``tools/megatron_tests/shim.py`` (the shim the
Megatron-LM unit tests run under: device arguments naming CUDA map to the CPU, NCCL to gloo). The Megatron side
installs it without aliases (Megatron's own ``megatron.core.optimizer`` and ``megatron.core.distributed``) and
also answers ``Tensor.type()`` with CUDA type names, which Megatron's gradient clipping and fp16 wrapper assert;
the optstack side aliases those packages to ``optstack.megatron``, as a user changing the import would. Without
Transformer Engine or Apex, Megatron steps with ``torch.optim.AdamW`` (foreach) and its local multi-tensor
fallbacks: what it does on a CPU, not what it does on a GPU with TE's fused Adam.

Configs (AdamW, lr 1e-3, weight decay 0.01 but none on biases, set by ``OptimizerParamScheduler`` as in
Megatron's training loop, Megatron's default ``clip_grad=1.0``, a model of ``--layers``
square ``Linear`` layers with biases, batch 16, one thread):

- ``fp32``: fp32 parameters, ``FP32Optimizer``;
- ``bf16``: bf16 parameters, ``bf16=True``: ``Float16OptimizerWithFloat16Params`` (fp32 masters), fp32 grads;
- ``bf16-distopt``: the same with ``use_distributed_optimizer=True`` (one rank: ``DistributedOptimizer``).

Each config runs ``--rounds`` times per side, the sides alternating (M O O M ...); a run takes ``--steps``
steps (zero the grad buffers, forward, backward, ``finish_grad_sync``, ``optimizer.step()``), the first two
untimed. optstack's ``step()`` runs outside the shim's device mode, as a user's would; Megatron's needs it (it
makes tensors on ``'cuda'``), so each torch call it routes through the mode is counted and the mode's measured
cost per call is taken off its time (the last column: calls per step x cost per call). Columns: median
``step()`` time per side (all rounds pooled), the ratio optstack / Megatron (< 1: faster), and agreement
after the last step: the gradient norm each step returned (largest relative difference) and the parameters
(share of elements that differ, largest absolute difference). Differences are rounding: the order of fp32
sums (Megatron's foreach AdamW vs the fused one), and for bf16 parameters the rounding of a master to bf16
(optstack rounds exact ties away from zero, torch's ``.to(torch.bfloat16)`` to even; see the README).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools" / "megatron_tests"
CONFIGS = ("fp32", "bf16", "bf16-distopt")
SIDES = ("megatron", "optstack")


# ----------------------------------------------------------------------------------------- one side, one run


def _cuda_type_names() -> None:
    """``Tensor.type()`` (no arguments) says ``torch.cuda.*Tensor`` for a CPU tensor: Megatron asserts it."""
    plain = torch.Tensor.type

    def type_(self: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (torch's signature)
        name = plain(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_


def _mode_overhead(mode, n: int = 20000) -> float:  # noqa: ANN001 (the shim's mode, entered)
    """Seconds a torch call spends in the shim's device mode, beyond the call itself (median of 5)."""
    x = torch.zeros(4)
    inside, outside = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            x.view(-1)
        inside.append(time.perf_counter() - start)
        mode.__exit__(None, None, None)
        start = time.perf_counter()
        for _ in range(n):
            x.view(-1)
        outside.append(time.perf_counter() - start)
        mode.__enter__()
    return max(0.0, (statistics.median(inside) - statistics.median(outside)) / n)


def child(side: str, config: str, args: argparse.Namespace) -> None:
    """One run of one side; prints a JSON line, saves the final parameters to ``args.out``."""
    sys.path[:0] = [str(TOOLS), str(REPO / "src")]
    import shim  # noqa: PLC0415 (only in the child, after sys.path)

    if side == "megatron":
        _cuda_type_names()
    mode = shim.install(args.megatron_src, aliases=shim.ALIASES if side == "optstack" else {})
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: PLC0415
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: PLC0415
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    shim.Utils.initialize_model_parallel()
    bf16 = config.startswith("bf16")
    distopt = config.endswith("distopt")
    width = int((args.params_m * 1e6 / args.layers) ** 0.5)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers)])
    if bf16:
        module = module.bfloat16()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt)
    model = DistributedDataParallel(TransformerConfig(num_attention_heads=1, num_layers=1), ddp_config, module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, weight_decay=0.01, bf16=bf16, use_distributed_optimizer=distopt), [model])
    # Megatron applies a group's wd_mult (no decay on biases) only once its scheduler has stepped
    OptimizerParamScheduler(optimizer, init_lr=1e-3, max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=0,
                            lr_decay_steps=100, lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
                            wd_incr_steps=100, wd_incr_style="constant")
    inner = [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    calls: list[None] = []
    routed = type(mode).__torch_function__

    def counted(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202 (torch's hook)
        calls.append(None)
        return routed(self, func, types, args, kwargs)

    type(mode).__torch_function__ = counted
    overhead = _mode_overhead(mode)
    data = torch.Generator().manual_seed(1)
    times, norms = [], []
    for step in range(args.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        x = torch.randn(16, width, generator=data).to(module[0].weight.dtype)
        module(x).float().pow(2).mean().backward()
        model.finish_grad_sync()
        if side == "optstack":  # the step runs as a user's would, outside the shim's device mode
            mode.__exit__(None, None, None)
        calls.clear()
        start = time.perf_counter()
        ok, norm, _ = optimizer.step()
        elapsed = time.perf_counter() - start
        if side == "optstack":
            mode.__enter__()
        # Megatron's step needs the mode (it makes tensors on 'cuda'): each torch call it routes costs
        # ``overhead`` more than it would on a GPU machine; that cost is taken off its time.
        elapsed -= len(calls) * overhead
        assert ok, f"{side} {config}: step {step} was skipped"
        norms.append(float(norm))
        if step >= 2 or args.steps <= 2:
            times.append(elapsed)
    torch.save({k: v.float() for k, v in module.state_dict().items()}, args.out)
    print(json.dumps({"times": times, "norms": norms, "inner": inner, "calls": len(calls), "overhead": overhead,
                      "params": sum(p.numel() for p in module.parameters())}))


# ------------------------------------------------------------------------------------------------- driver


def _run(side: str, config: str, args: argparse.Namespace, out: Path) -> dict:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": str(args.threads),
           "OPTSTACK_MEGATRON_STORE": str(out.with_suffix(".store"))}
    cmd = [sys.executable, __file__, "--child", side, config, "--megatron-src", str(args.megatron_src),
           "--out", str(out), "--params-m", str(args.params_m), "--layers", str(args.layers),
           "--steps", str(args.steps), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} {config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _agreement(a: Path, b: Path) -> tuple[float, float]:
    x, y = torch.load(a), torch.load(b)
    differ = sum(int((x[k] != y[k]).sum()) for k in x)
    total = sum(v.numel() for v in x.values())
    return differ / total, max(float((x[k] - y[k]).abs().max()) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mirror", type=Path, default=os.environ.get("MEGATRON_LM_MIRROR"),
                        help="a bare Megatron-LM git mirror (default $MEGATRON_LM_MIRROR)")
    parser.add_argument("--ref", default="core_v0.16.1", help="the Megatron-LM ref to export from --mirror")
    parser.add_argument("--megatron-src", type=Path, help="a Megatron-LM checkout instead of --mirror/--ref")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--params-m", type=float, default=8.0, help="millions of parameters (about)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="steps per run, the first two untimed")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side and config")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args)
        return
    if args.megatron_src is None:
        if args.mirror is None:
            parser.error("give --megatron-src, or --mirror (or $MEGATRON_LM_MIRROR) with --ref")
        sys.path.insert(0, str(TOOLS))
        from run import export  # noqa: PLC0415 (the test runner's export of a ref)

        args.megatron_src = export(Path(args.mirror), args.ref,
                                   Path(tempfile.gettempdir()) / "optstack-megatron-tests")
    work = Path(tempfile.mkdtemp(prefix="bench-megatron-"))
    print(f"megatron-core from {args.megatron_src}; {args.threads} thread(s); {args.steps - 2} timed steps x "
          f"{args.rounds} rounds per side\n")
    print("| config | Megatron's optimizer | params | Megatron step ms | optstack step ms | optstack / Megatron "
          "| grad norm max rel diff | params differing | max abs diff | Megatron's calls through the mode |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in args.configs:
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        results: dict[str, dict] = {}
        for round_ in range(args.rounds):
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                results[side] = _run(side, config, args, work / f"{config}-{side}.pt")
                times[side] += results[side]["times"]
        ms = {side: statistics.median(times[side]) * 1e3 for side in SIDES}
        routed = results["megatron"]["calls"], results["megatron"]["overhead"] * 1e6
        norm_diff = max(abs(a - b) / abs(a) for a, b in zip(results["megatron"]["norms"],
                                                            results["optstack"]["norms"], strict=True))
        share, most = _agreement(work / f"{config}-megatron.pt", work / f"{config}-optstack.pt")
        print(f"| {config} | {'+'.join(results['megatron']['inner'])} | {results['megatron']['params'] / 1e6:.1f}M "
              f"| {ms['megatron']:.1f} | {ms['optstack']:.1f} | {ms['optstack'] / ms['megatron']:.2f} "
              f"| {norm_diff:.1e} | {share:.1e} | {most:.1e} | {routed[0]} x {routed[1]:.0f} us |", flush=True)


if __name__ == "__main__":
    main()
