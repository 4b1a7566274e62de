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
SECTIONS = [
    "cuda_tests",
    "bandwidth",
    "adamw",
    "offload",
    "device_budget",
    "profile",
    "drop_while_queued",
    "cuda_sanitizer",
]
#: Checks that need CUDA: listed as skipped on the smoke run, never as passed.
GPU_ONLY_CHECKS = [
    "adamw.packed.reserved_during_step",
    "adamw.packed.state_pinned",
    "adamw.allocated_flat",
    "adamw.reserved_flat",
    "device_budget.allocated_peak_over_target",
    "device_budget.reserved_peak_over_target",
    "profile.copies_overlap_compute",
    "profile.activation_h2d_apart_from_prefetch",
    "cuda_sanitizer",
]


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
    assert sections["cuda_sanitizer"]["status"] == "not_applicable"
    assert "not applicable on cpu" in sections["cuda_sanitizer"]["reason"]
    assert all(s["status"] == "ok" for n, s in sections.items() if n != "cuda_sanitizer"), sections
    adamw = sections["adamw"]["result"]
    assert adamw["bitwise_equal"] is True
    for mode in ("packed", "per-tensor"):
        entry = adamw["modes"][mode]
        assert entry["bitwise_equal"] is True and entry["mismatch_count"] == 0
        assert entry["moved_per_step"] > 0
        for key in ("link_bound_s", "serialised_s", "swapped_over_link_bound"):
            assert entry[key] > 0
        # Device-memory figures: reported (None without CUDA) next to the swap's own.
        for key in ("allocated_during_step", "reserved_during_step", "peak_reserved_state_bytes"):
            assert key in entry
        assert entry["reserved_during_step"] is None and entry["peak_resident_state_bytes"] > 0
        assert entry["limit_over_state"] == pytest.approx(4 / adamw["swap_times"])
        assert entry["pinned_fallback_buffers"] in (0, None)
        assert entry["pinned_host_growth"] == 0
    assert adamw["swap_times"] == 16 and adamw["snapshots"]["after_step_2"]
    bandwidth = sections["bandwidth"]["result"]
    for key in ("h2d_gbps", "d2h_gbps", "duplex_h2d_gbps", "duplex_d2h_gbps"):
        assert bandwidth[key] > 0
    for key in ("pageable_h2d_gbps", "pageable_d2h_gbps"):
        assert bandwidth[key] > 0
    runtime = bandwidth["runtime"]
    assert runtime["nbytes"] == 32 * 2**20 and runtime["h2d_gbps"] > 0 and runtime["d2h_gbps"] > 0
    assert runtime.get("duplex_total_gbps", 1) > 0
    offload = sections["offload"]["result"]
    assert offload["grads_bitwise_equal"] is True
    assert offload["stats"]["replays"] >= 1 and offload["stats"]["d2h_bytes"] > 0
    assert offload["budget_bytes"] == pytest.approx(0.5 * offload["natural_peak_bytes"], abs=1)
    checkpointing = offload["checkpointing"]
    assert checkpointing["step_over_plain"] > 0 and checkpointing["grads_bitwise_equal"] is True
    assert checkpointing["peak_bytes"] is None  # no allocator statistics on the CPU
    profile = sections["profile"]["result"]
    assert profile["profiled_steps"] >= 1 and profile["cpu"]["cpu_ops"] > 0
    assert profile["gpu"].startswith("not applicable on cpu")
    assert (tmp_path / "out" / "gpu_check_trace.json.gz").exists()
    drop = sections["drop_while_queued"]["result"]
    assert drop["ok"] is True and all(r["fresh_host_intact"] for r in drop["rounds"])
    budget = sections["device_budget"]["result"]
    assert budget["params_bitwise_equal"] is True
    assert budget["stats"]["planned_step_peak_device_bytes"] <= budget["target_bytes"]
    assert budget["step_peak_device_bytes"] > 0
    tests = sections["cuda_tests"]["result"]
    assert tests["ok"] and tests["junit_found"] and tests["test_cuda_py"]["total"] > 0
    summary = report["summary"]
    assert summary["ok"] is True and summary["failed_checks"] == []
    assert summary["sections_not_applicable"] == ["cuda_sanitizer"]
    checks = summary["checks"]
    for name in GPU_ONLY_CHECKS:
        assert checks[name]["status"] == "skipped", (name, checks[name])
        assert name in summary["skipped_checks"]
    for name in ("drop_while_queued", "offload.peak_over_budget", "device_budget.peak_over_target"):
        assert checks[name]["status"] == "passed", (name, checks[name])
    assert checks["adamw.packed.pinned_flat"]["status"] == "passed"
    assert set(summary["passed_checks"]).isdisjoint(GPU_ONLY_CHECKS)


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
    statuses = {name: s["status"] for name, s in report["sections"].items()}
    # What needs CUDA does not apply on the CPU, however much time is left.
    assert statuses == {
        n: "not_applicable" if n in script.CUDA_ONLY else "skipped" for n in SECTIONS
    }
    skipped = [s for s in report["sections"].values() if s["status"] == "skipped"]
    assert all("out of time" in s["reason"] for s in skipped)
    assert report["summary"]["failed_checks"] == []  # nothing measured, nothing failed...
    assert report["summary"]["ok"] is False  # ...but the run is not ok


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


