"""The core's import rules: neutral modules never import a backend at import time, and
swapping a torch optimizer imports nothing of MindSpore."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import swapopt_core

CORE = Path(swapopt_core.__file__).parent
#: Framework-neutral modules: every backend and subpackage may import them, not the reverse.
NEUTRAL = (
    "_api",
    "_config",
    "_device/__init__",
    "_device/accelerator",
    "_device/interface",
    "_device/lanes",
    "_device/loopback",
    "_device/loopback_async",
    "_device/pinned",
    "_device/plugin",
    "_device/registry",
    "_errors",
    "_options",
    "_plugins",
    "_stats",
    "_swap/__init__",
    "_swap/costs",
    "_swap/engine",
    "_swap/layout",
    "_swap/ledger",
    "_swap/ops",
    "_planning/partition",
    "_swap/pipeline",
    "_planning/resident",
    "_swap/staging",
    "_swap/step",
    "_swap/undo",
    "hookspecs",
)
#: What lies above the neutral core: the backends, the activation runtime and the CLI.
UPPER = ("_torch", "_mindspore", "_activations", "_cli")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, *, top_level: bool) -> list[tuple[int, str]]:
    """``(line, module)`` of every import, skipping ``if TYPE_CHECKING:`` blocks.

    With ``top_level``, only imports that run when the module is imported (not inside a
    function or class body).
    """
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_stmt(stmt)
                continue
            visit_stmt(child)

    def visit_stmt(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
        elif top_level and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return
        visit(node)

    visit(tree)
    return found


def _upward(module: str) -> bool:
    return any(
        module == f"swapopt_core.{up}" or module.startswith(f"swapopt_core.{up}.") for up in UPPER
    )


@pytest.mark.parametrize("name", NEUTRAL)
def test_neutral_modules_import_no_backend_at_import_time(name: str) -> None:
    tree = ast.parse((CORE / f"{name}.py").read_text())
    # _api and _plugins dispatch to the backends, so they may import one on first use.
    lazy_allowed = name in ("_api", "_plugins")
    imports = _imports(tree, top_level=lazy_allowed)
    assert [(line, m) for line, m in imports if _upward(m)] == []


def test_a_module_level_upward_import_is_caught() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from swapopt_core._torch.state import Slot\n"
        "from swapopt_core._mindspore.engine import MindSporeSwapEngine\n"
        "def lazy():\n    import swapopt_core._torch.engine\n"
    )
    upward = [m for _, m in _imports(tree, top_level=True) if _upward(m)]
    assert upward == ["swapopt_core._mindspore.engine"]
    upward = [m for _, m in _imports(tree, top_level=False) if _upward(m)]
    assert upward == ["swapopt_core._mindspore.engine", "swapopt_core._torch.engine"]


_SWAP_A_TORCH_OPTIMIZER = """
import json, sys
import torch
from swapopt_core import SwapOptimizerConfig, get_plugin_manager, swap_optimizer, swap_stats

get_plugin_manager()
param = torch.nn.Parameter(torch.zeros(4096))
opt = torch.optim.Adam([param])
swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback"))
param.grad = torch.ones(4096)
opt.step()
assert swap_stats(opt).steps == 1
print(json.dumps(sorted(m for m in sys.modules if "mindspore" in m)))
"""


def test_swapping_a_torch_optimizer_imports_no_mindspore() -> None:
    env = {**os.environ, "SWAPOPT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _SWAP_A_TORCH_OPTIMIZER],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    # The MindSpore plugin (runtimes, families) is registered, but neither MindSpore itself
    # nor the MindSpore engine is imported for a torch optimizer.
    assert "swapopt_core._mindspore.plugin" in loaded
    assert [m for m in loaded if not m.startswith("swapopt_core._mindspore")] == []
    assert "swapopt_core._mindspore.engine" not in loaded


_IMPORT_WATCHED = """
import json, os, sys, warnings

read = []


class Watched(type(os.environ)):
    def __getitem__(self, key):
        # Who asked: the first caller outside os and the mapping mixins (torch's imports walk
        # the whole environment; only swapopt's own reads count).
        frame = sys._getframe(1)
        while frame.f_code.co_filename.startswith("<frozen") or frame.f_globals.get(
            "__name__"
        ) == "os":
            frame = frame.f_back
        if frame.f_globals.get("__name__", "").startswith("swapopt"):
            read.append(key)
        return super().__getitem__(key)


env = os.environ
os.environ = Watched(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
with warnings.catch_warnings(record=True) as at_import:
    warnings.simplefilter("always")
    import swapopt_core
read_at_import = sorted(set(read))
with warnings.catch_warnings(record=True) as at_first_use:
    warnings.simplefilter("always")
    swapopt_core.get_plugin_manager()
print(json.dumps({
    "read_at_import": read_at_import,
    "warned_at_import": [str(w.message) for w in at_import],
    "warned_at_first_use": [str(w.message) for w in at_first_use],
    "read_at_first_use": "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE" in read,
}))
"""


def test_importing_reads_no_environment_and_warns_only_on_first_use() -> None:
    env = {
        **os.environ,
        "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "SWAPOPT_ACTIVATION_BUDGET_MB": "64",
        "SWAPOPT_DISABLE_PLUGIN_AUTOLOAD": "1",
        "SWAPOPT_LOOPBACK_GBPS": "1",
    }
    env.pop("SWAPOPT_RUN", None)
    env.pop("LOCAL_RANK", None)
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_WATCHED],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["read_at_import"] == []
    assert seen["warned_at_import"] == []
    assert seen["read_at_first_use"]
    assert [m for m in seen["warned_at_first_use"] if "swapopt run" in m] != []
