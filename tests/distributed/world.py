"""A reusable gloo world for tests: N long-lived worker processes that run test functions on demand.

Starting processes and a gloo group costs seconds, so a session shares one world per size. A test sends a
top-level function (found again in the worker by file path and name) and its picklable arguments; every
rank runs it and the call returns the per-rank results, or raises with the failing rank's traceback. A
task that does not finish within its timeout fails the test and the world is torn down and rebuilt.
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_MODULE_CACHE: dict[str, Any] = {}


def _load(path: str, name: str) -> Callable[..., Any]:
    mod = _MODULE_CACHE.get(path)
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"_world_task_{len(_MODULE_CACHE)}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        _MODULE_CACHE[path] = mod
    return getattr(mod, name)


def _worker(rank: int, size: int, store_path: str, tasks: Any, results: Any, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["OPTSTACK_TEST_RANK"] = str(rank)
    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    while True:
        task = tasks.get()
        if task is None:
            break
        path, name, args, kwargs = task
        try:
            out = _load(path, name)(*args, **kwargs)
            results.put((rank, True, out))
        except BaseException:  # report everything, including assertion errors, with the traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """``size`` gloo ranks that run functions sent to them; see the module docstring."""

    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="optstack-world-")
        store = os.path.join(self._dir, "store")
        self._tasks = [ctx.Queue() for _ in range(size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, size, store, self._tasks[r], self._results, timeout_s), daemon=True)
            for r in range(size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        path = inspect.getfile(fn)
        for q in self._tasks:
            q.put((path, fn.__name__, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        limit = timeout_s if timeout_s is not None else self.timeout_s * 2
        while len(out) + len(errors) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=limit)
            except queue.Empty:
                self.broken = True
                missing = sorted(set(range(self.size)) - set(out) - set(errors))
                raise TimeoutError(
                    f"{fn.__name__}: ranks {missing} gave no result within {limit}s; errors so far: {errors}"
                ) from None
            (out if ok else errors)[rank] = value
        if errors:
            # A failed collective can leave the peers' gloo state inconsistent: rebuild the world.
            self.broken = True
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{msg}")
        return [out[r] for r in range(self.size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
