"""Run PyTorch's own optimizer tests against optstack.optim (CPU) and print pass / fail / skip per test and optimizer.

    python tools/torch_optim_tests/run.py --pytorch /path/to/pytorch
    python tools/torch_optim_tests/run.py --test-optim test_optim.py --test-lrscheduler test_lrscheduler.py
    python tools/torch_optim_tests/run.py --pytorch /path/to/pytorch -k state_dict --classes optstack

The two files (``test/test_optim.py``: its generic ``TestOptimRenewed`` tests over the OptimizerInfo database of
the installed torch; ``test/optim/test_lrscheduler.py``) are copied unedited into ``--work`` beside ``plugin.py``
as its conftest, which registers the classes under test (see its docstring). Each file runs twice, with torch's
own classes (``--classes torch``: the harness passes them) and with optstack's (``--classes optstack``), in
separate pytest processes; the table compares the two per test. ``test_optim.py`` imports two more files of its
folder that are not under test (``optim/test_optim.py``'s ``TestDifferentiableOptimizer``,
``optim/test_swa_utils.py``'s ``TestSWAUtils``); where they are not given, ``run.py`` writes empty stand-ins.
torch's test utilities need ``expecttest`` (``pip install expecttest``; ``--deps DIR`` adds a folder holding it
to the path). Not part of CI: the test files are not shipped with torch wheels.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Muon", "Lion")
_OPTIMIZER_IN_NAME = re.compile(r"_(" + "|".join(OPTIMIZERS) + r")(?=_cpu|$)")
_STANDINS = {
    "test_optim.py": "class TestDifferentiableOptimizer:  # stand-in: not under test here\n    pass\n",
    "test_swa_utils.py": "class TestSWAUtils:  # stand-in: not under test here\n    pass\n",
}


def lay_out(test_optim: Path | None, test_lrscheduler: Path | None, work: Path) -> dict[str, Path]:
    """Copy the test files (unedited) and the plugin into ``work``; the files to run, by label."""
    package = work / "optim"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    shutil.copyfile(HERE / "plugin.py", work / "conftest.py")
    out: dict[str, Path] = {}
    if test_lrscheduler is not None:
        shutil.copyfile(test_lrscheduler, package / "test_lrscheduler.py")
        out["test_lrscheduler.py"] = package / "test_lrscheduler.py"
    if test_optim is not None:
        for name, text in _STANDINS.items():
            sibling = test_optim.parent / "optim" / name
            if sibling.is_file():
                shutil.copyfile(sibling, package / name)
            elif not (package / name).exists():
                (package / name).write_text(text)
        if not (package / "test_lrscheduler.py").exists():
            (package / "test_lrscheduler.py").write_text("class TestLRScheduler:  # stand-in\n    pass\n")
        shutil.copyfile(test_optim, work / "test_optim.py")
        out["test_optim.py"] = work / "test_optim.py"
    return out


def run_pytest(path: Path, classes: str, work: Path, extra: list[str], deps: list[str], timeout: int
               ) -> Path:
    """One pytest process over ``path`` with ``classes``; returns its junit XML."""
    report = work / f"{path.stem}-{classes}.xml"
    env = dict(os.environ, OPTSTACK_TORCH_TESTS_CLASSES=classes, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(work), str(REPO / "src"), *deps, os.environ.get("PYTHONPATH", "")]))
    select = ["-k", "TestOptimRenewed"] if path.name == "test_optim.py" else []
    if extra:
        select = ["-k", " and ".join(f"({k})" for k in ([select[1]] if select else []) + extra)]
    cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "--rootdir", str(work),
           "-o", "addopts=", f"--junitxml={report}", *select]
    print(f"$ OPTSTACK_TORCH_TESTS_CLASSES={classes} {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    print("   " + "\n   ".join(tail), flush=True)
    return report


def results(report: Path) -> dict[str, tuple[str, str]]:
    """junit XML -> {test name: (outcome, short message)}."""
    if not report.is_file():
        return {}
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, message = "pass", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "fail", "error": "fail", "skipped": "skip"}[tag]
                message = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                break
        out[case.get("name", "")] = (outcome, message)
    return out


def split_name(name: str) -> tuple[str, str]:
    """A generated test name -> (the test without its optimizer, the optimizer or "-")."""
    match = _OPTIMIZER_IN_NAME.search(name)
    if match is None:
        return name, "-"
    return name[: match.start()] + name[match.end():], match.group(1)


def table(label: str, theirs: dict[str, tuple[str, str]], ours: dict[str, tuple[str, str]], verbose: bool) -> None:
    """Print the per-optimizer counts and every test whose optstack outcome is not torch's (or all with -v)."""
    print(f"\n== {label} ==")
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for side, found in (("torch", theirs), ("optstack", ours)):
        for name, (outcome, _) in found.items():
            counts[(split_name(name)[1], side)][outcome] += 1
    print(f"{'optimizer':<10} {'torch pass/fail/skip':>22} {'optstack pass/fail/skip':>25}")
    for optimizer in sorted({o for o, _ in counts}):
        cells = [counts[(optimizer, side)] for side in ("torch", "optstack")]
        torch_cell, ours_cell = (f"{c['pass']}/{c['fail']}/{c['skip']}" for c in cells)
        print(f"{optimizer:<10} {torch_cell:>22} {ours_cell:>25}")
    print(f"\n{'test':<88} {'torch':<6} {'optstack':<8} why (optstack)")
    for name in sorted(set(theirs) | set(ours), key=lambda n: split_name(n)[::-1]):
        t, o = theirs.get(name, ("-", ""))[0], ours.get(name, ("-", ""))
        if verbose or t != o[0]:
            print(f"{name:<88} {t:<6} {o[0]:<8} {o[1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pytorch", type=Path, help="a pytorch checkout (test/test_optim.py, test/optim/...)")
    parser.add_argument("--test-optim", type=Path, help="test/test_optim.py (instead of --pytorch)")
    parser.add_argument("--test-lrscheduler", type=Path, help="test/optim/test_lrscheduler.py")
    parser.add_argument("--classes", choices=("both", "torch", "optstack"), default="both")
    parser.add_argument("--work", type=Path, help="where to lay the files out (default: a temporary folder)")
    parser.add_argument("--deps", action="append", default=[], help="a folder to add to the path (e.g. expecttest)")
    parser.add_argument("-k", dest="keyword", action="append", default=[], help="pytest -k expression (and-ed)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every test, not only differences")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per pytest process")
    args = parser.parse_args(argv)
    test_optim, test_lrscheduler = args.test_optim, args.test_lrscheduler
    if args.pytorch is not None:
        test_optim = test_optim or args.pytorch / "test" / "test_optim.py"
        test_lrscheduler = test_lrscheduler or args.pytorch / "test" / "optim" / "test_lrscheduler.py"
    given = {"--test-optim": test_optim, "--test-lrscheduler": test_lrscheduler}
    missing = [f"{flag} {path}" for flag, path in given.items() if path is not None and not path.is_file()]
    if missing or not any(given.values()):
        parser.error(f"no such test file: {missing}" if missing else "pass --pytorch or --test-optim / "
                     "--test-lrscheduler")
    work = args.work or Path(tempfile.mkdtemp(prefix="torch-optim-tests-"))
    files = lay_out(test_optim, test_lrscheduler, work)
    sides = ("torch", "optstack") if args.classes == "both" else (args.classes,)
    for label, path in files.items():
        found = {side: results(run_pytest(path, side, work, args.keyword, args.deps, args.timeout)) for side in sides}
        table(label, found.get("torch", {}), found.get("optstack", {}), args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
