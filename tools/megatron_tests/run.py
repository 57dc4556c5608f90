"""Run Megatron-LM's unit tests against optstack's Megatron face (CPU, gloo) and print a table per file.

    python tools/megatron_tests/run.py --ref core_v0.16.1 --ref HEAD
    python tools/megatron_tests/run.py --megatron-src /path/to/Megatron-LM --files test_optimizer.py -k chained
    python tools/megatron_tests/run.py --nproc 1 2 --files distributed/test_param_and_grad_buffer.py

Each ref is exported from the Megatron-LM git mirror (``git archive <ref> megatron tests/unit_tests``) into
``--work``; ``--megatron-src`` uses a checkout instead. The test files run unedited under ``shim.py`` (see its
docstring); with ``--nproc N`` as N gloo processes (a test passes when it passes on every rank). A failure is
reported as out of scope when the test asked for a tensor-parallel size > 1 (the shim notes it) or is listed
in ``OUT_OF_SCOPE``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# A Megatron-LM bare git dir (``git clone --bare``); set it once in the environment or pass --mirror.
MIRROR = os.environ.get("MEGATRON_LM_MIRROR") or None
FILES = ("test_optimizer.py", "test_optimizer_param_scheduler.py", "test_layer_wise_optimizer.py",
         "test_optimizer_cpu_offloading.py", "test_muon_optimizer.py", "test_lion_optimizer.py",
         "test_emerging_optimizers.py", "optimizer/",
         "distributed/test_param_and_grad_buffer.py", "distributed/test_distributed_data_parallel.py",
         "distributed/test_param_layout.py", "distributed/test_layer_wise_param_layout.py")
#: Failures out of scope (issue 14's acceptance: CUDA-only libraries, Megatron's model classes or internals,
#: tensor-parallel size > 1): test name fragment -> why.
OUT_OF_SCOPE = {
    "test_force_all_reduce_uses_correct_collective":
        "mocks Megatron's module-internal dist_reduce_scatter_func; optstack's collectives go through "
        "optstack.distributed.comm; force_all_reduce's result: tests/distributed/test_megatron_grad_sync.py",
    "TestNVFP4IndexMaps": "NVFP4 (CUDA-only FP4) through Megatron's internal _ParamAndGradBuffer constructor with "
                          "mocked module internals",
    "test_distrib_optimizer_grouped_quantized": "Transformer Engine's grouped quantized (FP8) weights through "
                                                "DistributedOptimizer's private helpers",
    "test_lion_import_error_without_package": "expects Emerging-Optimizers to be absent; the runner provides its "
                                              "modules (the face implements them), so it never is",
}
#: Failures out of scope by what failed (the reason's text) -> why: CUDA-only checks of a run that is on CPU.
OUT_OF_SCOPE_FAILURES = {
    ".is_cuda": "asserts that a tensor lies on a CUDA device, which a CPU run cannot satisfy (the test stops there)",
}


def export(mirror: Path, ref: str, work: Path) -> Path:
    """Megatron's ``megatron/`` and ``tests/unit_tests/`` at ``ref``, under ``work/<ref>``."""
    dest = work / ref.replace("/", "_")
    if not (dest / "megatron").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", f"--git-dir={mirror}", "archive", ref, "megatron", "tests/unit_tests"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def test_paths(src: Path, files: list[str]) -> tuple[list[Path], list[str]]:
    """The test files to run (a folder: its ``test_*.py``), and the names this ref lacks."""
    root = src / "tests" / "unit_tests"
    found, missing = [], []
    for name in files:
        path = root / name
        if path.is_dir():
            found += sorted(path.glob("test_*.py"))
        elif path.is_file():
            found.append(path)
        else:
            missing.append(name)
    return found, missing


