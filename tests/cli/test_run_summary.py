"""``swapopt run`` says what happened: the line on what the settings ask for, and the summary
at exit whose figures are the ``swap_stats`` / ``OffloadSession.stats()`` figures the script
itself printed. Real subprocesses: plain torch, a real Accelerator and a real Lightning
Trainer on CPU with ``SWAPOPT_RUNTIME=loopback``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats, unswap_optimizer
from swapopt_core._cli.run_summary import MAX_LINES, integrations_line, summary_lines
from swapopt_core._figures import format_bytes
from swapopt_core._record import SwapEntry, swap_entries
from swapopt_core.options import read_settings
from tests.cli.test_run import NOTHING_SWAPPED, PLAIN_ADAM, SWAP_ENV, SWAPOPT, _run, _script

SUMMARY = "swapopt run: what swapopt did in this process:"
PLAIN = "no SWAPOPT_* setting asks for anything, so the script runs plain"

# Swapped by hand inside main(), two param groups; main() returns and the collector runs, so
# the summary has only the figures the record kept (the engine is gone).
BY_HAND = """
import dataclasses, gc, json, sys, weakref
import torch
from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats


def main():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1024)) for _ in range(4)]
    opt = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 1e-2}])
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=4))
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    print("STATS " + json.dumps(dataclasses.asdict(swap_stats(opt))), flush=True)
    return weakref.ref(opt)


gone = main()
gc.collect()
print("GONE", gone() is None, flush=True)
if sys.argv[1:] == ["raise"]:
    raise RuntimeError("the script failed after training")
"""

SESSION = """
import dataclasses, gc, json, weakref
import torch
from swapopt_core import OffloadConfig, OffloadSession


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0.25, runtime="loopback"))
    for _ in range(3):
        with session:
            model(torch.randn(64, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    print("STATS " + json.dumps(dataclasses.asdict(session.stats())), flush=True)
    return weakref.ref(session)


gone = main()
gc.collect()
print("GONE", gone() is None, flush=True)
"""

ACCELERATE = """
import dataclasses, json
import torch
from accelerate import Accelerator
from swapopt_core import swap_stats

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
accelerator = Accelerator(cpu=True)
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
for _ in range(3):
    accelerator.backward(model(torch.randn(4, 8)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
print("STATS " + json.dumps(dataclasses.asdict(swap_stats(optimizer.optimizer))), flush=True)
"""

LIGHTNING = """
import dataclasses, json
import torch
import pytorch_lightning as pl
from swapopt_core import swap_stats


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 8)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Probe(pl.Callback):
    def on_train_end(self, trainer, module):  # before the swap callback unswaps at teardown
        stats = swap_stats(trainer.optimizers[0])
        print("STATS " + json.dumps(dataclasses.asdict(stats)), flush=True)


data = torch.utils.data.TensorDataset(torch.randn(12, 32))
trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()])
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
"""


MINDSPORE = """
import dataclasses, json
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn
from swapopt_core import SwapOptimizerConfig, swap_optimizer, swap_stats, unswap_optimizer

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
rng = np.random.default_rng(0)
params = [Parameter(Tensor(rng.standard_normal((32, 16)).astype(np.float32)), name=f"w{i}")
          for i in range(3)]
opt = nn.Adam(params, learning_rate=1e-2)
swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=3))
for _ in range(3):
    opt(tuple(Tensor(np.ones((32, 16), np.float32)) for _ in range(3)))
print("STATS " + json.dumps(dataclasses.asdict(swap_stats(opt))), flush=True)
unswap_optimizer(opt)
"""


def _stats(done: subprocess.CompletedProcess[str]) -> dict[str, int]:
    line = next(s for s in done.stdout.splitlines() if s.startswith("STATS "))
    return json.loads(line.removeprefix("STATS "))


def _optimizer_line(name: str, groups: str, stats: dict[str, int]) -> str:
    """The summary line of one optimizer, from the figures the script printed."""
    total, peak, steps = stats["total_state_bytes"], stats["peak_resident_state_bytes"], 3
    assert stats["steps"] == steps
    return (
        f"  optimizer {name} ({groups}{stats['swapped_tensors']} state tensors swapped, "
        f"3 steps): {format_bytes(total - peak)} of {format_bytes(total)} state kept off the "
        f"device (peak resident {format_bytes(peak)}), "
        f"{format_bytes(stats['host_state_bytes'])} in host memory, per step "
        f"{format_bytes(stats['h2d_bytes'] / steps)} in, "
        f"{format_bytes(stats['d2h_bytes'] / steps)} out"
    )


def _summary(stderr: str) -> list[str]:
    """The summary's lines: its heading and the indented lines after it."""
    lines = stderr.splitlines()
    start = lines.index(SUMMARY)
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), None)
    return lines[start:end]