def test_an_import_failure_is_a_json_report(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["pluggy"] = None  # import pluggy raises, as where it is not installed
        sys.path.insert(0, {str(SCRIPT.parent)!r})
        import gpu_check as g
        sys.exit(g.main(["--cpu-smoke"]))
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
    assert proc.returncode == 2, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["summary"]["ok"] is False
    assert "import swapopt_core failed" in report["summary"]["error"]
    assert "pluggy" in report["summary"]["error"]
    assert any("pluggy" in m for m in report["meta"]["prerequisites"]["missing"])
    assert report["sections"] == {}


def _trace() -> list[dict]:
    """A Chrome trace as torch.profiler writes it: two compute kernels; an optimizer
    prefetch copy in, an activation page-in queued behind it on the same stream, and a copy
    out; each copy tied by its correlation id to the runtime call and Python frames."""

    def x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    return [
        x("kernel", "gemm", 0, 100, tid=7, stream=7),
        x("kernel", "gelu", 150, 100, tid=7, stream=7),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 70, stream=20, correlation=1),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 120, 40, stream=20, correlation=2),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 200, 100, stream=21, correlation=3),
        x("cuda_runtime", "cudaMemcpyAsync", 10, 2, tid=2, correlation=1),
        x("cuda_runtime", "cudaMemcpyAsync", 60, 2, tid=2, correlation=2),
        x("cuda_runtime", "cudaMemcpyAsync", 190, 2, tid=1, correlation=3),
        x("python_function", "torch/autograd/graph.py(1): hook", 0, 100, tid=2),
        x("python_function", "/r/swapopt_core/_torch/prefetch.py(9): __call__", 5, 10, tid=2),
        x("python_function", "/r/swapopt_core/_activations/executor.py(5): page_in", 55, 10, tid=2),
        x("python_function", "/r/swapopt_core/_swap/pipeline.py(1): finish", 185, 10, tid=1),
    ]


def test_the_trace_analysis_finds_overlap_owners_and_waits() -> None:
    result = _script()._trace_analysis(_trace())
    assert (result["memcpys"], result["kernels"], result["h2d_memcpys"]) == (3, 2, 2)
    # Copies run 210 us; 50 + 10 + 50 of them while a kernel runs.
    assert result["overlap_fraction"] == pytest.approx(110 / 210)
    assert result["h2d_overlap_fraction"] == pytest.approx(60 / 110)
    owners = result["by_owner"]
    assert owners["optimizer_prefetch"]["h2d_streams"] == [20]
    assert owners["activations"]["max_h2d_launch_delay_us"] == pytest.approx(60)
    assert owners["optimizer"]["streams"] == [21]
    assert result["h2d_streams"] == [20] and result["distinct_h2d_streams"] == 1
    assert result["activation_and_prefetch_share_h2d_stream"] is True
    assert result["activation_h2d_behind_prefetch"] == 1
    assert result["max_delay_behind_prefetch_us"] == pytest.approx(60)


def test_the_trace_analysis_of_separate_streams() -> None:
    events = _trace()
    events[3]["args"]["stream"] = 22  # the page-in on a stream of its own, started at once
    events[3]["ts"] = 62
    result = _script()._trace_analysis(events)
    assert result["activation_and_prefetch_share_h2d_stream"] is False
    assert result["activation_h2d_behind_prefetch"] == 0
    assert result["distinct_h2d_streams"] == 2


def test_checks_fail_on_blown_figures_and_skip_what_is_missing() -> None:
    script = _script()
    mode = {
        "reserved_during_step_over_state": 0.3,
        "peak_reserved_state_bytes": 0,
        "peak_reserved_state_over_state": 0.0,
        "pinned_fallback_buffers": 2,
        "pinned_state_tensors": 3,
        "off_device_state_tensors": 4,
        "pinned_host_growth": 0,
    }
    sections = {
        "adamw": {
            "status": "ok",
            "result": {
                "bitwise_equal": True,
                "swap_times": 16,
                "modes": {"packed": mode},
                "allocated_growth": 0,
                "reserved_growth": 64 * 2**20,
            },
        },
        "device_budget": {
            "status": "ok",
            "result": {
                "params_bitwise_equal": True,
                "peak_over_target": 1.2,
                "allocated_peak_over_target": 0.9,
                "reserved_peak_over_target": None,
            },
        },
        "offload": {"status": "failed", "error": "boom"},
        "profile": {"status": "not_requested"},
    }
    summary = script._summary(sections, cuda=True)
    checks = summary["checks"]
    assert set(summary["failed_checks"]) == {
        "adamw.packed.reserved_during_step",  # 0.3 > 4/16
        "adamw.packed.pinned_fallback_buffers",
        "adamw.packed.state_pinned",  # 3 of 4 pinned
        "adamw.reserved_flat",
        "device_budget.peak_over_target",
    }
    assert checks["adamw.packed.peak_reserved_state_bytes"]["status"] == "skipped"
    assert checks["device_budget.reserved_peak_over_target"]["status"] == "skipped"
    assert checks["offload.peak_over_budget"]["reason"].startswith("section offload failed")
    assert not any(name.startswith("profile") for name in checks)  # left out with --only
    assert summary["ok"] is False
    on_cpu = script._summary(sections, cuda=False)
    assert "adamw.packed.reserved_during_step" in on_cpu["skipped_checks"]
    assert on_cpu["failed_checks"] == [
        "adamw.packed.pinned_fallback_buffers",
        "device_budget.peak_over_target",
    ]
