"""Puts tests/ on sys.path so test modules can share plain helper modules (e.g. ``optim_harness``).

pytest runs with ``--import-mode=importlib``, which does not add test directories to sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