def test_summary_of_an_optimizer_swapped_by_hand(tmp_path: Path) -> None:
    script = str(_script(tmp_path, BY_HAND))
    done = _run([str(SWAPOPT), "run", script], tmp_path)
    assert done.returncode == 0, done.stderr
    stats = _stats(done)
    assert 0 < stats["peak_resident_state_bytes"] < stats["total_state_bytes"]  # some kept off
    assert "GONE True" in done.stdout  # the figures outlived the optimizer
    assert f"swapopt run: integrations on: none; {PLAIN}" in done.stderr
    kept_off = stats["total_state_bytes"] - stats["peak_resident_state_bytes"]
    assert _summary(done.stderr) == [
        SUMMARY,
        _optimizer_line("Adam", "2 param groups, ", stats),
        f"  total: {format_bytes(kept_off)} of optimizer state kept off the device, "
        f"{format_bytes(stats['host_state_bytes'])} in host memory, per optimizer step "
        f"{format_bytes(stats['h2d_bytes'] / 3)} in, {format_bytes(stats['d2h_bytes'] / 3)} out",
    ]
    assert SUMMARY not in done.stdout  # stdout stays the script's
    assert NOTHING_SWAPPED not in done.stderr

    # A failed script gets the summary too, before its traceback (which stays last).
    failed = _run([str(SWAPOPT), "run", script, "raise"], tmp_path)
    assert failed.returncode == 1
    assert failed.stderr.index(SUMMARY) < failed.stderr.index("Traceback")
    assert failed.stderr.rstrip().endswith("RuntimeError: the script failed after training")

    # Only the first process on each machine prints.
    quiet = _run([str(SWAPOPT), "run", script], tmp_path, LOCAL_RANK="1")
    assert quiet.returncode == 0, quiet.stderr
    assert "swapopt run:" not in quiet.stderr


def test_summary_of_an_offload_session(tmp_path: Path) -> None:
    script = str(_script(tmp_path, SESSION))
    done = _run([str(SWAPOPT), "run", script], tmp_path, SWAPOPT_ACTIVATION_BUDGET_MB="0.25")
    assert done.returncode == 0, done.stderr
    stats = _stats(done)
    assert stats["d2h_bytes"] > 0 and "GONE True" in done.stdout
    asked = "integrations on: accelerate, lightning, transformers; asked for activation budget"
    assert f"{asked} 0.25 MiB" in done.stderr
    assert _summary(done.stderr) == [
        SUMMARY,
        f"  activations (OffloadSession 1): device peak "
        f"{format_bytes(stats['peak_resident_activation_bytes'])} (budget "
        f"{format_bytes(stats['activation_budget_bytes'])}), host peak "
        f"{format_bytes(stats['host_peak_bytes'])}, {format_bytes(stats['d2h_bytes'])} out and "
        f"{format_bytes(stats['h2d_bytes'])} in, {stats['recomputes']} recomputes",
        f"  total: {format_bytes(stats['host_peak_bytes'])} in host memory",
    ]
    assert "no optimizer was swapped" not in done.stderr  # a session was created: no warning


def test_nothing_swapped_gets_the_warning_and_no_summary(tmp_path: Path) -> None:
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, PLAIN_ADAM))], tmp_path, **SWAP_ENV)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(NOTHING_SWAPPED) == 1 and SUMMARY not in done.stderr
    assert "asked for optimizer state to host memory (swap_times=2)" in done.stderr


