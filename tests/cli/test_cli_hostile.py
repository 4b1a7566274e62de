"""``swapopt plan`` / ``plot`` / ``demo`` against hostile files and flags (issue 10).

Each case ended in a traceback, printed nonsense, truncated a file or overwrote the input.
A user error is now one line on stderr and exit code 2; files are replaced atomically.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swapopt_core._cli.main import main
from tests.cli.test_cli_offload import small_trace

REPO = Path(__file__).resolve().parents[2]
GOOD = json.loads(small_trace().to_json())
INF, NAN = float("inf"), float("nan")


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def _edited(tmp_path: Path, path: tuple, value: object) -> Path:
    data = copy.deepcopy(GOOD)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    file = tmp_path / "trace.json"
    file.write_text(json.dumps(data))
    return file


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        (("storage_sizes", "1"), INF, "storage_sizes['1']=Infinity"),
        (("storage_sizes", "1"), -5, "storage_sizes['1']=-5"),
        (("ops", 1, "duration_ms"), NAN, "ops[1].duration_ms=NaN"),
        (("ops", 1, "duration_ms"), INF, "ops[1].duration_ms=Infinity"),
        (("ops", 1, "duration_ms"), -1, "ops[1].duration_ms=-1"),
        (("ops", 4, "accesses", 0, "storage_id"), None, "ops[4].accesses[0].storage_id=null"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "plot"])
def test_bad_trace_values_are_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    path: tuple,
    value: object,
    words: str,
) -> None:
    trace = _edited(tmp_path, path, value)
    out = tmp_path / ("p.json" if command == "plan" else "t.png")
    argv = [command, "--trace", str(trace), "--budget-mb", "9", "--out", str(out)]
    line = _one_line_error(argv, capsys)
    assert f"--trace {trace}: not an activation trace" in line and words in line
    assert not out.exists()


def test_deeply_nested_trace_is_one_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "deep.json"
    trace.write_text("[" * 100_000 + "]" * 100_000)
    argv = ["plan", "--trace", str(trace), "--budget-mb", "9", "--out", str(tmp_path / "p.json")]
    assert "nests JSON arrays or objects too deeply" in _one_line_error(argv, capsys)


def test_deeply_nested_schedule_is_one_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(GOOD))
    schedule = tmp_path / "plan.json"
    schedule.write_text('{"pre": ' + "[" * 100_000 + "]" * 100_000 + "}")
    argv = ["plot", "--trace", str(trace), "--schedule", str(schedule)]
    line = _one_line_error([*argv, "--out", str(tmp_path / "t.png")], capsys)
    assert f"--schedule {schedule}: not a residency schedule" in line


def test_plan_refuses_to_overwrite_its_trace(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(GOOD))
    for out in (trace, tmp_path / "." / "trace.json"):
        argv = ["plan", "--trace", str(trace), "--budget-mb", "9", "--out", str(out)]
        line = _one_line_error(argv, capsys)
        assert "is the file given to --trace" in line
    assert json.loads(trace.read_text()) == GOOD


def test_plot_refuses_to_overwrite_its_inputs(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.png"  # a misnamed trace: the suffix check alone would let it by
    trace.write_text(json.dumps(GOOD))
    argv = ["plot", "--trace", str(trace), "--budget-mb", "9", "--out", str(trace)]
    assert "is the file given to --trace" in _one_line_error(argv, capsys)
    assert json.loads(trace.read_text()) == GOOD


_FAILING_WRITE = textwrap.dedent(
    """
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
    from swapopt_core._cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and SIGXFSZ are POSIX")
def test_a_failed_write_leaves_the_old_out_file_whole(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(GOOD))
    out = tmp_path / "plan.json"
    before = "previous schedule, longer than the 64-byte limit on file sizes " * 4
    out.write_text(before)
    result = subprocess.run(
        [sys.executable, "-c", _FAILING_WRITE, "plan", "--trace", str(trace)]
        + ["--budget-mb", "9", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"--out {out}: cannot be written" in result.stderr
    assert out.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "trace.json"]


def test_a_good_plan_replaces_the_old_out_file(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(GOOD))
    out = tmp_path / "plan.json"
    out.write_text("old")
    assert main(["plan", "--trace", str(trace), "--budget-mb", "9", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["post"]
    assert out.stat().st_mode & 0o777 == trace.stat().st_mode & 0o777  # not mkstemp's 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "trace.json"]


def test_plot_writes_its_image_atomically(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(GOOD))
    out = tmp_path / "t.svg"
    assert main(["plot", "--trace", str(trace), "--budget-mb", "9", "--out", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<?xml")  # the format follows --out's suffix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.svg", "trace.json"]


@pytest.mark.parametrize("device", ["xyz", "meta", "cuda:x", ""])
def test_demo_refuses_an_unknown_device(device: str, capsys) -> None:
    assert main(["demo", "--device", device, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and "expected cpu, cuda or cuda:N" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["plan", "plot"])
@pytest.mark.parametrize("budget", ["1e308", "9e15"])
def test_a_budget_overflowing_int64_bytes_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, budget: str
) -> None:
    # Before issue 10, 1e308 MiB passed the check and int(inf) raised OverflowError.
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(GOOD))
    out = tmp_path / ("p.json" if command == "plan" else "t.png")
    argv = [command, "--trace", str(trace), "--budget-mb", budget, "--out", str(out)]
    line = _one_line_error(argv, capsys)
    assert f"--budget-mb {budget}: the activation budget must be a finite number" in line
    assert "below 8796093022208" in line
