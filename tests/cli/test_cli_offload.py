"""Tests of ``swapopt plan`` and ``swapopt plot`` on a small hand-made activation trace."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from swapopt_core._cli.main import main
from swapopt_core._planning.ir import (
    Access,
    AccessKind,
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
)
from swapopt_core._planning.simulate import simulate

MIB = 1 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
R, W = AccessKind.READ, AccessKind.WRITE


def _op(name: str, ms: float, *accesses: tuple[int, AccessKind], pure: bool = False) -> TraceOp:
    return TraceOp(name, ms, tuple(Access(sid, kind) for sid, kind in accesses), pure)


def small_trace() -> ActivationTrace:
    """Activation 1 is made first and read last, with three long ops in between.

    Storage 9 is a weight (not an activation). Natural peak: 12 MiB during ops 2 and 3;
    with storage 1 away from op 1 to op 3 the step fits in 9 MiB.
    """
    ops = (
        _op("embed", 0.1, (9, R), (1, W)),
        _op("mm1", 1.0, (9, R), (2, W)),
        _op("mm2", 1.0, (2, R), (3, W)),
        _op("mm3", 1.0, (3, R), (4, W)),
        _op("loss", 0.1, (1, R), (4, R), (5, W)),
    )
    sizes = {1: 4 * MIB, 2: 4 * MIB, 3: 4 * MIB, 4: 4 * MIB, 5: MIB}
    return ActivationTrace(ops, sizes, frozenset({5}), None, 16.0, 16.0)


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(small_trace().to_json())
    return path


def test_plan_writes_a_schedule_that_fits_the_budget(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(trace_file), "--budget-mb", "9", "--out", str(out)]) == 0
    schedule = ResidencySchedule.from_json(out.read_text())
    assert len(schedule) > 0
    result = simulate(small_trace().with_limit(9 * MIB), schedule)
    assert result.natural_peak_bytes == 12 * MIB
    assert result.peak_bytes <= 9 * MIB
    printed = capsys.readouterr().out
    for label in ("natural peak", "budget", "planned peak", "overhead", "actions", "moved"):
        assert label in printed
    assert "12.00 MiB" in printed and "9.00 MiB" in printed


def test_plan_with_a_budget_above_the_peak_moves_nothing(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--trace",
        str(trace_file),
        "--budget-mb",
        "64",
        "--out",
        str(out),
        "--planner",
        "timed",
    ]
    assert main(argv) == 0
    schedule = ResidencySchedule.from_json(out.read_text())
    assert simulate(small_trace(), schedule).d2h_bytes == 0


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_plan_refuses_a_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    err = _usage_error(
        ["plan", "--trace", str(missing), "--budget-mb", "9", "--out", str(tmp_path / "p.json")],
        capsys,
    )
    assert f"--trace {missing}: no such file" in err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"ops": []}', "storage_sizes"),
        ('{"ops": [], "storage_sizes": {}, "d2h_bandwidth_gbps": 0}', "d2h_bandwidth_gbps"),
    ],
)
def test_plan_refuses_a_file_that_is_not_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    err = _usage_error(
        ["plan", "--trace", str(bad), "--budget-mb", "9", "--out", str(tmp_path / "p.json")], capsys
    )
    assert f"--trace {bad}: not an activation trace" in err
    assert expected in err
    assert "ActivationTrace.to_json()" in err  # the fix


def test_plan_refuses_a_negative_budget(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(
        [
            "plan",
            "--trace",
            str(trace_file),
            "--budget-mb",
            "-5",
            "--out",
            str(tmp_path / "p.json"),
        ],
        capsys,
    )
    assert "--budget-mb -5" in err and ">= 0" in err


@pytest.mark.parametrize("budget", ["lots", "nan", "inf"])
def test_plan_refuses_a_budget_that_is_not_a_size(
    budget: str, trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--trace", str(trace_file), "--budget-mb", budget]
    err = _usage_error([*argv, "--out", str(tmp_path / "p.json")], capsys)
    assert f"--budget-mb {budget}: the activation budget must be a finite number" in err


def test_plan_refuses_an_unknown_planner(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(
        [
            "plan",
            "--trace",
            str(trace_file),
            "--budget-mb",
            "9",
            "--out",
            str(tmp_path / "p.json"),
            "--planner",
            "psychic",
        ],
        capsys,
    )
    assert "--planner psychic" in err
    assert "timed" in err  # the choices


def test_plan_refuses_an_output_in_a_missing_folder(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no" / "such" / "p.json"
    err = _usage_error(
        ["plan", "--trace", str(trace_file), "--budget-mb", "9", "--out", str(out)], capsys
    )
    assert f"--out {out}" in err and "does not exist" in err


def test_plan_needs_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["plan", "--budget-mb", "9"], capsys)
    assert "--trace" in err


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1000


def test_plot_plans_and_draws_from_a_budget(trace_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    argv = ["plot", "--trace", str(trace_file), "--budget-mb", "9", "--out", str(out)]
    assert main(argv) == 0
    _assert_png(out)


def test_plot_draws_a_written_schedule(trace_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plan, out = tmp_path / "plan.json", tmp_path / "timeline.png"
    assert main(["plan", "--trace", str(trace_file), "--budget-mb", "9", "--out", str(plan)]) == 0
    assert (
        main(["plot", "--trace", str(trace_file), "--schedule", str(plan), "--out", str(out)]) == 0
    )
    _assert_png(out)


def test_plot_refuses_a_schedule_of_another_trace(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    plan = tmp_path / "plan.json"
    plan.write_text('{"post": {"7": [{"storage_id": 1, "kind": "COPY_D2H"}]}}')
    out = tmp_path / "timeline.png"
    err = _usage_error(
        ["plot", "--trace", str(trace_file), "--schedule", str(plan), "--out", str(out)], capsys
    )
    assert f"--schedule {plan}: does not fit this trace" in err
    assert not out.exists()


def test_plot_needs_a_schedule_or_a_budget(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(
        ["plot", "--trace", str(trace_file), "--out", str(tmp_path / "t.png")], capsys
    )
    assert "--schedule" in err and "--budget-mb" in err


def test_plot_draws_a_schedule_against_a_given_budget(trace_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plan, out = tmp_path / "plan.json", tmp_path / "timeline.png"
    assert main(["plan", "--trace", str(trace_file), "--budget-mb", "9", "--out", str(plan)]) == 0
    assert (
        main(
            [
                "plot",
                "--trace",
                str(trace_file),
                "--schedule",
                str(plan),
                "--budget-mb",
                "9",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    _assert_png(out)


def test_plot_refuses_a_planner_with_a_schedule(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    err = _usage_error(
        [
            "plot",
            "--trace",
            str(trace_file),
            "--schedule",
            str(plan),
            "--planner",
            "timed",
            "--out",
            str(tmp_path / "t.png"),
        ],
        capsys,
    )
    assert "--planner timed" in err and "--budget-mb" in err


def test_the_worked_example_of_the_formats_doc_is_what_the_code_writes() -> None:
    doc = Path(__file__).parents[2] / "docs" / "formats.md"
    trace_text, schedule_text = re.findall(r"```json\n(.*?)```", doc.read_text(), re.S)[:2]
    trace = ActivationTrace.from_json(trace_text)
    schedule = ResidencySchedule.from_json(schedule_text)
    assert json.loads(trace.to_json()) == json.loads(trace_text)
    assert json.loads(schedule.to_json()) == json.loads(schedule_text)
    result = simulate(trace, schedule)  # the figures the doc quotes
    assert (round(result.compute_ms, 2), round(result.total_ms, 2)) == (0.75, 1.27)
    assert result.peak_bytes == result.natural_peak_bytes == 8 * MIB
    assert [c.direction for c in result.copies] == ["D2H", "H2D"]
    # The variant with the matmul marked recompute.
    recompute_text = re.findall(r"```json\n(.*?)```", doc.read_text(), re.S)[2]
    marked = dataclasses.replace(
        trace, ops=(dataclasses.replace(trace.ops[0], recompute=True), trace.ops[1])
    )
    result = simulate(marked, ResidencySchedule.from_json(recompute_text))
    assert (result.recomputes, round(result.total_ms, 2), result.peak_host_bytes) == (1, 1.25, 0)
    assert not result.copies and result.peak_bytes == 8 * MIB


def test_plot_refuses_an_image_name_without_a_known_format(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "timeline.bmpx"
    err = _usage_error(
        ["plot", "--trace", str(trace_file), "--budget-mb", "9", "--out", str(out)], capsys
    )
    assert f"--out {out}" in err and ".png" in err


def recompute_trace() -> ActivationTrace:
    """``silu`` (marked recompute, 0.05 ms) makes storage 6 from storage 1, and only ``loss``
    reads 6 again, after three long ops. Over a 0.5 GB/s link, moving 6 out and back costs
    17 ms; making it again costs 0.05 ms: under 13 MiB (natural peak 16) the plan recomputes.
    """
    ops = (
        _op("embed", 0.1, (9, R), (1, W)),
        _op("silu", 0.05, (1, R), (6, W), pure=True),
        _op("mm1", 1.0, (9, R), (2, W)),
        _op("mm2", 1.0, (2, R), (3, W)),
        _op("mm3", 1.0, (3, R), (4, W)),
        _op("loss", 0.1, (6, R), (4, R), (5, W)),
        _op("backward", 0.1, (1, R), (5, R), (7, W)),
    )
    sizes = {1: 4 * MIB, 2: 4 * MIB, 3: 4 * MIB, 4: 4 * MIB, 5: MIB, 6: 4 * MIB, 7: MIB}
    return ActivationTrace(ops, sizes, frozenset({7}), None, 0.5, 0.5)


@pytest.fixture
def recompute_file(tmp_path: Path) -> Path:
    path = tmp_path / "recompute.json"
    path.write_text(recompute_trace().to_json())
    return path


def test_plan_prints_its_recomputes_and_both_bounds(
    recompute_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--trace", str(recompute_file), "--budget-mb", "13", "--out", str(out)]) == 0
    )
    schedule = ResidencySchedule.from_json(out.read_text())
    kinds = {action.kind for _, _, action in schedule.actions()}
    assert ActionKind.RECOMPUTE in kinds
    result = simulate(recompute_trace().with_limit(13 * MIB), schedule)
    assert result.recomputes == 1 and result.peak_bytes <= 13 * MIB
    printed = capsys.readouterr().out
    assert re.search(r"recomputes\s+│ 1 planned, 0\.050 ms of compute", printed)
    assert "without recomputing)" in printed  # the offload-only bound, far above


def test_plot_draws_recomputes_on_the_compute_lane(recompute_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from swapopt_core._cli.plot import plot_timeline

    trace = recompute_trace().with_limit(13 * MIB)
    schedule = ResidencySchedule()
    schedule.add_post(1, 6, ActionKind.RELEASE_DEVICE)
    schedule.add_pre(5, 6, ActionKind.RECOMPUTE)
    drawn = tmp_path / "timeline.svg"
    result = plot_timeline(trace, schedule, drawn)
    assert [(span.storage_id, span.op) for span in result.recomputed] == [(6, 1)]
    assert "#9467bd" in drawn.read_text()  # the recompute bar's colour
    plain = tmp_path / "plain.svg"
    plot_timeline(trace, None, plain)
    assert "#9467bd" not in plain.read_text()
    out = tmp_path / "timeline.png"
    argv = ["plot", "--trace", str(recompute_file), "--budget-mb", "13", "--out", str(out)]
    assert main(argv) == 0
    _assert_png(out)


def test_an_infeasible_budget_names_the_budget_the_floor_and_fails(
    recompute_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--trace", str(recompute_file), "--budget-mb", "4", "--out", str(out)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert err.startswith("swapopt plan: error: --budget-mb 4: no plan fits under the 4.00 MiB")
    assert "the floor, the least any plan needs, is 9.00 MiB" in err
    assert "op 5 (loss) reads and writes 9.00 MiB" in err
    assert "Pass --budget-mb 9 or more, or --allow-over" in err
    assert captured.out == "" and not out.exists()  # nothing written


def test_allow_over_writes_the_best_plan_and_says_so(
    recompute_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--trace", str(recompute_file), "--budget-mb", "4", "--out", str(out)]
    assert main([*argv, "--allow-over"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "Over budget: no plan fits under the 4.00 MiB asked" in printed
    assert "is 9.00 MiB" in printed and "Pass --budget-mb 9 or more" in printed
    assert "over the budget (--allow-over): it peaks at 9.00 MiB" in printed
    result = simulate(
        recompute_trace().with_limit(4 * MIB), ResidencySchedule.from_json(out.read_text())
    )
    assert result.peak_bytes == 9 * MIB  # the best any plan can do


def test_a_planner_over_a_feasible_budget_fails_unless_allowed(
    recompute_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from swapopt_core._planning.interface import ResidencyPlanner

    class Lazy(ResidencyPlanner):
        name = "lazy"

        def plan(self, trace: ActivationTrace) -> ResidencySchedule:
            return ResidencySchedule()

    monkeypatch.setattr(
        "swapopt_core._cli.support.choose_planner", lambda manager, name, flag="--planner": Lazy()
    )
    out = tmp_path / "plan.json"
    argv = ["plan", "--trace", str(recompute_file), "--budget-mb", "13", "--out", str(out)]
    assert main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--budget-mb 13: the plan by lazy peaks at 16.00 MiB, over the 13.00 MiB asked" in err
    assert "the floor, the least any plan needs, is 9.00 MiB" in err and not out.exists()
    assert main([*argv, "--allow-over"]) == 0
    assert out.exists()


def test_the_least_budget_reads_back_at_or_above_the_floor() -> None:
    from swapopt_core._cli.support import budget_bytes, least_budget_mb

    for floor in (1, 9 * MIB, 9 * MIB + 1, 123_456_789, 3 * MIB // 7):
        least = least_budget_mb(floor)
        assert budget_bytes(least) >= floor > budget_bytes(float(least) - 0.01)


def _recompute_schedule() -> ResidencySchedule:
    schedule = ResidencySchedule()
    schedule.add_post(1, 6, ActionKind.RELEASE_DEVICE)
    schedule.add_pre(5, 6, ActionKind.RECOMPUTE)
    return schedule


def test_plot_draws_a_recompute_at_least_the_minimum_width_in_the_legend() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from swapopt_core._cli.plot import MIN_RECOMPUTE_WIDTH, draw_timeline

    trace = recompute_trace().with_limit(13 * MIB)
    ops = list(trace.ops)
    ops[1] = dataclasses.replace(ops[1], duration_ms=0.001)  # a recompute of 1 µs in 3.3 ms
    figure, result = draw_timeline(
        dataclasses.replace(trace, ops=tuple(ops)), _recompute_schedule()
    )
    memory, lanes = figure.axes
    bars = [patch for patch in lanes.patches if patch.get_gid() == "recompute"]
    assert len(bars) == len(result.recomputed) == 1
    span = result.recomputed[0]
    assert span.end_ms - span.start_ms < MIN_RECOMPUTE_WIDTH * result.total_ms  # hair-thin
    low, high = lanes.get_xlim()
    assert bars[0].get_width() >= MIN_RECOMPUTE_WIDTH * (high - low) * (1 - 1e-9)  # float noise
    assert bars[0].get_x() <= span.start_ms and span.end_ms <= bars[0].get_x() + bars[0].get_width()
    assert bars[0].get_hatch() and to_hex(bars[0].get_facecolor()) == "#9467bd"  # not op grey
    legend = [text.get_text() for text in memory.get_legend().get_texts()]
    assert any(text.startswith("recompute") for text in legend)
    assert not [a for a in memory.get_children() if a.get_gid() in ("infeasible", "floor")]


@pytest.mark.parametrize(
    ("budget", "schedule", "words"),
    [
        (4, None, "No plan fits: the budget of 4.00 MiB\nis below the floor of 9.00 MiB."),
        (13, ResidencySchedule(), "The plan peaks at 16.00 MiB,\nover the budget of 13.00 MiB"),
    ],
)
def test_plot_marks_a_budget_no_plan_keeps(
    budget: int, schedule: ResidencySchedule | None, words: str
) -> None:
    pytest.importorskip("matplotlib")
    from swapopt_core._cli.plot import draw_timeline

    figure, _ = draw_timeline(recompute_trace().with_limit(budget * MIB), schedule)
    memory = figure.axes[0]
    marked = {artist.get_gid(): artist for artist in memory.get_children() if artist.get_gid()}
    assert words in marked["infeasible"].get_text()
    assert marked["budget"].get_linestyle() == ":"  # dotted, not the feasible dashes
    assert marked["floor"].get_ydata()[0] == 9.0  # MiB
    legend = [text.get_text() for text in memory.get_legend().get_texts()]
    assert "floor, the least any plan needs (9.0 MiB)" in legend


def test_plot_command_says_an_infeasible_budget_is_marked(
    recompute_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    argv = ["plot", "--trace", str(recompute_file), "--budget-mb", "4", "--out", str(out)]
    assert main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "Over budget, marked on the plot: no plan fits under the 4.00 MiB asked" in printed
    assert "Pass --budget-mb 9 or more." in printed
    _assert_png(out)
