"""Stable parameter names: model chunks, modules, ``parameters()`` or ``(name, tensor)`` pairs -> one ordered list.

The one naming function of optstack (factory, rules, checkpoints and the Megatron face), so a name means the
same tensor everywhere: the user's own model's names, whatever wraps it (data-parallel wrappers and
``torch.compile``, ``look_through``). Imports nothing else of optstack::

    named_parameters(torch.compile(model)) == named_parameters(model)  # same names, same tensors
    named_parameters([chunk0, chunk1])      # Megatron's virtual pipeline chunks
    named_parameters(model.parameters())    # [("param.0", p0), ("param.1", p1), ...]
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import nn

__all__ = ["NamedParams", "named_parameters", "model_state", "look_through"]

#: What names can be taken from: a module, model chunks (a list of modules), ``(name, tensor)`` pairs, or bare
#: tensors (``model.parameters()``).
NamedParams = nn.Module | Iterable[nn.Module] | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor]

_WRAPPER_ATTRS = ("_orig_mod", "module")  # torch.compile's OptimizedModule; data-parallel style wrappers


def look_through(module: nn.Module) -> nn.Module:
    """The model inside any stack of wrappers: modules whose only child is ``_orig_mod`` or ``module`` and that
    hold no parameters or buffers of their own (a model with a ``module`` submodule beside other state is none).
    """
    while True:
        children = module._modules
        if len(children) != 1 or next(module.parameters(recurse=False), None) is not None \
                or next(module.buffers(recurse=False), None) is not None:
            return module
        attr, inner = next(iter(children.items()))
        if attr not in _WRAPPER_ATTRS or not isinstance(inner, nn.Module):
            return module
        module = inner


def _clean(name: str) -> str:
    # Compiled submodules (model.block = torch.compile(model.block)) put `_orig_mod` inside names too.
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def named_parameters(model_chunks: NamedParams, *, trainable_only: bool = True) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs in model order, under stable names; a tied tensor is kept once, under its first name.

    Args:
        model_chunks: a module (looked through, ``look_through``); a list of modules (model chunks), each looked
            through, every name prefixed with ``chunk{i}.`` only when some name occurs in two chunks;
            ``(name, tensor)`` pairs, kept as given; or bare tensors (``model.parameters()``), named
            ``param.{i}`` by position, frozen ones included. ``_orig_mod`` components are dropped everywhere.
        trainable_only: leave out parameters with ``requires_grad=False`` (after naming, so names do not depend
            on what is frozen).

    Raises:
        ValueError: two different tensors under one name, or items that are none of the above.
    """
    named: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in _pairs(model_chunks):
        if id(p) in seen:
            continue
        if (name := _clean(name)) in named:
            raise ValueError(f"two different tensors are named {name!r}; parameter names must be unique")
        named[name] = p
        seen.add(id(p))
    return [(n, p) for n, p in named.items() if p.requires_grad or not trainable_only]


def _pairs(source: NamedParams) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, nn.Module):
        return list(look_through(source).named_parameters())
    if isinstance(source, torch.Tensor):
        raise TypeError(f"params must be an iterable of tensors, (name, tensor) pairs or modules, got a single "
                        f"{torch.typename(source)} of shape {tuple(source.shape)}; pass [tensor]")
    items = list(source)
    if items and all(isinstance(m, nn.Module) for m in items):
        chunks = [list(look_through(m).named_parameters()) for m in items]
        names = [_clean(n) for chunk in chunks for n, _ in chunk]
        if len(set(names)) != len(names):
            chunks = [[(f"chunk{i}.{n}", p) for n, p in chunk] for i, chunk in enumerate(chunks)]
        return [pair for chunk in chunks for pair in chunk]
    if all(isinstance(t, torch.Tensor) for t in items):
        # torch.optim's warning for a tensor listed twice (tied weights come as modules or (name, tensor) pairs,
        # whose second name is expected)
        if len({id(t) for t in items}) != len(items):
            warnings.warn("optimizer contains a parameter group with duplicate parameters; in future, this will "
                          "cause an error; see github.com/pytorch/pytorch/issues/40967 for more information "
                          "(optstack keeps each parameter once)", UserWarning, stacklevel=3)
        return [(f"param.{i}", t) for i, t in enumerate(items)]
    for item in items:
        if isinstance(item, Mapping) and "params" in item:
            settings = ", ".join(repr(k) for k in item if k != "params") or "none"
            raise ValueError(
                f"got torch-style param groups (dicts with 'params'; settings {settings}): optstack makes the groups "
                "itself, from rules over parameter names. Pass the model, and say per parameter what differs with "
                "rules, e.g. build_optimizer(config, model, rules=default_rules(config) + [Rule(Name('head.*'), "
                "lr_mult=0.1, why='slower head')]) (settings: lr_mult, max_lr, min_lr, wd_mult, algorithm, ...); "
                "explain(model, rules) shows who gets what. For torch's own constructor over param-group dicts "
                "(AdamW(param_groups, lr=...)) use optstack.optim")
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(
                "expected an nn.Module, a list of nn.Modules, (name, tensor) pairs or tensors "
                f"(model.parameters()); got item {item!r:.80}"
            )
    return items


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` tensors (parameters, buffers) under the names ``named_parameters`` uses, so a
    checkpoint of a compiled or wrapped model has the plain model's keys. The tensors are detached and share
    the model's storage (writing into them writes the model); non-tensor extra state is left out.

    Raises:
        ValueError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    state = look_through(model).state_dict()
    return {_clean(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
