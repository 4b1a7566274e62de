"""``benchmarks/gpu_check.py`` exercised on the CPU with ``--cpu-smoke`` (no GPU needed).

No test name here may contain the GPU section's ``-k`` word, or the script's own test run on
a GPU would start the script again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ["cuda_tests", "bandwidth", "adamw", "offload", "device_budget"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _script() -> ModuleType:
    """The script as a module (registered first: its dataclasses look their module up)."""
    name = "gpu_check_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.slow
def test_smoke_run_prints_every_section_and_bitwise_equality(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke"],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["meta"]["mode"] == "cpu-smoke"
    sections = report["sections"]
    assert list(sections) == SECTIONS
    assert all(s["status"] == "ok" for s in sections.values()), sections
    adamw = sections["adamw"]["result"]
    assert adamw["bitwise_equal"] is True
    for mode in ("packed", "per-tensor"):
        entry = adamw["modes"][mode]
        assert entry["bitwise_equal"] is True and entry["mismatch_count"] == 0
        assert entry["moved_per_step"] > 0
        for key in ("link_bound_s", "serialised_s", "swapped_over_link_bound"):
            assert entry[key] > 0
    bandwidth = sections["bandwidth"]["result"]
    for key in ("h2d_gbps", "d2h_gbps", "duplex_h2d_gbps", "duplex_d2h_gbps"):
        assert bandwidth[key] > 0
    offload = sections["offload"]["result"]
    assert offload["grads_bitwise_equal"] is True
    assert offload["stats"]["replays"] >= 1 and offload["stats"]["d2h_bytes"] > 0
    assert offload["budget_bytes"] == pytest.approx(0.5 * offload["natural_peak_bytes"], abs=1)
    budget = sections["device_budget"]["result"]
    assert budget["params_bitwise_equal"] is True
    assert budget["stats"]["planned_step_peak_device_bytes"] <= budget["target_bytes"]
    assert budget["step_peak_device_bytes"] > 0
    tests = sections["cuda_tests"]["result"]
    assert tests["ok"] and tests["junit_found"] and tests["test_cuda_py"]["total"] > 0
    assert report["summary"]["ok"] is True and report["summary"]["failed_checks"] == []


def test_a_failing_section_is_recorded_and_the_rest_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()

    def broken(*_args: object) -> dict:
        raise RuntimeError("injected failure")

    monkeypatch.setitem(script.SECTIONS, "bandwidth", broken)
    monkeypatch.delenv("OUT", raising=False)
    assert script.main(["--cpu-smoke", "--only", "bandwidth,offload"]) == 1
    report = json.loads(capsys.readouterr().out)
    sections = report["sections"]
    assert sections["bandwidth"]["status"] == "failed"
    assert "injected failure" in sections["bandwidth"]["traceback"]
    assert sections["offload"]["status"] == "ok"
    assert sections["cuda_tests"]["status"] == sections["adamw"]["status"] == "not_requested"
    assert report["summary"]["sections_not_ok"] == {"bandwidth": "failed"}
    assert report["summary"]["ok"] is False


def test_a_section_out_of_time_is_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    monkeypatch.delenv("OUT", raising=False)
    # A budget below every section's minimum: nothing runs, each says why.
    assert script.main(["--cpu-smoke", "--budget-s", "0.01"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [s["status"] for s in report["sections"].values()] == ["skipped"] * len(script.SECTIONS)
    assert all("out of time" in s["reason"] for s in report["sections"].values())


def test_a_hung_section_is_reported_by_the_watchdog(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(SCRIPT.parent)!r})
        import gpu_check as g
        g.WATCHDOG_GRACE_S = 0.0
        g.MIN_S["bandwidth"] = 0.0
        g.SECTIONS["bandwidth"] = lambda *a: time.sleep(120)
        # The budget counts from main(), imports included: 5 s lets the section start on a
        # loaded machine (1 s did not, once), and the watchdog still fires right after it.
        sys.exit(g.main(["--cpu-smoke", "--only", "bandwidth", "--budget-s", "5"]))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["sections"]["bandwidth"]["status"] == "timed_out"
    assert report["summary"]["ok"] is False
    assert "in <lambda>" in proc.stderr  # the hung thread's stack
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text()) == report


def test_junit_counts_keep_collection_errors_apart(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text(
        textwrap.dedent(
            """\
            <testsuites><testsuite>
              <testcase classname="tests.torch_backend.test_cuda" name="a"/>
              <testcase classname="tests.torch_backend.test_cuda" name="b">
                <skipped message="Requires: CUDA"/></testcase>
              <testcase classname="tests.activations.test_misuse" name="c">
                <failure message="assert 1 == 2"/></testcase>
              <testcase classname="" name="tests.torch_backend.test_properties">
                <error message="collection failure"/></testcase>
            </testsuite></testsuites>
            """
        )
    )
    counts = _script()._junit_counts(xml)
    assert (counts["passed"], counts["skipped"], counts["failed"]) == (1, 1, 1)
    assert (counts["errors"], counts["collection_errors"]) == (0, 1)
    assert counts["test_cuda_py"] == {"passed": 1, "total": 2}
    assert any("assert 1 == 2" in f for f in counts["failures"])
