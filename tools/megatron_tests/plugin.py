"""pytest plugin (``-p plugin``): installs the shim before Megatron's test modules are imported.

Reads ``OPTSTACK_MEGATRON_SRC`` (the folder holding Megatron's ``megatron/`` package).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import shim


def pytest_configure(config) -> None:  # noqa: ANN001 (pytest's hook)
    # Megatron's flag says whether the emerging_optimizers package is installed; the face does not need it.
    have_emerging = importlib.util.find_spec("emerging_optimizers") is not None
    shim.install(Path(os.environ["OPTSTACK_MEGATRON_SRC"]),
                 extra={"megatron.core.optimizer": {"HAVE_EMERGING_OPTIMIZERS": have_emerging}})
    for marker in ("internal", "flaky", "flaky_in_dev", "experimental", "failing_on_rocm"):
        config.addinivalue_line("markers", f"{marker}: Megatron's marker")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201 (pytest's hook)
    # The groups a test makes (parallel_state, new_group, device meshes) end with it, the default group stays:
    # kept, each gloo group's threads piled up to thousands per process over a file. (A class- or module-scoped
    # fixture's groups would end after its first test; none of Megatron's files in scope has one.)
    before = shim.process_groups()
    yield
    shim.destroy_groups(keep=before)