def run_pytest(src: Path, paths: list[Path], nproc: int, extra: list[str], out: Path,
               seed: int | None = None) -> list[Path]:
    """pytest over ``paths`` in ``nproc`` gloo processes; returns each rank's junit XML."""
    env = {**os.environ, "OPTSTACK_MEGATRON_SRC": str(src), "NVIDIA_PYTORCH_VERSION": "25.09",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "WORLD_SIZE": str(nproc), "OPTSTACK_MEGATRON_STORE": str(out / "store"), "OMP_NUM_THREADS": "1"}
    if seed is not None:
        env["OPTSTACK_MEGATRON_SEED"] = str(seed)
    # NVIDIA_PYTORCH_VERSION: Megatron skips its layer-wise tests on the "LTS" containers (<= 25.05).
    xmls = [out / f"rank{rank}.xml" for rank in range(nproc)]
    procs = []
    for rank in range(nproc):
        # --noconftest: Megatron's conftest downloads data and needs its training package
        cmd = [sys.executable, "-m", "pytest", "-p", "plugin", "-p", "no:cacheprovider", "--import-mode=importlib",
               "--noconftest", "--continue-on-collection-errors", f"--rootdir={src}", "-q", "-rN",
               "-o", "junit_family=xunit1", f"--junitxml={xmls[rank]}", "--timeout=300", "--timeout-method=signal",
               *extra, *map(str, paths)]
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed with the process)
        stats = {"OPTSTACK_MEGATRON_STATS": str(out / f"rank{rank}.stats.json")}
        procs.append((subprocess.Popen(cmd, env={**env, **stats, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                       stdout=log, stderr=subprocess.STDOUT, cwd=src), log))
    for proc, log in procs:
        proc.wait()
        log.close()
    return xmls


def _reason(message: str, text: str) -> str:
    """The failure's first message line; for a bare ``assert False``, the asserting source line too."""
    first = message.splitlines()[0] if message else ""
    source = [line[1:].strip() for line in text.splitlines() if line.startswith(">")]
    if first.startswith("assert") and source:
        first = f"{source[-1]} -> {first}"
    return first[:200]


def _collection_error(case: ET.Element) -> tuple[Path, str] | None:
    """(the file, why) when ``case`` is pytest's report of a file that failed to collect, else None."""
    error = case.find("error")
    if error is None or not (error.get("message") or "").startswith("collection failure"):
        return None
    text = error.text or ""
    last = [line for line in text.splitlines() if line.startswith("E ")]
    why = f"collection failure: {last[-1][1:].strip() if last else ''}"[:200]
    return Path(case.get("file") or (case.get("name") or "").replace(".", "/") + ".py"), why


def static_tests(path: Path) -> list[str]:
    """The tests a file holds, counted from its source (it did not import): each ``test_*`` function and method
    of a ``Test*`` class, times the cases of its literal ``pytest.mark.parametrize`` lists (1 where not
    literal). Ids are ``Class::test[i]``."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return [f"{path.name}::(does not parse)"]

    def cases(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
        count = 1
        for deco in fn.decorator_list:
            if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("parametrize") and len(deco.args) > 1:
                try:
                    count *= max(1, len(ast.literal_eval(deco.args[1])))
                except (ValueError, TypeError, SyntaxError):
                    pass
        return count

    tests = []
    for node in tree.body:
        funcs = [(None, node)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else (
            [(node.name, f) for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test") else [])
        for owner, fn in funcs:
            if fn.name.startswith("test"):
                name = f"{owner}::{fn.name}" if owner else fn.name
                n = cases(fn)
                tests += [f"{name}[{i}]" for i in range(n)] if n > 1 else [name]
    return tests or [f"{path.name}::(no tests found)"]


def outcomes(xmls: list[Path], src: Path | None = None) -> dict[tuple[str, str], tuple[str, str]]:
    """(file, test) -> (pass | fail | skip | out, first line of the reason), merged over ranks (worst wins); a
    failure is "out" (of scope) when the shim noted why or ``OUT_OF_SCOPE`` lists the test. A file that failed
    to collect (under ``src``) counts each test its source holds as failed (``static_tests``)."""
    rank_of = {"pass": 0, "skip": 1, "fail": 2}
    merged: dict[tuple[str, str], tuple[str, str]] = {}
    notes: dict[tuple[str, str], str] = {}
    for xml in xmls:
        if not xml.exists():
            merged[(xml.name, "(no junit file: the rank crashed or timed out)")] = ("fail", "")
            continue
        for case in ET.parse(xml).iter("testcase"):
            file = case.get("classname", "").split(".")[0] + ".py"
            key = (case.get("file") or file, f"{case.get('classname', '')}::{case.get('name')}")
            result = ("pass", "")
            for child in case:
                if child.tag in ("failure", "error"):
                    result = ("fail", _reason(child.get("message") or "", child.text or ""))
                elif child.tag == "skipped":
                    result = ("skip", (child.get("message") or "")[:160])
            collection = _collection_error(case)
            if collection is not None:  # every test the file holds fails (not one entry, nor none)
                path, why = collection
                for test in static_tests(src / path if src else path):
                    merged[(str(path), test)] = ("fail", why)
                continue
            for prop in case.iter("property"):
                if prop.get("name") == "out_of_scope":
                    notes[key] = f"out of scope ({prop.get('value')})"
            if key not in merged or rank_of[result[0]] > rank_of[merged[key][0]]:
                merged[key] = result
    for key, (result, why) in merged.items():
        listed = next((w for name, w in OUT_OF_SCOPE.items() if name in key[1]), None) or next(
            (w for text, w in OUT_OF_SCOPE_FAILURES.items() if text in why), None)
        if result == "fail" and (key in notes or listed):
            merged[key] = ("out", notes.get(key) or listed or why)
    return merged


def table(ref: str, merged: dict[tuple[str, str], tuple[str, str]], missing: list[str], verbose: bool) -> str:
    per_file: dict[str, dict[str, int]] = defaultdict(lambda: {"pass": 0, "fail": 0, "skip": 0, "out": 0})
    for (file, _), (result, _) in merged.items():
        per_file[file][result] += 1
    lines = [f"## {ref}", "", "| file | pass | fail | skip | out of scope |", "|---|---:|---:|---:|---:|"]
    for file in sorted(per_file):
        c = per_file[file]
        lines.append(f"| {file} | {c['pass']} | {c['fail']} | {c['skip']} | {c['out']} |")
    lines += [f"| {name} | - | - | - | - | (not in this ref)" for name in missing]
    if verbose:  # failures and skips, one line per file and reason (parametrized cases counted together)
        reasons: dict[tuple[str, str, str], list[str]] = defaultdict(list)
        for (file, test), (result, why) in merged.items():
            if result != "pass":
                reasons[(file, result, why)].append(test.split("::")[-1])
        lines.append("")
        for (file, result, why), tests in sorted(reasons.items()):
            names = ", ".join(sorted(tests)[:3]) + (f", ... ({len(tests)})" if len(tests) > 3 else "")
            lines.append(f"- {result.upper()} {Path(file).name}: {names}: {why}")
    return "\n".join(lines)


def peaks(out: Path, nproc: int) -> str:
    """Each rank's peak threads and resident memory (``plugin.py``'s stats), one line."""
    parts = []
    for rank in range(nproc):
        path = out / f"rank{rank}.stats.json"
        if path.exists():
            stats = json.loads(path.read_text())
            parts.append(f"rank {rank}: {stats['threads']} threads (at {stats['at'].split('::')[-1] or '-'}), "
                         f"{stats['rss_mb']:.0f} MB RSS")
    return "peak per process: " + ("; ".join(parts) if parts else "(no stats)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", action="append", help="Megatron-LM git ref (repeatable); default core_v0.16.1")
    parser.add_argument("--megatron-src", type=Path, help="a Megatron-LM checkout to use instead of the mirror")
    parser.add_argument("--mirror", type=Path, default=MIRROR,
                        help="Megatron-LM bare git dir (default: $MEGATRON_LM_MIRROR)")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="paths under tests/unit_tests")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1],
                        help="gloo processes, one run per value (default 1)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "optstack-megatron-tests")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--seed", type=int, help="seed torch before each test (default: unseeded, as Megatron's CI)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every failure and skip with its reason")
    args = parser.parse_args()
    if args.megatron_src is None and args.mirror is None:
        parser.error("no Megatron-LM source: pass --mirror DIR (a bare git clone), set MEGATRON_LM_MIRROR, "
                     "or pass --megatron-src CHECKOUT")
    sources = [("checkout", args.megatron_src.resolve())] if args.megatron_src else [
        (ref, export(args.mirror, ref, args.work)) for ref in (args.ref or ["core_v0.16.1"])]
    for ref, src in sources:
        paths, missing = test_paths(src, args.files)
        for nproc in args.nproc:
            out = Path(tempfile.mkdtemp(prefix=f"run{nproc}-", dir=args.work if args.work.is_dir() else None))
            xmls = run_pytest(src, paths, nproc, ["-k", args.k] if args.k else [], out, args.seed) if paths else []
            print(table(f"{ref}, {nproc} process{'es' if nproc > 1 else ''}", outcomes(xmls, src), missing,
                        args.verbose))
            print(f"\n{peaks(out, nproc)}\n(pytest logs: {out})\n")


if __name__ == "__main__":
    main()
