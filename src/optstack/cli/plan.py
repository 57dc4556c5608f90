"""``optstack plan``: the ``ParamPlan`` of a model at a given scale, and what it costs per rank.

The model is built on the meta device (no memory, no initialisation): a preset of Llama-like shapes or any
``package.module:factory``. Nothing is launched; the plan is the one every rank would compute.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PRESETS", "LlamaShape", "add_plan_parser", "cmd_plan", "llama_like", "plan_for"]


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-like decoder: grouped-query attention, SwiGLU MLP (or ``experts`` of them), RMSNorm, untied output."""

    hidden: int
    layers: int
    ffn: int
    kv: int
    vocab: int
    experts: int = 0


#: name -> shape; 110b has 795 tensors (88 layers x 9 + 3), as in the scale figures of the issue tracker
PRESETS: dict[str, LlamaShape] = {
    "7b": LlamaShape(hidden=4096, layers=32, ffn=11008, kv=4096, vocab=32000),
    "70b": LlamaShape(hidden=8192, layers=80, ffn=28672, kv=1024, vocab=128256),
    "110b": LlamaShape(hidden=10240, layers=88, ffn=32768, kv=1024, vocab=128256),
    "moe": LlamaShape(hidden=4096, layers=32, ffn=14336, kv=1024, vocab=32000, experts=8),
}


def llama_like(shape: LlamaShape, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "meta") -> nn.Module:
    """The model of ``shape`` (parameters only: it is planned, never run). Embedding and output carry
    ``is_embedding_or_output_parameter``; expert weights carry ``allreduce = False`` (Megatron's convention)."""
    h = shape.hidden
    with torch.device(device):
        model = nn.Module()
        model.embed = nn.Embedding(shape.vocab, h, dtype=dtype)
        model.layers = nn.ModuleList()
        for _ in range(shape.layers):
            block = nn.Module()
            block.q = nn.Linear(h, h, bias=False, dtype=dtype)
            block.k = nn.Linear(h, shape.kv, bias=False, dtype=dtype)
            block.v = nn.Linear(h, shape.kv, bias=False, dtype=dtype)
            block.o = nn.Linear(h, h, bias=False, dtype=dtype)
            mlps = nn.ModuleList()
            for _ in range(max(1, shape.experts)):
                mlp = nn.Module()
                mlp.gate = nn.Linear(h, shape.ffn, bias=False, dtype=dtype)
                mlp.up = nn.Linear(h, shape.ffn, bias=False, dtype=dtype)
                mlp.down = nn.Linear(shape.ffn, h, bias=False, dtype=dtype)
                mlps.append(mlp)
            if shape.experts:
                block.router = nn.Linear(h, shape.experts, bias=False, dtype=dtype)
                block.experts = mlps
                for p in mlps.parameters():
                    p.allreduce = False
            else:
                block.mlp = mlps[0]
            block.attn_norm = nn.RMSNorm(h, dtype=dtype)
            block.mlp_norm = nn.RMSNorm(h, dtype=dtype)
            model.layers.append(block)
        model.norm = nn.RMSNorm(h, dtype=dtype)
        model.output = nn.Linear(h, shape.vocab, bias=False, dtype=dtype)
    model.embed.weight.is_embedding_or_output_parameter = True
    model.output.weight.is_embedding_or_output_parameter = True
    return model


def plan_for(model: nn.Module, config: Any, *, dp: int, ep: int = 1, rank: int = 0) -> Any:
    """The plan ``wrap_data_parallel`` + ``build_optimizer`` would use for ``model`` at data-parallel ``dp``."""
    from optstack.factory import default_rules
    from optstack.names import named_parameters
    from optstack.plan import ParamPlan, Topology, specs_of
    from optstack.rules import resolve

    named = named_parameters(model)
    if not named:
        raise ValueError("the model has no trainable parameters")
    grad_dtype = None
    if config.distributed.grad_dtype:
        from optstack.config import dtype_from_name

        grad_dtype = dtype_from_name(config.distributed.grad_dtype, "distributed.grad_dtype")
    return ParamPlan.build(config, specs_of(named), resolve(named, default_rules(config)),
                           Topology(dp=dp, rank=rank, ep=ep), grad_dtype=grad_dtype)


def _config(args: argparse.Namespace) -> Any:
    from optstack.demo.config import load_config, parse_override

    overrides = [{"optimizer": {"algorithm": args.algorithm, "precision": args.precision,
                                "distributed": {"sharding": args.sharding}}}]
    for text in args.set or []:
        key = text if text.startswith("optimizer.") else f"optimizer.{text}"
        overrides.append(parse_override(key))
    return load_config(None, overrides).optimizer


def cmd_plan(args: argparse.Namespace) -> int:
    from optstack.plan_report import format_report, report

    if args.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {args.dp}")
    config = _config(args)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.precision]
    if args.model:
        from optstack.cli.models import load_model

        with torch.device("meta"):
            model = load_model(args.model)
        model = model.to(dtype) if config.precision != "fp32" else model
    else:
        model = llama_like(PRESETS[args.preset], dtype)
    plan = plan_for(model, config, dp=args.dp, ep=args.ep)
    rep = report(plan, config)
    ranks = None if args.ranks is None else [int(r) for r in args.ranks.split(",")]
    if ranks is not None and any(not 0 <= r < args.dp for r in ranks):
        raise ValueError(f"--ranks must name ranks in [0, {args.dp}), got {args.ranks!r}")
    if args.json:
        print(json.dumps(rep.as_dict(ranks if ranks is not None else sorted({0, args.dp - 1, rep.most().rank})),
                         indent=2))
    else:
        print(format_report(rep, ranks))
    return 0


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="who holds and steps what at a given scale, and what it costs per rank",
                       description="Plan a model (a preset of Llama-like shapes, or --model package.module:factory "
                       "built on the meta device) for a data-parallel size, and print per rank the bytes of "
                       "parameters, gradients, masters and optimizer state, buckets and padding, communication "
                       "per step and the owner balance of whole-matrix algorithms (Muon).")
    p.add_argument("--preset", choices=sorted(PRESETS), default="7b", help="Llama-like shapes (default 7b)")
    p.add_argument("--model", help="package.module:factory instead of a preset (built on the meta device)")
    p.add_argument("--dp", type=int, default=8, help="data-parallel size (default 8)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    p.add_argument("--algorithm", default="adamw", help="adamw | muon | ... (= optimizer.algorithm)")
    p.add_argument("--sharding", choices=("replicated", "zero1", "layerwise"), default="zero1")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override an optimizer config field, e.g. --set distributed.bucket_size=100000000")
    p.add_argument("--ranks", help="comma-separated ranks to print (default: first, last, and the one holding most)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan, command_parser=p)
