"""tools/megatron_tests/run.py's bookkeeping (pure: no pytest run, no Megatron source): a file that fails to collect
counts each of its tests as failed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "megatron_tests"))
import run  # noqa: E402

_SOURCE = '''
import pytest
import missing_module

@pytest.mark.parametrize("a", [1, 2, 3])
@pytest.mark.parametrize("b", ["x", "y"])
def test_grid(a, b):
    pass

@pytest.mark.parametrize("c", COMPUTED)
def test_computed(c):
    pass

class TestThing:
    def test_one(self):
        pass

    def helper(self):
        pass

class Helper:
    def test_not_collected(self):
        pass
'''

_JUNIT = '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" tests="2">
<testcase classname="" name="tests.unit_tests.test_bad" file="tests/unit_tests/test_bad.py" time="0">
<error message="collection failure">ImportError while importing test module
E   ModuleNotFoundError: No module named 'missing_module'</error></testcase>
<testcase classname="tests.unit_tests.test_good" name="test_ok" file="tests/unit_tests/test_good.py" time="0"/>
</testsuite></testsuites>'''


def test_static_tests_counts_functions_methods_and_literal_parametrize(tmp_path: Path) -> None:
    path = tmp_path / "test_bad.py"
    path.write_text(_SOURCE)
    tests = run.static_tests(path)
    assert len(tests) == 6 + 1 + 1  # 3 x 2 grid, a non-literal list counted once, one Test* method
    assert "TestThing::test_one" in tests and not any("not_collected" in t for t in tests)


def test_a_file_that_fails_to_collect_fails_all_its_tests(tmp_path: Path) -> None:
    (tmp_path / "tests" / "unit_tests").mkdir(parents=True)
    (tmp_path / "tests" / "unit_tests" / "test_bad.py").write_text(_SOURCE)
    xml = tmp_path / "rank0.xml"
    xml.write_text(_JUNIT)
    merged = run.outcomes([xml], tmp_path)
    bad = {k: v for k, v in merged.items() if k[0] == "tests/unit_tests/test_bad.py"}
    assert len(bad) == 8 and all(v[0] == "fail" and "missing_module" in v[1] for v in bad.values())
    table = run.table("ref", merged, [], verbose=False)
    assert "| tests/unit_tests/test_bad.py | 0 | 8 | 0 | 0 |" in table
    assert "| tests/unit_tests/test_good.py | 1 | 0 | 0 | 0 |" in table


_CUDA_JUNIT = '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2">
<testcase classname="tests.unit_tests.test_x" name="test_on_cuda" file="tests/unit_tests/test_x.py">
<failure message="assert False">&gt;  assert state["exp_avg"].is_cuda
E   assert False</failure></testcase>
<testcase classname="tests.unit_tests.test_x" name="test_values" file="tests/unit_tests/test_x.py">
<failure message="assert False">&gt;  assert torch.equal(a, b)
E   assert False</failure></testcase>
</testsuite></testsuites>'''


def test_a_cuda_placement_assertion_is_out_of_scope_and_other_failures_are_not(tmp_path: Path) -> None:
    xml = tmp_path / "rank0.xml"
    xml.write_text(_CUDA_JUNIT)
    merged = run.outcomes([xml])
    by_test = {test.split("::")[-1]: result for (_, test), result in merged.items()}
    assert by_test["test_on_cuda"][0] == "out" and "CUDA device" in by_test["test_on_cuda"][1]
    assert by_test["test_values"][0] == "fail"
