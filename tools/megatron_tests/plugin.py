"""pytest plugin (``-p plugin``): installs the shim before Megatron's test modules are imported.

Reads ``OPTSTACK_MEGATRON_SRC`` (the folder holding Megatron's ``megatron/`` package); with
``OPTSTACK_MEGATRON_STATS`` set, writes there (JSON) the process's peak thread count and resident memory, read
from ``/proc/self/status`` after every test, and the test at the thread peak; with ``OPTSTACK_MEGATRON_SEED`` set,
seeds torch with it before each test (Megatron's tests draw unseeded, so their values otherwise depend on the tests
run before them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import shim


def pytest_configure(config: Any) -> None:
    # Megatron's flag says whether the emerging optimizers can be built: the face implements them itself.
    shim.install(Path(os.environ["OPTSTACK_MEGATRON_SRC"]),
                 extra={"megatron.core.optimizer": {"HAVE_EMERGING_OPTIMIZERS": True}})
    for marker in ("internal", "flaky", "flaky_in_dev", "experimental", "failing_on_rocm"):
        config.addinivalue_line("markers", f"{marker}: Megatron's marker")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: Any) -> Any:
    seed = os.environ.get("OPTSTACK_MEGATRON_SEED")
    if seed is not None:
        import torch

        torch.manual_seed(int(seed))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    # The groups a test body makes (new_group, device meshes, Utils.initialize_model_parallel) end with it; those
    # of setup_class / fixtures end with Utils.destroy_model_parallel or the next initialize_model_parallel.
    # Kept, each gloo group's threads piled up to thousands per process over a file.
    before = shim.process_groups()
    yield
    shim.destroy_groups(keep=before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    # A test that asked for a tensor-parallel size > 1 carries the note into the junit file
    # (written from the teardown report): run.py reports its failure as out of scope.
    outcome = yield
    if call.when == "teardown":
        note = shim.take_out_of_scope()
        if note:
            outcome.get_result().user_properties.append(("out_of_scope", note))


_peak: dict[str, Any] = {"threads": 0, "rss_mb": 0.0, "at": "", "after_each": []}  # after_each: [test, threads]


def _status() -> tuple[int, float]:
    """(threads, VmRSS in MB) of this process, from /proc/self/status (0s where there is none)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    except OSError:
        return 0, 0.0
    return int(fields.get("Threads", "0")), int(fields.get("VmRSS", "0 kB").split()[0]) / 1024


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    threads, rss = _status()
    _peak["after_each"].append((nodeid.split("::", 1)[-1], threads))
    if threads > _peak["threads"]:
        _peak.update(threads=threads, at=nodeid)
    _peak["rss_mb"] = max(_peak["rss_mb"], rss)


def pytest_sessionfinish(session: Any, exitstatus: Any) -> None:
    path = os.environ.get("OPTSTACK_MEGATRON_STATS")
    if path:
        Path(path).write_text(json.dumps(_peak))
