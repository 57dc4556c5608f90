"""The README's Python examples run as written (so the docs cannot drift from the code), each on its own: a reader
copies one block into a file and runs it, so each ```python block runs as a separate script in a fresh
interpreter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# Appended to each block: what the test reads back (the block's own text is run unchanged before it).
_REPORT = ("\nimport json as _json\n"
           "print(_json.dumps({'applied': bool(result.applied) if 'result' in globals() else None}))\n")


def _run_alone(block: str, tmp_path: Path) -> dict:
    script = tmp_path / "block.py"
    script.write_text(block + _REPORT)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, f"README block failed when run alone:\n{block}\n--- stderr ---\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_readme_python_blocks_run():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_readme_python_block_runs_alone(index: int, tmp_path: Path) -> None:
    report = _run_alone(BLOCKS[index], tmp_path)
    if index == 0:  # the first example trains: its last step was applied
        assert report["applied"]


def test_readme_states_prerequisites_and_what_the_demo_time_depends_on():
    text = README.read_text()
    two_commands = text[text.index("## The two commands"):text.index("## Using it")]
    assert "`make`" in two_commands and "python3-venv" in two_commands
    assert "about 3 minutes" not in text
    assert "4 min 16 s on a quiet 2-core machine" in two_commands and "number and speed of" in two_commands


def test_pyproject_license_is_an_spdx_expression():
    # A table (license = {text = ...}) makes setuptools >= 77 warn on every install that it is deprecated.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert any(req.replace(" ", "").startswith("setuptools>=77") for req in project["build-system"]["requires"])
