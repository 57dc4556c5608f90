"""The full optimizer step (finite check, global grad norm, clip, AdamW) on ~50M fp32 parameters: optstack's
``build_optimizer`` and the Megatron face ``get_megatron_optimizer`` vs the torch loops doing the same work.

Run: .venv/bin/python benchmarks/bench_step.py [--layouts 50x1M 5000x10k] [--repeats 21] [--json PATH]

Rows (one thread, fp32 parameters, the same lr / betas / eps / weight decay everywhere, weight decay on
every parameter: the model holds only 2-D parameters, which optstack's and Megatron's default rules decay):

- torch A (baseline): ``clip_grad_norm_(params, 1.0, foreach=True)`` + ``AdamW(fused=True).step()``
- torch B (baseline): ``torch._foreach_norm(grads)``, stacked, one host read of "all finite" (the cheapest
  loop that still detects a non-finite gradient) + ``AdamW(fused=True).step()``
- torch fused AdamW alone (no check, no norm: the floor)
- optstack ``build_optimizer(OptimizerConfig(clip_grad=1.0))``: finite check + norm + clip + AdamW, vs A
- optstack with ``clip_grad=0.0``, no loss scaler (finite check + norm + AdamW), vs B
- Megatron face ``get_megatron_optimizer`` with Megatron's defaults but ``clip_grad=0.0``, vs B; and with
  Megatron's default ``clip_grad=1.0``, vs A

All rows step the same parameter tensors (each optimizer with its own state). The gradients are random,
filled once (global norm ~7, so clipping to 1.0 really scales them); clipping scales them in place, so
before every timed step, outside the timed region, every row gets the same gradients copied back into its
``p.grad``. One repeat times one ``step()`` of every row, in an order rotated each repeat, so a burst of load
from elsewhere hits the rows alike; the table gives the median per row and its time relative to the two
baselines (< 1: faster). After timing, each optstack row and its torch row take one step from the same start
and gradients on fresh copies, and the parameters are compared (rtol 1e-5): the rows do the same work.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from optstack import OptimizerConfig, build_optimizer
from optstack.config import AdamConfig, LossScaleConfig
from optstack.megatron import OptimizerConfig as MegatronConfig
from optstack.megatron import get_megatron_optimizer

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
HYPER = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
MAX_NORM = 1.0
#: layout name -> (tensor count, elements per tensor at the default 50M parameters)
LAYOUTS = {"50x1M": (50, 1_000_000), "5000x10k": (5000, 10_000)}
A, B = "torch A", "torch B"
#: what the parameter check allows: rtol 1e-5 of the parameter; atol 1e-5 of the step size, for parameters near 0
#: (the rows run the same kernels, so differences are rounding only: the clip factor, a last bit)
RTOL = 1e-5
ATOL = RTOL * LR


class Params(nn.Module):
    """A model that is only its 2-D parameters (so every rule gives them weight decay)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(t) for t in tensors)


def make_model(count: int, side: int) -> Params:
    gen = torch.Generator().manual_seed(0)
    return Params([torch.randn(side, side, generator=gen) * 0.02 for _ in range(count)])


def make_grads(count: int, side: int) -> list[torch.Tensor]:
    """Random gradients with a global norm of ~7 at any size (std 1e-3 at 50M), so clipping to 1.0 scales."""
    gen = torch.Generator().manual_seed(1)
    std = 1e-3 * math.sqrt(50e6 / (count * side * side))
    return [torch.randn(side, side, generator=gen) * std for _ in range(count)]


# -- the rows -----------------------------------------------------------------------------------------------
Step = Callable[[], object]


def torch_a(model: nn.Module) -> Step:
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, fused=True, **HYPER)

    def step() -> float:
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()
        return float(norm)

    return step


def torch_b(model: nn.Module) -> Step:
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, fused=True, **HYPER)

    def step() -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        finite = bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())  # the one host read
        if finite:
            opt.step()
        return finite

    return step


def torch_fused(model: nn.Module) -> Step:
    return torch.optim.AdamW(list(model.parameters()), fused=True, **HYPER).step


def optstack_config(clip_grad: float) -> OptimizerConfig:
    return OptimizerConfig(
        algorithm="adamw", lr=LR, weight_decay=WD, clip_grad=clip_grad,
        adam=AdamConfig(beta1=BETAS[0], beta2=BETAS[1], eps=EPS), loss_scale=LossScaleConfig(mode="none"),
    )


def optstack_row(clip_grad: float) -> Callable[[nn.Module], Step]:
    def make(model: nn.Module) -> Step:
        opt = build_optimizer(optstack_config(clip_grad), model).optimizer
        check_groups(opt.param_groups, model)

        def step() -> object:  # step() returns the closure's loss, as torch's; the StepResult is last_result
            opt.step()
            return opt.last_result

        return step

    return make


