"""The ``optstack`` command: ``optstack groups`` (who gets which settings), ``optstack train`` (the demo),
``optstack compare`` (the demo with several optimizers) and ``optstack plan`` (who holds and steps what at a
given scale, ``cli/plan.py``).

User errors (a bad flag value, an unknown config key, a missing data path, ...) print one message and exit
with status 2, without a traceback; set ``OPTSTACK_DEBUG=1`` to see the traceback anyway. Ctrl-C during
training exits with 130 and says how to resume; a rank of ``--nproc N`` that crashes or dies exits with 1,
showing that rank's traceback (or exit code) and how to resume.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from optstack.cli.models import load_model

__all__ = ["main", "build_parser", "load_model", "groups_report"]

DEFAULT_MODEL = "optstack.demo.gpt:build_demo_model"
COMPARE_STEPS = 200  # optstack compare: short runs, so three optimizers take minutes on 2 cores


# -- groups -----------------------------------------------------------------------------------------------
def groups_report(model: nn.Module, config: Any) -> dict[str, Any]:
    """Per parameter and per group: what ``build_optimizer(config, model)`` gives, and which rules decided it.

    Args:
        model: the model.
        config: an ``optstack.config.OptimizerConfig``; the rules are ``factory.default_rules(config)``.

    Returns:
        ``{"config": {...}, "parameters": [...], "groups": [...]}`` of plain JSON values.
    """
    from optstack.factory import default_rules
    from optstack.groups import build_param_groups, group_map
    from optstack.names import named_parameters
    from optstack.rules import explain, resolve

    rules = default_rules(config)
    named = named_parameters(model)
    explained = explain(named, rules)
    groups = build_param_groups(named, resolve(named, rules), lr=config.lr, min_lr=config.min_lr)
    mapping = group_map(groups)
    group_of = mapping["param_to_group"]
    params = dict(named)
    rows = []
    for name, e in explained.items():
        g = groups[group_of[name]]
        rows.append({
            "name": name, "shape": list(e.shape), "numel": params[name].numel(), "group": group_of[name],
            "max_lr": g["max_lr"], "min_lr": g["min_lr"], "lr_mult": g["lr_mult"], "wd_mult": g["wd_mult"],
            "algorithm": g.get("algorithm", config.algorithm), "is_expert": e.is_expert,
            "settings": {k: _plain(v) for k, v in e.settings.items()},
            "rules": {k: list(labels) for k, labels in e.sources.items()},
        })
    summary = []
    for g, entry in zip(groups, mapping["groups"], strict=True):
        settings = {k: _plain(v) for k, v in entry["settings"].items()}
        settings.setdefault("algorithm", config.algorithm)
        summary.append({"group": entry["index"], "count": len(g["params"]),
                        "numel": sum(p.numel() for p in g["params"]), "settings": settings,
                        "params": entry["params"]})
    cfg = {k: getattr(config, k) for k in ("algorithm", "lr", "min_lr", "weight_decay", "decoupled_lr",
                                           "decoupled_min_lr", "mup_width_mult", "apply_wd_to_qk_layernorm")}
    return {"config": cfg, "parameters": rows, "groups": summary}


def _plain(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_groups_report(report: dict[str, Any]) -> str:
    """The report as two plain-text tables: one row per parameter, then one per group."""
    params = [["parameter", "shape", "group", "max_lr", "min_lr", "wd_mult", "algorithm", "decided by"]]
    for r in report["parameters"]:
        by_rules: dict[tuple[str, ...], list[str]] = {}
        for key, labels in r["rules"].items():
            by_rules.setdefault(tuple(labels), []).append(key)
        why = "; ".join(f"{','.join(keys)} <- {' + '.join(labels)}" for labels, keys in by_rules.items())
        shape = "x".join(map(str, r["shape"])) or "scalar"
        params.append([r["name"], shape, str(r["group"]), f"{r['max_lr']:.4g}", f"{r['min_lr']:.4g}",
                       f"{r['wd_mult']:g}", r["algorithm"], why or "defaults"])
    groups = [["group", "params", "numel", "max_lr", "min_lr", "wd_mult", "algorithm", "other settings"]]
    shown = {"max_lr", "min_lr", "wd_mult", "algorithm", "lr_mult", "default_config", "is_expert_parallel"}
    for g in report["groups"]:
        s = g["settings"]
        other = ", ".join(f"{k}={v}" for k, v in s.items() if k not in shown)
        if s.get("lr_mult", 1.0) != 1.0:
            other = f"lr_mult={s['lr_mult']:g}" + (", " + other if other else "")
        if s.get("is_expert_parallel"):
            other = "expert" + (", " + other if other else "")
        groups.append([str(g["group"]), str(g["count"]), f"{g['numel']:,}", f"{s['max_lr']:.4g}",
                       f"{s['min_lr']:.4g}", f"{s['wd_mult']:g}", s["algorithm"], other or "-"])
    c = report["config"]
    head = (f"optimizer {c['algorithm']}, lr {c['lr']:g} -> min_lr {c['min_lr']:g}, "
            f"weight_decay {c['weight_decay']:g}"
            + (f", decoupled_lr {c['decoupled_lr']:g}" if c["decoupled_lr"] is not None else "")
            + (f", MuP width mult {c['mup_width_mult']:g}" if c["mup_width_mult"] != 1 else ""))
    return f"{head}\n\n{_table(params)}\n\n{_table(groups)}"


def cmd_groups(args: argparse.Namespace) -> int:
    from optstack.config import OptimizerConfig
    from optstack.demo.config import DEFAULT_LR

    lr = args.lr if args.lr is not None else DEFAULT_LR.get(args.optimizer, 1e-3)
    config = OptimizerConfig(
        algorithm=args.optimizer, lr=lr, min_lr=args.min_lr if args.min_lr is not None else lr / 10,
        weight_decay=args.weight_decay, decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        mup_width_mult=args.mup_width_mult, apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
    )
    report = groups_report(load_model(args.model), config)
    print(json.dumps(report, indent=2) if args.json else format_groups_report(report))
    return 0


# -- train and compare ------------------------------------------------------------------------------------
_MODEL_FLAGS = {"n_layer": "transformer blocks", "n_head": "attention heads", "d_model": "residual width",
                "seq_len": "context length in bytes"}


def _run_overrides(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--set`` overrides, then the shortcut flags the command has (train and compare share most)."""
    from optstack.demo.config import parse_override

    overrides = [parse_override(s) for s in args.set or []]
    flags = {  # shortcut flags, applied after --set
        ("optimizer", "algorithm"): getattr(args, "optimizer", None), ("optimizer", "lr"): getattr(args, "lr", None),
        ("train", "steps"): args.steps, ("train", "grad_accum"): args.grad_accum,
        ("train", "eval_every"): args.eval_every, ("train", "batch_size"): args.batch_size,
        ("train", "seed"): args.seed, ("data", "path"): args.data,
        ("optimizer", "precision"): "bf16" if args.bf16 else None,
        **{("model", key): getattr(args, key) for key in _MODEL_FLAGS},
    }
    for (section, key), value in flags.items():
        if value is not None:
            overrides.append({section: {key: value}})
    sharding = getattr(args, "sharding", None)
    if sharding is not None:
        overrides.append({"optimizer": {"distributed": {"sharding": sharding}}})
    return overrides


