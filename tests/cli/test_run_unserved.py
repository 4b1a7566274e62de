"""``swapopt run`` on a script whose optimizer swapopt cannot serve (LBFGS), for real.

The script runs to the end as without swapopt, with the warning exactly once on stderr and
the same weights; ``SWAPOPT_STRICT=1`` ends it with ``UnsupportedOptimizerError``; a bad
``SWAPOPT_STRICT`` value stops ``swapopt run`` before the script starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.cli.test_run import NOTHING_SWAPPED, SWAP_ENV, SWAPOPT, _run, _script

pytest.importorskip("pytorch_lightning")

LIGHTNING_LBFGS = """
import sys
import torch
import pytorch_lightning as pl


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.05, max_iter=3)


pl.seed_everything(0, verbose=False)
data = torch.utils.data.TensorDataset(torch.randn(24, 32), torch.randn(24, 1))
trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
model = Net()
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
torch.save(model.state_dict(), sys.argv[1])
print("global_step", trainer.global_step)
"""

ACCELERATE_LBFGS = """
import torch
from accelerate import Accelerator

model = torch.nn.Linear(8, 1)
model, opt = Accelerator(cpu=True).prepare(model, torch.optim.LBFGS(model.parameters()))
print("prepared")
"""

WARNING = "swapopt leaves torch.optim.lbfgs.LBFGS unswapped"


def test_lbfgs_script_runs_unswapped_with_one_warning(tmp_path: Path) -> None:
    script = str(_script(tmp_path, LIGHTNING_LBFGS))
    plain = _run([sys.executable, script, str(tmp_path / "plain.pt")], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    done = _run([str(SWAPOPT), "run", script, str(tmp_path / "run.pt")], tmp_path, **SWAP_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global_step 3" in done.stdout and "lightning" in done.stderr
    assert done.stderr.count(WARNING) == 1, done.stderr
    assert "SWAPOPT_STRICT=1" in done.stderr
    assert NOTHING_SWAPPED not in done.stderr  # the warning said it already
    left = torch.load(tmp_path / "plain.pt", weights_only=True)
    right = torch.load(tmp_path / "run.pt", weights_only=True)
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_strict_makes_it_an_error(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    script = str(_script(tmp_path, ACCELERATE_LBFGS))
    done = _run([str(SWAPOPT), "run", script], tmp_path, **SWAP_ENV, SWAPOPT_STRICT="1")
    assert done.returncode == 1 and "prepared" not in done.stdout, done.stderr[-3000:]
    assert "UnsupportedOptimizerError" in done.stderr and "LBFGS" in done.stderr
    assert WARNING not in done.stderr
    done = _run([str(SWAPOPT), "run", script], tmp_path, **SWAP_ENV, SWAPOPT_STRICT="off")
    assert done.returncode == 0 and "prepared" in done.stdout, done.stderr[-3000:]
    assert done.stderr.count(WARNING) == 1, done.stderr


def test_bad_strict_value_stops_before_the_script(tmp_path: Path) -> None:
    script = str(_script(tmp_path, "print('started')\n"))
    done = _run([str(SWAPOPT), "run", script], tmp_path, **SWAP_ENV, SWAPOPT_STRICT="maybe")
    assert done.returncode == 2 and "started" not in done.stdout
    assert "SWAPOPT_STRICT='maybe'" in done.stderr and "1/true/yes" in done.stderr, done.stderr
