"""``swapopt run`` on an unmodified SGD script: swapped, runs to the end, equals plain.

``_sgd_script.py`` trains with ``torch.optim.SGD`` (momentum, nesterov) under a real
Lightning ``Trainer.fit`` and under a plain ``Accelerator``, as a real subprocess: once with
``python`` and once with ``swapopt run`` and the flag set. The swapped run must report the swap
(its ``swap_stats`` after every step) and save parameters and optimizer state equal
(``torch.equal``) to the plain run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("_sgd_script.py")
SWAPOPT = Path(sys.executable).with_name("swapopt")
SWAP_ENV = {
    "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    "SWAPOPT_RUNTIME": "loopback",
    "SWAPOPT_MIN_NUMEL": "16",
    "SWAPOPT_SWAP_TIMES": "2",
}
STEPS = 6


def _run(command: list[str], cwd: Path, **extra: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWAPOPT_")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        **extra,
    )
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stderr[-4000:]}"
    line = next(s for s in done.stdout.splitlines() if s.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT ")), done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lightning", "accelerate"])
def test_swapopt_run_swaps_an_sgd_script_bit_for_bit(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("pytorch_lightning" if kind == "lightning" else "accelerate")
    if not SWAPOPT.exists():
        pytest.skip(f"no swapopt script next to {sys.executable}")
    plain_out, swap_out = tmp_path / "plain.pt", tmp_path / "swap.pt"
    plain, _ = _run([sys.executable, str(SCRIPT), kind, str(plain_out)], tmp_path)
    assert plain == {"swapped": [False] * STEPS, "stats": None}
    command = [str(SWAPOPT), "run", str(SCRIPT), kind, str(swap_out)]
    swapped, log = _run(command, tmp_path, **SWAP_ENV)
    assert "integrations on:" in log and kind in log, log[-3000:]
    # No warning: neither "nothing swapped" nor one leaving the SGD unswapped.
    assert "no optimizer was swapped" not in log, log[-3000:]
    assert "unswapped" not in log and "SWAPOPT_STRICT" not in log, log[-3000:]
    # The exit summary names the swapped SGD instead.
    summary = f"optimizer SGD (1 param group, 3 state tensors swapped, {STEPS} steps)"
    assert summary in log, log[-3000:]
    assert swapped["swapped"] == [True] * STEPS
    stats = swapped["stats"]
    # Four parameters, the last bias (4 elements) under SWAPOPT_MIN_NUMEL: three swapped.
    assert stats["steps"] == STEPS
    assert stats["swapped_tensors"] == 3 and stats["resident_state_bytes"] == 0
    assert stats["host_state_bytes"] == 4 * (32 * 64 + 64 + 64 * 4)
    want, got = torch.load(plain_out, weights_only=True), torch.load(swap_out, weights_only=True)
    assert want["params"].keys() == got["params"].keys()
    for name in want["params"]:
        assert torch.equal(want["params"][name], got["params"][name]), name
    assert want["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]
    states = want["optimizer"]["state"], got["optimizer"]["state"]
    assert states[0].keys() == states[1].keys() and len(states[0]) == 4
    for index, entry in states[0].items():
        assert entry.keys() == states[1][index].keys()
        for key, value in entry.items():
            assert torch.equal(value, states[1][index][key]), (index, key)
