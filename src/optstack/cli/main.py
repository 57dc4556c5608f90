"""The ``optstack`` command: ``optstack groups`` (who gets which settings) and ``optstack train`` (the demo).

User errors (a bad flag value, an unknown config key, a missing data path, ...) print one message and exit
with status 2, without a traceback; set ``OPTSTACK_DEBUG=1`` to see the traceback anyway. Ctrl-C during
training exits with 130 and says how to resume.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["main", "build_parser", "load_model", "groups_report"]

DEFAULT_MODEL = "optstack.demo.gpt:build_demo_model"


# -- groups -----------------------------------------------------------------------------------------------
def load_model(spec: str) -> nn.Module:
    """Build a model from ``'package.module:factory'`` (the factory is called with no arguments)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like package.module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({error})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name!r} has no callable {attr!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def groups_report(model: nn.Module, config: Any) -> dict[str, Any]:
    """Per parameter and per group: what ``build_optimizer(config, model)`` gives, and which rules decided it.

    Args:
        model: the model.
        config: an ``optstack.config.OptimizerConfig``; the rules are ``factory.default_rules(config)``.

    Returns:
        ``{"config": {...}, "parameters": [...], "groups": [...]}`` of plain JSON values.
    """
    from optstack.factory import default_rules
    from optstack.groups import build_param_groups
    from optstack.rules import explain, resolve

    rules = default_rules(config)
    explained = explain(model, rules)
    groups = build_param_groups(model, resolve(model, rules), lr=config.lr, min_lr=config.min_lr)
    group_of = {name: i for i, g in enumerate(groups) for name in g["param_names"]}
    params = dict(model.named_parameters())
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
    for i, g in enumerate(groups):
        settings = {k: _plain(v) for k, v in g.items() if k not in ("params", "param_names")}
        settings.setdefault("algorithm", config.algorithm)
        summary.append({"group": i, "count": len(g["params"]), "numel": sum(p.numel() for p in g["params"]),
                        "settings": settings, "params": list(g["param_names"])})
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


# -- train ------------------------------------------------------------------------------------------------
def _train_overrides(args: argparse.Namespace) -> list[dict[str, Any]]:
    from optstack.demo.config import parse_override

    overrides = [parse_override(s) for s in args.set or []]
    flags = {  # shortcut flags, applied after --set
        ("optimizer", "algorithm"): args.optimizer, ("optimizer", "lr"): args.lr,
        ("train", "steps"): args.steps, ("train", "grad_accum"): args.grad_accum,
        ("train", "eval_every"): args.eval_every, ("train", "batch_size"): args.batch_size,
        ("train", "seed"): args.seed, ("data", "path"): args.data,
        ("optimizer", "precision"): "bf16" if args.bf16 else None,
    }
    for (section, key), value in flags.items():
        if value is not None:
            overrides.append({section: {key: value}})
    return overrides


def cmd_train(args: argparse.Namespace) -> int:
    from optstack.demo.config import config_to_dict, load_config, to_toml
    from optstack.demo.train import train

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc > 1:
        raise ValueError(
            f"--nproc {args.nproc}: multi-process training is not supported yet (it comes with the "
            "distributed layer); run with --nproc 1"
        )
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
    cfg = load_config(args.config, _train_overrides(args), base=base)
    if args.print_config:
        print(to_toml(config_to_dict(cfg)), end="")
        return 0
    out = args.out or f"runs/{cfg.optimizer.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.optimizer.precision == "bf16" and cfg.train.device != "cuda":
        import torch

        if not torch.cuda.is_available():
            print("note: bf16 on a CPU without native bf16 matmuls can be much slower than fp32",
                  file=sys.stderr)
    train(cfg, out, resume=args.resume, progress=args.progress)
    return 0


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
    g.set_defaults(func=cmd_groups)

    t = sub.add_parser("train", help="train the built-in small GPT on the Python stdlib's source",
                       description="Train the demo GPT. Settings: defaults, then --config FILE.toml, then "
                       "--set section.key=value (repeatable; sections model, data, train, schedule, "
                       "optimizer), then the shortcut flags below. Without an explicit lr, each optimizer "
                       "gets its own default (optimizer.lr), min_lr = lr / 10 and weight_decay 0.1.")
    t.add_argument("--config", help="TOML file with [model] [data] [train] [schedule] [optimizer] sections")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override any config field, e.g. --set optimizer.adam.beta2=0.95 (repeatable)")
    t.add_argument("--out", help="run directory (default runs/<optimizer>-<date>-<time>)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t.add_argument("--nproc", type=int, default=1, help="processes (only 1 for now)")
    t.add_argument("--optimizer", help="adamw | sgd | lion | muon (= optimizer.algorithm)")
    t.add_argument("--lr", type=float, help="peak learning rate (= optimizer.lr)")
    t.add_argument("--bf16", action="store_true", default=None, help="bf16 params, fp32 master weights")
    t.add_argument("--grad-accum", type=int, help="micro-batches per step (= train.grad_accum)")
    t.add_argument("--batch-size", type=int, help="sequences per micro-batch (= train.batch_size)")
    t.add_argument("--steps", type=int, help="optimizer steps (= train.steps)")
    t.add_argument("--eval-every", type=int, help="validation every N steps (= train.eval_every)")
    t.add_argument("--seed", type=int, help="= train.seed")
    t.add_argument("--data", help="a text file or folder to train on instead of the stdlib (= data.path)")
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config as TOML (a template for --config) and exit")
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    t.set_defaults(func=cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``optstack`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
