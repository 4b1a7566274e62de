"""The planning library runs without torch: traces can be planned where torch is absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

# ``swapopt_core/__init__`` imports torch for the public API, so the package is stood in for
# by an empty one and only ``_planning`` is imported from it.
CHECK = f"""
import importlib, sys, types
package = types.ModuleType("swapopt_core")
package.__path__ = [{str(ROOT / "swapopt_core")!r}]
sys.modules["swapopt_core"] = package
for name in ("ir", "interface", "timed", "simulate", "bounds", "synthetic", "plugin"):
    importlib.import_module("swapopt_core._planning." + name)
from swapopt_core._planning.synthetic import SHAPES, llama_training_trace
from swapopt_core._planning.timed import TimedPlanner
trace = llama_training_trace(SHAPES["tiny"])
TimedPlanner().plan(trace.with_limit(trace.memory_limit_bytes))
assert "torch" not in sys.modules, "a planning module imported torch"
"""


def test_planning_imports_and_plans_without_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
