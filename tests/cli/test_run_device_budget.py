"""``SWAPOPT_DEVICE_BUDGET_MB`` reaches a plain ``accelerate.Accelerator()`` under ``swapopt
run``, for real: an unmodified script in a subprocess, on the CPU with the loopback runtimes.

Each training step (an accumulation window of two micro-batches) runs in the whole-step
session, ending with the same bits as the script without swapopt and within the budget; a
budget the step cannot fit in stops the script with the budget's error, which names the
variable; a script whose optimizer Accelerate never prepared trains on and is told, in a
warning and in the run summary, that the budget was not applied.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.cli.test_run import SWAPOPT, _run, _script

pytest.importorskip("accelerate")

# Unmodified: a plain Accelerator, accumulation of two micro-batches, no swapopt API.
SCRIPT = """
import sys
import torch
from accelerate import Accelerator

out, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
layers = [torch.nn.Linear(32, 256), torch.nn.GELU()]
for _ in range(3):
    layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
if mode == "model-only":  # the optimizer it steps never goes through prepare()
    model = accelerator.prepare(model)
else:
    model, opt = accelerator.prepare(model, opt)
gen = torch.Generator().manual_seed(1)
for step in range(6):
    x, y = torch.randn(512, 32, generator=gen), torch.randn(512, 1, generator=gen)
    with accelerator.accumulate(model):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
torch.save(model.state_dict(), out)
print("trained")
"""

BUDGET_ENV = {
    "SWAPOPT_RUNTIME": "loopback",
    "SWAPOPT_ACTIVATION_RUNTIME": "loopback",
    "SWAPOPT_MIN_NUMEL": "0",
}
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _budget_run(tmp_path: Path, budget: str, mode: str = "full"):
    script = str(_script(tmp_path, SCRIPT))
    env = {**BUDGET_ENV, "SWAPOPT_DEVICE_BUDGET_MB": budget}
    return _run([str(SWAPOPT), "run", script, str(tmp_path / "swap.pt"), mode], tmp_path, **env)


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def test_plain_accelerator_trains_each_step_under_the_budget(tmp_path: Path) -> None:
    script = str(_script(tmp_path, SCRIPT))
    plain = _run([sys.executable, script, str(tmp_path / "plain.pt"), "full"], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    done = _budget_run(tmp_path, "5")
    assert done.returncode == 0, done.stderr[-3000:]
    # One whole-step session ran the loop; its measured peak keeps to the budget, and the
    # activations that did not fit went to host memory and back.
    (line,) = [x for x in done.stderr.splitlines() if "activations (OffloadSession 1)" in x]
    peak = re.search(r"whole-step device peak (\d+\.?\d* [KMG]?i?B)", line)
    assert peak is not None, line
    assert 0 < _bytes(peak.group(1)) <= 5 * 2**20
    moved = re.search(r"(\d+\.?\d* [KMG]?i?B) out", line)
    assert moved is not None and _bytes(moved.group(1)) > 0, line
    assert "NOT applied" not in done.stderr
    plain_state = torch.load(tmp_path / "plain.pt")
    swapped_state = torch.load(tmp_path / "swap.pt")
    for name, value in plain_state.items():
        assert torch.equal(value, swapped_state[name]), name


def test_plain_accelerator_refuses_a_budget_too_small(tmp_path: Path) -> None:
    done = _budget_run(tmp_path, "0.3")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "trained" not in done.stdout
    error = done.stderr[done.stderr.index("Traceback") :]
    # The budget's error (a ValueError; BudgetTooSmall is one) with the floor and the fix...
    assert re.search(r"(ValueError|BudgetTooSmall): OffloadConfig\.device_budget_mb=0\.3 ", error)
    assert "cannot hold the step" in error and "Raise device_budget_mb" in error
    # ... naming the variable that set it.
    assert "SWAPOPT_DEVICE_BUDGET_MB=0.3 (MiB) here: raise that variable" in error


def test_optimizer_not_prepared_is_told_the_budget_is_not_applied(tmp_path: Path) -> None:
    done = _budget_run(tmp_path, "0.3", mode="model-only")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout
    why = "no optimizer was prepared before the model's first training forward"
    warning = "swapopt: the device budget SWAPOPT_DEVICE_BUDGET_MB=0.3 is not applied: " + why
    assert done.stderr.count(warning) == 1, done.stderr
    summary = done.stderr[done.stderr.index("what swapopt did in this process") :]
    assert f"  device budget NOT applied, SWAPOPT_DEVICE_BUDGET_MB=0.3: {why}" in summary
