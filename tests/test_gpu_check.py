"""benchmarks/gpu_check.py without a GPU: it refuses in one line with exit status 2, and its check functions
(device vs CPU) run on CPU, where they pass, and fail when the runs differ."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from optstack import OptimizerConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_refuses_without_cuda_in_one_line(gpu_check, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # in-process (the script ends in sys.exit(main())): a subprocess would cost a second torch import
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--cpu-dry-run" in lines[0]


def test_checks_pass_on_cpu(gpu_check) -> None:
    checks = [gpu_check.check_fp16_dynamic_scaling(CPU), gpu_check.check_muon(CPU), gpu_check.check_muon_bf16(CPU),
              gpu_check.check_checkpoint(CPU)]
    for check in checks:
        assert check.ok, check
    fp16 = checks[0]
    assert fp16.note.startswith("applied, scale per step: 1,65536 1,65536 0,32768")  # the poisoned step skipped


def test_a_differing_run_fails_its_check(gpu_check) -> None:
    adamw, _, _ = gpu_check.train(OptimizerConfig(algorithm="adamw", lr=1e-2), CPU, steps=2)
    lion, _, _ = gpu_check.train(OptimizerConfig(algorithm="lion", lr=1e-2), CPU, steps=2)
    assert gpu_check.change_diff(adamw, adamw) == 0.0
    assert not gpu_check.Check("adamw vs lion", gpu_check.change_diff(lion, adamw), 1e-4).ok
    failed = gpu_check._guarded("boom", lambda: 1 / 0)
    assert not failed.ok and "ZeroDivisionError" in failed.error