def megatron_row(clip_grad: float) -> Callable[[nn.Module], Step]:
    def make(model: nn.Module) -> Step:
        # Megatron's defaults (adam, decoupled weight decay 0.01, betas 0.9/0.999, eps 1e-8, fp32, no loss
        # scale); lr has no default there, so it is set, and clip_grad as the row says.
        config = MegatronConfig(lr=LR, clip_grad=clip_grad)
        assert (config.weight_decay, config.adam_beta1, config.adam_beta2, config.adam_eps) == (WD, *BETAS, EPS)
        opt = get_megatron_optimizer(config, [model])
        check_groups(opt.param_groups, model)
        return opt.step

    return make


def check_groups(groups: list[dict], model: nn.Module) -> None:
    """The optimizer steps exactly the model's parameters, all with the same lr and weight decay as torch."""
    stepped = [p for g in groups for p in g["params"]]
    assert {id(p) for p in stepped} == {id(p) for p in model.parameters()}, "optimizer steps other tensors"
    for g in groups:
        assert g["lr"] == LR and g["weight_decay"] == WD, f"group lr={g['lr']} wd={g['weight_decay']}"


@dataclass(frozen=True)
class Row:
    name: str
    make: Callable[[nn.Module], Step]
    baseline: str | None  # the torch row it is compared against (and checked against for equal results)
    target: float | None  # the target for time / baseline time


ROWS = [
    Row(A, torch_a, None, None),
    Row(B, torch_b, None, None),
    Row("torch fused AdamW alone", torch_fused, None, None),
    Row("optstack clip=1.0", optstack_row(MAX_NORM), A, 0.90),
    Row("optstack clip=0", optstack_row(0.0), B, 1.0),
    Row("megatron clip=0", megatron_row(0.0), B, 1.0),
    Row("megatron clip=1.0", megatron_row(MAX_NORM), A, None),
]
DESCRIPTION = {
    A: "`clip_grad_norm_(foreach=True)` + `AdamW(fused=True)`",
    B: "`_foreach_norm` + one finite read + `AdamW(fused=True)`",
    "torch fused AdamW alone": "`AdamW(fused=True).step()`",
    "optstack clip=1.0": "`build_optimizer(OptimizerConfig(clip_grad=1.0))`",
    "optstack clip=0": "`build_optimizer(OptimizerConfig(clip_grad=0.0))`",
    "megatron clip=0": "`get_megatron_optimizer(OptimizerConfig(lr, clip_grad=0.0))`",
    "megatron clip=1.0": "`get_megatron_optimizer(OptimizerConfig(lr))` (clip_grad=1.0)",
}