def _bf16_note(cfg: Any) -> None:
    if cfg.optimizer.precision == "bf16" and cfg.train.device != "cuda":
        import torch

        if not torch.cuda.is_available():
            print("note: bf16 on a CPU without native bf16 matmuls can be much slower than fp32",
                  file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> int:
    from optstack.demo.config import config_to_dict, load_config, to_toml
    from optstack.demo.launch import launch

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    base = None
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs --out RUN_DIR (the run directory to continue)")
        saved = Path(args.out) / "config.toml"
        if not saved.is_file():
            raise ValueError(
                f"--resume: {str(saved)!r} not found; is {args.out!r} a run directory of optstack train?"
            )
        base = tomllib.loads(saved.read_text())
    cfg = load_config(args.config, _run_overrides(args), base=base, nproc=args.nproc)
    if args.print_config:
        print(to_toml(config_to_dict(cfg)), end="")
        return 0
    out = args.out or f"runs/{cfg.optimizer.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"
    _bf16_note(cfg)
    launch(cfg, out, nproc=args.nproc, resume=args.resume, progress=args.progress)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from optstack.algorithms import get_algorithm
    from optstack.demo.compare import compare
    from optstack.demo.config import load_config

    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--optimizers must list distinct names separated by commas, got {args.optimizers!r}")
    for name in names:
        get_algorithm(name)  # an unknown name fails here, listing the known ones
    shared = _run_overrides(args)
    # Compare's own defaults sit below the config file and flags: short runs, evaluated ~10 times.
    steps = load_config(args.config, shared, base={"train": {"steps": COMPARE_STEPS}}).train.steps
    base = {"train": {"steps": COMPARE_STEPS, "eval_every": max(1, steps // 10)},
            "schedule": {"warmup_steps": min(50, steps // 10)}}
    factors = _lr_factors(args.lr_sweep)
    configs = {}
    for name in names:
        own = [*shared, {"optimizer": {"algorithm": name}}]
        below = base
        if get_algorithm(name).capabilities.swaps_weights:
            # Schedule-Free's average replaces the decay: a decaying schedule would double it (its paper's
            # setting is warmup then constant); in the base, so a config file or --set may still choose a style
            below = {**base, "schedule": {**base["schedule"], "style": "constant"}}
        plain = load_config(args.config, own, base=below)  # the user's lr, or the optimizer's default
        lr, min_lr = plain.optimizer.lr, plain.optimizer.min_lr
        configs[name] = [plain] if factors == [1.0] else [  # the schedule's shape kept: min_lr scales too
            load_config(args.config, [*own, {"optimizer": {"lr": float(f"{lr * f:.6g}"),
                                                           "min_lr": float(f"{min_lr * f:.6g}")}}], base=below)
            for f in factors]
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    _bf16_note(next(iter(configs.values()))[0])
    compare(configs, out, progress=args.progress)
    return 0


def _lr_factors(text: str) -> list[float]:
    """``--lr-sweep``'s factors: distinct positive numbers separated by commas."""
    try:
        factors = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        factors = []
    if not factors or any(not f > 0 for f in factors) or len(set(factors)) != len(factors):
        raise ValueError(f"--lr-sweep must list distinct positive factors separated by commas (e.g. 0.3,1,3), "
                         f"got {text!r}")
    return factors


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """Flags train and compare share: config layers, loop, data and model size."""
    p.add_argument("--config", help="TOML file with [model] [data] [train] [schedule] [optimizer] sections")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override any config field, e.g. --set optimizer.adam.beta2=0.95 (repeatable)")
    p.add_argument("--bf16", action="store_true", default=None, help="bf16 params, fp32 master weights")
    p.add_argument("--grad-accum", type=int, help="micro-batches per step (= train.grad_accum)")
    p.add_argument("--batch-size", type=int,
                   help="sequences per micro-batch over all processes (= train.batch_size)")
    p.add_argument("--steps", type=int, help="optimizer steps (= train.steps)")
    p.add_argument("--eval-every", type=int, help="validation every N steps (= train.eval_every)")
    p.add_argument("--seed", type=int, help="= train.seed")
    p.add_argument("--data", help="a text file or folder to train on instead of the stdlib (= data.path)")
    for key, what in _MODEL_FLAGS.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, help=f"{what} (= model.{key})")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")


# -- parser -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optstack",
                                     description="The optimizer layer for large-model training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("groups", help="show which settings and param group each parameter of a model gets",
                       description="Print, per parameter, its group, lr/min_lr, wd_mult, algorithm and the "
                       "rules that decided them, then a summary per group.")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"package.module:factory (default {DEFAULT_MODEL})")
    g.add_argument("--optimizer", default="adamw", help="adamw | sgd | lion | muon | any registered name")
    g.add_argument("--lr", type=float, help="base lr (default: the demo's default for the optimizer)")
    g.add_argument("--min-lr", type=float, help="base min lr (default lr / 10)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--decoupled-lr", type=float, help="lr for embedding and output parameters")
    g.add_argument("--decoupled-min-lr", type=float, help="min lr for embedding and output parameters")
    g.add_argument("--mup-width-mult", type=float, default=1.0, help="MuP width multiplier (1 = no MuP)")
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true", help="keep weight decay on q/k norms")
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")
    g.set_defaults(func=cmd_groups, command_parser=g)

    t = sub.add_parser("train", help="train the built-in small GPT on the Python stdlib's source",
                       description="Train the demo GPT. Settings: defaults, then --config FILE.toml, then "
                       "--set section.key=value (repeatable; sections model, data, train, schedule, "
                       "optimizer), then the shortcut flags below. Without an explicit lr, each optimizer "
                       "gets its own default (optimizer.lr), min_lr = lr / 10, weight_decay 0.1 and "
                       "clip_grad 1.0.")
    _add_run_flags(t)
    t.add_argument("--out", help="run directory (default runs/<optimizer>-<date>-<time>)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t.add_argument("--nproc", type=int, default=1,
                   help="processes on this machine (gloo on CPU, NCCL on CUDA); the global batch is split "
                   "across them (default 1)")
    t.add_argument("--sharding", choices=("replicated", "zero1", "layerwise"),
                   help="optimizer state across processes (= optimizer.distributed.sharding; default with "
                   "--nproc > 1: zero1)")
    t.add_argument("--optimizer", help="adamw | sgd | lion | muon (= optimizer.algorithm)")
    t.add_argument("--lr", type=float, help="peak learning rate (= optimizer.lr)")
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config as TOML (a template for --config) and exit")
    t.set_defaults(func=cmd_train, command_parser=t)

    c = sub.add_parser("compare", help="train with several optimizers and compare their validation loss",
                       description="Run the same short training with each optimizer in turn (same model, data, "
                       "seed; each with its own default lr), then write compare.png (validation loss by step "
                       "and by wall time) and a table (compare.md / .json / .csv) into --out. Unless set, --steps is "
                       f"{COMPARE_STEPS} and --eval-every a tenth of the steps.")
    _add_run_flags(c)  # --steps defaults to COMPARE_STEPS here, --eval-every to a tenth of the steps
    c.add_argument("--optimizers", default="adamw,muon,lion", help="comma-separated (default adamw,muon,lion)")
    c.add_argument("--lr-sweep", default="1", metavar="FACTORS",
                   help="each optimizer's lr times each of these factors, the best kept (e.g. 0.3,1,3 for a "
                   "fair comparison; default 1: its lr alone). Schedule-Free algorithms get a constant schedule "
                   "after warmup unless schedule.style is set")
    c.add_argument("--out", help="comparison directory (default runs/compare-<date>-<time>)")
    c.set_defaults(func=cmd_compare, command_parser=c)

    from optstack.cli.plan import add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``optstack`` command line; returns the exit status."""
    parser = build_parser()
    # Unknown options are reported by the subcommand's parser (argparse's default shows the top-level usage).
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ValueError as error:
        if os.environ.get("OPTSTACK_DEBUG"):
            raise
        print(f"optstack {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(f"\noptstack {args.command}: {interrupt or 'interrupted'}", file=sys.stderr)
        return 130
    except RuntimeError as error:
        from optstack.demo.launch import RankFailed

        if not isinstance(error, RankFailed) or os.environ.get("OPTSTACK_DEBUG"):
            raise
        # The failing rank's own traceback is in the message; the launcher's would only add noise.
        print(f"optstack {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
