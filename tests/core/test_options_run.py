"""``swapopt run`` reads its settings from the ``SWAPOPT_CONFIG`` file: a real subprocess.

An unmodified Accelerate script runs on the CPU through ``python -m swapopt_core run`` with
no ``SWAPOPT_*`` setting variable, only the file (``runtime: loopback``); the optimizer it
prepares is swapped with the file's settings and trains bit for bit as a plain twin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

SCRIPT = """
import copy, json
import torch
from accelerate import Accelerator
from swapopt_core import is_swap_optimizer
from swapopt_core._swap.engine import engine_of

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
twin = copy.deepcopy(model)
plain = torch.optim.Adam(twin.parameters(), lr=1e-2)
accelerator = Accelerator(cpu=True)
model, opt = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
for step in range(3):
    x = torch.randn(8, 64)
    for net, optimizer, backward in ((model, opt, accelerator.backward), (twin, plain, None)):
        loss = net(x).pow(2).mean()
        backward(loss) if backward else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
engine = engine_of(opt.optimizer)
print(json.dumps({
    "swapped": is_swap_optimizer(opt.optimizer),
    "plain_swapped": is_swap_optimizer(plain),
    "swap_times": engine.config.swap_times if engine else None,
    "runtime": engine.config.runtime if engine else None,
    "equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())),
}))
"""

CONFIG = """
trainer:            # another tool's section: left alone
  epochs: 1
swapopt:
  offload_optimizer_device: cpu
  runtime: loopback
  swap_times: 2
  min_numel: 0
"""


def _run(folder: Path, config: str) -> subprocess.CompletedProcess[str]:
    (folder / "train.py").write_text(textwrap.dedent(SCRIPT))
    (folder / "swapopt.yaml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWAPOPT_")}
    env.update(OMP_NUM_THREADS="1", SWAPOPT_CONFIG="swapopt.yaml")
    return subprocess.run(
        [sys.executable, "-m", "swapopt_core", "run", "train.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_swapopt_run_swaps_with_the_file_settings(tmp_path: Path) -> None:
    result = _run(tmp_path, CONFIG)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "swapped": True,
        "plain_swapped": False,
        "swap_times": 2,
        "runtime": "loopback",
        "equal": True,
    }
    assert "integrations on: " in result.stderr and "accelerate" in result.stderr


def test_swapopt_run_stops_on_a_bad_file_value_naming_file_and_key(tmp_path: Path) -> None:
    result = _run(tmp_path, CONFIG.replace("swap_times: 2", "swap_times: two"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "swapopt run: error: swapopt.yaml: swapopt.swap_times='two' is invalid; accepted: "
        "an integer >= 1."
    )
    assert result.stdout == ""  # the script never started
