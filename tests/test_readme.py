"""The README's Python examples run as written (so the docs cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:  # later blocks build on earlier ones, as a reader would run them
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["result"].applied
