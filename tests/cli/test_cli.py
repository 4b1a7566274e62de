"""Tests of the ``swapopt`` command line and its ``demo`` job (CPU, loopback runtime)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from swapopt_core._cli import demo as _demo
from swapopt_core._cli.demo import DemoOptions, make_batches, run_demo
from swapopt_core._cli.main import main

TINY = ["--steps", "3", "--layers", "1", "--width", "32", "--swap-times", "2", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rich wraps at 80 columns when not on a terminal; keep every table row on one line.
    monkeypatch.setenv("COLUMNS", "200")


def _row(out: str, label: str) -> list[str]:
    """Cells of the table row that starts with ``label``."""
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│|]", line)]
        if len(cells) > 2 and cells[1] == label:
            return cells[1:-1]
    raise AssertionError(f"no row {label!r} in:\n{out}")


@pytest.mark.parametrize(("flag", "mode"), [("--packed", "packed"), ("--per-tensor", "per-tensor")])
def test_demo_in_process_reports_identical_runs(
    capsys: pytest.CaptureFixture[str], flag: str, mode: str
) -> None:
    assert main(["demo", *TINY, flag]) == 0
    out = capsys.readouterr().out
    _, plain_loss, swapped_loss, verdict = _row(out, "final loss")
    assert plain_loss == swapped_loss
    assert verdict == "equal"
    assert _row(out, "final parameters")[-1] == "bit-identical"
    assert f"{mode}," in out  # the layout the engine reports matches the flag
    assert "runtime loopback" in out
    h2d = _row(out, "moved H2D")[2]
    assert h2d != "0.00 MiB"  # the swapped run really moved state


def test_run_demo_swaps_and_matches_plain_bit_for_bit() -> None:
    options = DemoOptions(steps=3, layers=1, width=32, swap_times=4, device="cpu")
    report = run_demo(options)
    stats = report.swapped.stats
    assert report.identical
    assert report.plain.final_loss == report.swapped.final_loss
    assert report.plain.first_loss == report.swapped.first_loss
    assert stats is not None and report.plain.stats is None
    assert stats.steps == 3
    assert stats.swapped_tensors > 0
    assert stats.h2d_bytes > 0 and stats.d2h_bytes > 0
    assert 0 < stats.total_state_bytes <= report.plain.state_bytes
    # Four batches: at most three of them (plus staging slack) are on the device at once.
    assert stats.peak_resident_state_bytes < stats.total_state_bytes
    assert len(report.plain.step_seconds) == len(report.swapped.step_seconds) == 3


def test_demo_exits_1_when_params_differ(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_demo.DemoReport, "identical", property(lambda self: False))
    assert main(["demo", *TINY]) == 1
    out = capsys.readouterr().out
    assert _row(out, "final parameters")[-1] == "NOT bit-identical"
    assert "FAIL" in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["demo", "--packed", "--per-tensor"],
        ["demo", "--steps", "0"],
        ["demo", "--width", "30"],
        ["demo", "--bogus"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage: swapopt" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on CPU-only machines")
def test_demo_refuses_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cuda", "--steps", "1"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_help_subprocess_lists_demo() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "swapopt_core", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: swapopt" in result.stdout
    assert re.search(r"^\s+demo\s+\S", result.stdout, re.MULTILINE)


def test_demo_help_lists_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in (
        "--steps",
        "--swap-times",
        "--packed",
        "--per-tensor",
        "--device",
        "--seed",
        "--layers",
        "--width",
    ):
        assert option in out


def test_batches_are_deterministic_and_learnable() -> None:
    options = DemoOptions(batch_size=4, seq_len=16, vocab=64)
    first = make_batches(options, 5)
    assert first.shape == (5, 4, 17) and first.dtype == torch.int64
    assert torch.equal(first, make_batches(options, 5))
    assert not torch.equal(
        first, make_batches(DemoOptions(batch_size=4, seq_len=16, vocab=64, seed=1), 5)
    )
    assert int(first.min()) >= 0 and int(first.max()) < 64
    # A noisy cycle: most of the time a token's successor is its usual successor.
    pairs = Counter()
    for row in first.flatten(0, 1).tolist():
        pairs.update(zip(row, row[1:], strict=False))
    usual: dict[int, int] = {}
    for (cur, _), count in pairs.items():
        usual[cur] = max(usual.get(cur, 0), count)
    assert sum(usual.values()) / sum(pairs.values()) > 0.7


def test_tiny_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = _demo._TinyGPT(vocab=50, width=16, layers=2, heads=4, max_len=12)
    idx = torch.randint(50, (2, 12))
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 50
    with torch.no_grad():
        out, out_changed = model(idx), model(changed)
    assert out.shape == (2, 12, 50)
    torch.testing.assert_close(out[:, :8], out_changed[:, :8], rtol=0, atol=1e-6)
    assert not torch.equal(out[:, 8:], out_changed[:, 8:])


def test_version_is_the_installed_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert main(["--version"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["swapopt", version("swapopt")]
    assert f"(torch {version('torch')})" in " ".join(words)


def test_module_version_subprocess() -> None:
    from importlib.metadata import version

    result = subprocess.run(
        [sys.executable, "-m", "swapopt_core", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"swapopt {version('swapopt')} (torch ")


def test_quick_help_names_its_sizes_and_the_three_arenas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--quick", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--quick a smaller model and a shorter run" in out
    assert f"(default: 100; --quick: {_demo.QUICK.steps})" in out
    assert "at most three batches on the device at once" in out
    assert "two device arenas" not in out


def test_flags_given_with_quick_override_its_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[DemoOptions] = []

    def fake_run(options: DemoOptions, console: object, **_: object) -> None:
        seen.append(options)
        raise SystemExit(0)

    monkeypatch.setattr(_demo, "run_demo", fake_run)
    assert main(["demo", "--quick", "--steps", "2", "--per-tensor"]) == 0
    assert seen == [
        dataclasses.replace(_demo.QUICK, steps=2, packed=False),
    ]


def test_plain_progress_lines_off_a_terminal() -> None:
    from rich.console import Console

    from swapopt_core._cli.demo_progress import DemoProgress

    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    with DemoProgress(console, interval_s=1e9) as progress:
        progress.begin("plain AdamW", 20)
        for step in range(20):
            progress.advance(1.0 / (step + 1))
    lines = console.file.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "plain AdamW: step 1/20",
        *(f"plain AdamW: step {k}/20" for k in range(2, 21, 2)),
    ]
    assert lines[-1].startswith("plain AdamW: step 20/20, loss 0.0500, ")
    assert lines[-1].endswith(" s elapsed")


def test_quick_demo_in_a_pipe_prints_progress_and_passes() -> None:
    # The one full demo run of the suite: --quick, as a CI log would run it (no terminal).
    result = subprocess.run(
        [sys.executable, "-m", "swapopt_core", "demo", "--quick", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    steps = _demo.QUICK.steps
    for run in ("plain AdamW", "swapped AdamW"):
        assert f"{run}: step 1/{steps}, loss " in result.stderr
        assert f"{run}: step {steps}/{steps}, loss " in result.stderr
    assert _row(result.stdout, "final parameters")[-1] == "bit-identical"
    assert "OK: swapped AdamW ended bit-identical" in result.stdout
