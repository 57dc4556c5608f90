"""The conftest ``run.py`` puts beside torch's test files: registers the optimizers under test as OptimizerInfo
entries of the installed torch's ``optim_db`` before the test files are imported, and for
``test_lrscheduler.py`` hands the tests optstack's classes. The test files themselves run unedited.

``OPTSTACK_TORCH_TESTS_CLASSES`` picks the classes:

- ``torch``: torch's own ``AdamW``, ``Adam``, ``SGD``, ``Muon`` with torch's own entries (proves the harness);
- ``optstack``: the same entries with ``optstack.optim``'s classes in place of torch's; an entry declares what the
  class supports, so ``differentiable`` (refused by optstack) leaves ``supported_impls``; plus an entry for
  ``optstack.optim.Lion`` (torch has no Lion).

Every other optimizer is dropped from ``optim_db`` (the tests iterate over it at import).
"""

from __future__ import annotations

import copy
import os

import torch
from torch.testing._internal import common_optimizers as db
from torch.testing._internal.common_optimizers import OptimizerInfo, OptimizerInput

CLASSES = os.environ.get("OPTSTACK_TORCH_TESTS_CLASSES", "optstack")
NAMES = ("AdamW", "Adam", "SGD", "Muon")


def _lion_inputs(device: object = None, dtype: object = None) -> list[OptimizerInput]:
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 1e-3}, desc="non-default lr"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(1e-3)}, desc="Tensor lr"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1}, desc="nonzero weight_decay"),
        OptimizerInput(params=None, kwargs={"betas": (0.95, 0.98)}, desc="non-default betas"),
    ]


def _entries() -> list[OptimizerInfo]:
    kept = [info for info in db.optim_db if info.optim_cls.__name__ in NAMES]
    if CLASSES == "torch":
        return kept
    if CLASSES != "optstack":
        raise ValueError(f"OPTSTACK_TORCH_TESTS_CLASSES must be 'torch' or 'optstack', got {CLASSES!r}")
    import optstack.optim

    out = []
    for info in kept:
        ours = copy.copy(info)
        ours.optim_cls = getattr(optstack.optim, info.optim_cls.__name__)
        ours.supported_impls = tuple(impl for impl in info.supported_impls if impl != "differentiable")
        out.append(ours)
    out.append(OptimizerInfo(optstack.optim.Lion, optim_inputs_func=_lion_inputs, supported_impls=("foreach",),
                             not_og_supported_flags=("foreach",), supports_complex=False))
    return out


db.optim_db[:] = _entries()  # in place: the test files import this list object


_PATCHED: list[str] = []


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ANN001
    """test_lrscheduler.py builds ``SGD`` / ``Adam`` by the names it imported: give it optstack's (its
    ``torch.optim.SGD(...)`` / ``optim.Adam(...)`` calls stay torch's)."""
    if CLASSES != "optstack":
        return
    import optstack.optim

    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] == "test_lrscheduler":
            for name in ("SGD", "Adam", "AdamW"):
                if getattr(module, name, None) is getattr(torch.optim, name):
                    setattr(module, name, getattr(optstack.optim, name))
                    _PATCHED.append(f"{module.__name__}.{name}")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    entries = ", ".join(f"{i.optim_cls.__module__}.{i.optim_cls.__name__}" for i in db.optim_db)
    terminalreporter.write_line(f"optim_db under test: {entries}")
    if _PATCHED:
        terminalreporter.write_line(f"optstack classes in place of: {', '.join(_PATCHED)}")