# -- timing -------------------------------------------------------------------------------------------------
def measure(count: int, side: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each row's ``step()`` per repeat, all rows stepping one model, interleaved."""
    model = make_model(count, side)
    saved = make_grads(count, side)
    params = list(model.parameters())
    for p, g in zip(params, saved, strict=True):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    steps = {row.name: row.make(model) for row in ROWS}

    def reset() -> None:
        torch._foreach_copy_(grads, saved)
        assert all(p.grad is g for p, g in zip(params, grads, strict=True)), "a row replaced p.grad"

    for _ in range(warmup):  # creates the optimizer states
        for step in steps.values():
            reset()
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                reset()
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
            gc.collect()
    finally:
        gc.enable()
    return times


# -- equal work ---------------------------------------------------------------------------------------------
def one_step(row: Row, count: int, side: int) -> tuple[list[torch.Tensor], object]:
    """A fresh model from the common start, the common gradients, one step of ``row``: (params, result)."""
    model = make_model(count, side)
    for p, g in zip(model.parameters(), make_grads(count, side), strict=True):
        p.grad = g
    result = row.make(model)()
    return [p.detach() for p in model.parameters()], result


def check(count: int, side: int) -> list[dict]:
    """Each compared row's parameters after one step vs its torch baseline's, from the same start."""
    start = [p.detach() for p in make_model(count, side).parameters()]
    refs = {name: one_step(next(r for r in ROWS if r.name == name), count, side) for name in (A, B)}
    out = []
    for row in (r for r in ROWS if r.baseline is not None):
        params, result = one_step(row, count, side)
        ref, ref_result = refs[row.baseline]
        diff = max(float((p - q).abs().max()) for p, q in zip(params, ref, strict=True))
        update = max(float((q - s).abs().max()) for q, s in zip(ref, start, strict=True))
        close = all(torch.allclose(p, q, rtol=RTOL, atol=ATOL) for p, q in zip(params, ref, strict=True))
        if isinstance(result, tuple):  # Megatron's (update_successful, grad_norm, num_zeros_in_grad)
            applied, norm = result[0], result[1]
        else:  # optstack's StepResult
            applied, norm = result.applied, result.grad_norm
        close = close and applied is True
        entry = {"row": row.name, "vs": row.baseline, "max_abs_diff": diff, "max_update": update, "close": close,
                 "grad_norm": norm}
        if row.baseline == A:
            entry["torch_grad_norm"] = ref_result
        out.append(entry)
        del params
    return out


# -- output -------------------------------------------------------------------------------------------------
def _size(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS),
                        help="tensor layouts, each a column group (default: both)")
    parser.add_argument("--params-m", type=float, default=50.0,
                        help="millions of fp32 parameters per layout (smaller for a quick run; square tensors)")
    parser.add_argument("--repeats", type=int, default=21, help="timed steps per row (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row first (creates state)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-check", action="store_true", help="skip the equal-results check")
    parser.add_argument("--json", metavar="PATH", help="also write the rows (and the check) as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    shapes = {}
    for name in args.layouts:
        count, numel = LAYOUTS[name]
        side = max(1, round(math.sqrt(numel * args.params_m / 50.0)))
        shapes[name] = (count, side)
    label = {name: f"{count} x {_size(side * side)} ({side}x{side})" for name, (count, side) in shapes.items()}

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    print(f"`{command}`\n")
    print(f"Full optimizer step, fp32, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"lr={LR} betas={BETAS} eps={EPS} weight_decay={WD}, clip to {MAX_NORM}; median of {args.repeats} "
          f"interleaved repeats after {args.warmup} warm-up step(s).\n")

    results: dict[str, dict[str, list[float]]] = {}
    checks: dict[str, list[dict]] = {}
    for name, (count, side) in shapes.items():
        t0 = time.perf_counter()
        results[name] = measure(count, side, args.repeats, args.warmup)
        if not args.no_check:
            checks[name] = check(count, side)
        print(f"(layout {label[name]}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    median = {lay: {row: statistics.median(ts) * 1e3 for row, ts in rows.items()} for lay, rows in results.items()}
    head = ["row", "what"]
    for name in shapes:
        head += [f"{label[name]}: ms", "/ A", "/ B"]
    head += ["target"]
    print("Time relative to the baselines (< 1: faster than torch):\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    json_rows = []
    for row in ROWS:
        cells = [row.name + (" (baseline)" if row.name in (A, B) else ""), DESCRIPTION[row.name]]
        for name in shapes:
            ms = median[name][row.name]
            cells += [f"{ms:.1f}", f"{ms / median[name][A]:.2f}", f"{ms / median[name][B]:.2f}"]
            json_rows.append({
                "layout": name, "tensors": shapes[name][0], "shape": [shapes[name][1]] * 2, "row": row.name,
                "median_ms": ms, "ratio_vs_A": ms / median[name][A], "ratio_vs_B": ms / median[name][B],
                "baseline": row.baseline, "target": row.target,
                "times_ms": [t * 1e3 for t in results[name][row.name]],
            })
        cells.append(f"<= {row.target:.2f}x {row.baseline[-1]}" if row.target is not None else
                     (f"vs {row.baseline[-1]}" if row.baseline else ""))
        print("| " + " | ".join(cells) + " |")

    print("\nTargets:\n")
    for row in (r for r in ROWS if r.baseline is not None):
        for name in shapes:
            ratio = median[name][row.name] / median[name][row.baseline]
            verdict = ("" if row.target is None else
                       f" (target <= {row.target:.2f}x): {'MET' if ratio <= row.target else 'NOT MET'}")
            print(f"- {row.name} vs {row.baseline}, {label[name]}: {ratio:.2f}x{verdict}")

    if checks:
        print(f"\nEqual work: one step from the same start and gradients on fresh copies, parameters compared "
              f"with rtol={RTOL:g}, atol={ATOL:g} (max update = largest |parameter change| of the torch row; close = "
              f"all parameters close and the step applied):\n")
        print("| layout | row | vs | max abs diff | max update | grad norm (row / torch A) | close |")
        print("|---|---|---|---|---|---|---|")
        for name, entries in checks.items():
            for e in entries:
                norms = (f"{e['grad_norm']:.6f} / {e['torch_grad_norm']:.6f}" if "torch_grad_norm" in e
                         else f"{e['grad_norm']:.6f} / -")
                print(f"| {label[name]} | {e['row']} | {e['vs']} | {e['max_abs_diff']:.1e} | "
                      f"{e['max_update']:.1e} | {norms} | {'yes' if e['close'] else 'NO'} |")
        if not all(e["close"] for entries in checks.values() for e in entries):
            print("\nWARNING: a row's parameters differ from its torch row's: the timings compare different work")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "repeats": args.repeats, "hyper": {**HYPER, "max_norm": MAX_NORM},
                       "rows": json_rows, "checks": checks}, f, indent=1)
        print(f"\n(rows written to {args.json})")


if __name__ == "__main__":
    main()
