"""torch.optim's constructors over optstack: ``optstack.optim.AdamW`` for ``torch.optim.AdamW`` is a one-line
change that brings optstack's kernels, fp32 masters for bf16/fp16 parameters, clipping and state format.

Each class is a ``ChainedOptimizer`` (a ``torch.optim.Optimizer``) over one replicated stage; torch's
signatures, defaults, per-group options, ``state_dict`` format and hooks hold (README: "It is a
torch.optim.Optimizer" lists what differs). For distributed placements (ZeRO-1, layer-wise), rules and
schedules, build through ``optstack.build_optimizer``.
"""

from optstack.optim.optimizers import SGD, Adam, AdamW, Lion, Muon

__all__ = ["SGD", "Adam", "AdamW", "Lion", "Muon"]