def test_summary_of_an_accelerate_script(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, ACCELERATE))], tmp_path, **SWAP_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = _stats(done)
    assert (
        "swapopt run: integrations on: accelerate, lightning, transformers; asked for "
        "optimizer state to host memory (swap_times=2)"
    ) in done.stderr
    summary = _summary(done.stderr)
    assert summary[1] == _optimizer_line("AdamW", "1 param group, ", stats)
    assert len(summary) == 3 and summary[2].startswith("  total: ")


def test_summary_of_a_lightning_fit_outlives_the_teardown_unswap(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, LIGHTNING))], tmp_path, **SWAP_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = _summary(done.stderr)
    assert summary[1] == _optimizer_line("Adam", "1 param group, ", _stats(done))
    assert len(summary) == 3 and NOTHING_SWAPPED not in done.stderr


@pytest.mark.mindspore
def test_summary_of_a_mindspore_optimizer_unswapped_by_the_script(tmp_path: Path) -> None:
    pytest.importorskip("mindspore")
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, MINDSPORE))], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = _summary(done.stderr)
    assert summary[1] == _optimizer_line("Adam", "", _stats(done))  # MindSpore: no group count
    assert len(summary) == 3


# ---- in-process: the record and the lines ------------------------------------------------


def _step(opt: torch.optim.Optimizer, times: int) -> None:
    for _ in range(times):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        opt.step()


def test_the_record_keeps_one_entry_per_optimizer_past_its_unswap() -> None:
    params = [torch.nn.Parameter(torch.zeros(256)) for _ in range(2)]
    opt = torch.optim.AdamW(params)
    config = SwapOptimizerConfig(runtime="loopback", min_numel=0, swap_times=2)
    swap_optimizer(opt, config)
    _step(opt, 3)
    before = swap_stats(opt)
    unswap_optimizer(opt)
    (entry,) = [e for e in swap_entries() if e.optimizer is not None and e.optimizer() is opt]
    assert (entry.name, entry.param_groups, entry.stats) == ("AdamW", 1, before)
    swap_optimizer(opt, config)  # swapped again: the same entry, the new swap's figures
    _step(opt, 2)
    mine = [e for e in swap_entries() if e.optimizer is not None and e.optimizer() is opt]
    assert mine == [entry] and entry.stats == swap_stats(opt) and entry.stats.steps == 2
    unswap_optimizer(opt)


def test_the_summary_gives_a_line_to_the_first_optimizers_and_counts_all() -> None:
    params = [torch.nn.Parameter(torch.zeros(256))]
    opt = torch.optim.Adam(params)
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", min_numel=0))
    _step(opt, 1)
    stats = swap_stats(opt)
    unswap_optimizer(opt)
    entries = [SwapEntry("Adam", 1, stats) for _ in range(MAX_LINES + 3)]
    lines = summary_lines(entries, [])
    assert len(lines) == 1 + MAX_LINES + 2 and lines[-2] == "  ... and 3 optimizers more"
    kept_off = (stats.total_state_bytes - stats.peak_resident_state_bytes) * (MAX_LINES + 3)
    assert lines[-1].startswith(f"  total: {format_bytes(kept_off)} of optimizer state")
    assert summary_lines([], []) == []


def test_the_integrations_line_says_what_was_asked_for() -> None:
    def line(names: list[str], **environ: str) -> str:
        return integrations_line(read_settings({}, owner="t", environ=environ), names)

    plain = f"{PLAIN} (but for optimizers it swaps itself)"
    assert line([]) == f"swapopt run: integrations on: none; {plain}"
    assert line(["lightning"]).startswith(f"swapopt run: integrations on: lightning; {PLAIN}")
    both = {"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "CPU", "SWAPOPT_ACTIVATION_BUDGET_MB": "64"}
    assert line(["accelerate"], **both) == (
        "swapopt run: integrations on: accelerate; asked for optimizer state to host memory "
        "(swap_times=16), activation budget 64 MiB"
    )
    assert line([], SWAPOPT_DEVICE_BUDGET_MB="512.5") == (
        "swapopt run: integrations on: none (no Accelerate, Lightning or Transformers "
        "installed); asked for whole-step device budget 512.5 MiB (optimizer state to host "
        "memory as the plan needs): only optimizers the script swaps itself are swapped"
    )
