"""Regenerate the numbers and the image the docs show from the examples that produce them.

Run from the repository root::

    python docs/regenerate.py           # rewrite the numbers in place, draw docs/img/*.png
    python docs/regenerate.py --check   # exit 1 if a page's numbers differ from what it writes

What it writes sits in the pages between ``<!-- regenerate: NAME -->`` and
``<!-- /regenerate -->``; the text between is replaced whole, so edit the template here, not
the page. The doc tests run ``--check`` (planning takes about a second; the image is drawn only
without ``--check``, since its pixels carry no claim the text does not also state); it leaves
out the slow sections, which only a full run rewrites.

- ``timeline`` (docs/activation_offload.md, docs/img/timeline.png): one training step of a
  Llama-70B-shaped decoder cut to 2 layers (``swapopt_core._planning.synthetic``), planned by
  the default planner at half its natural peak, simulated and drawn as ``swapopt plot`` draws
  it.
- ``estimate-8b`` (docs/estimate.md, slow: two to three minutes on two cores): the table
  ``swapopt estimate`` prints for Llama-3-8B at batch 1, sequence 4096, H200, 70,000 MiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parent
MIB = 1024 * 1024
#: The timeline example's budget (MiB): half the step's natural peak.
TIMELINE_BUDGET_MB = 2363


def _timeline(draw: bool) -> str:
    """The timeline paragraph's text; with ``draw``, docs/img/timeline.png too."""
    from swapopt_core._planning.bounds import overhead_lower_bound
    from swapopt_core._planning.interface import resolve_planner
    from swapopt_core._planning.simulate import simulate
    from swapopt_core._planning.synthetic import SHAPES, llama_training_trace
    from swapopt_core._plugins import get_plugin_manager, residency_planners

    shape = dataclasses.replace(SHAPES["70b"], layers=2)
    trace = llama_training_trace(shape).with_limit(TIMELINE_BUDGET_MB * MIB)
    planner = resolve_planner("auto", residency_planners(get_plugin_manager()), label="planner")
    schedule = planner.plan(trace)
    planned = simulate(trace, schedule)
    bound = overhead_lower_bound(trace)
    offload_only = overhead_lower_bound(trace, recompute=False)
    copies = {
        direction: sum(1 for copy in planned.copies if copy.direction == direction)
        for direction in ("D2H", "H2D")
    }
    recomputes = planned.recomputes + planned.demand_recomputes
    if draw:
        from swapopt_core._cli.plot import plot_timeline

        plot_timeline(trace, schedule, DOCS / "img" / "timeline.png")
    return (
        f"The picture above is a synthetic trace (`swapopt_core._planning.synthetic`) of one "
        f"training step of a Llama-70B-shaped decoder cut to 2 layers (sequence "
        f'{shape.seq}, {len(trace.ops)} ops), planned by `"{planner.name}"` at 50 % of its '
        f"natural peak: {TIMELINE_BUDGET_MB:,} MiB instead of "
        f"{planned.natural_peak_bytes / MIB:,.0f} MiB. The plan peaks at "
        f"{planned.peak_bytes / MIB:,.0f} MiB and makes the step "
        f"{100 * planned.overhead:.1f} % longer, with {copies['D2H']} copies out, "
        f"{copies['H2D']} copies back and {recomputes} recomputes: the bound in "
        f"`swapopt_core._planning.bounds` says no schedule can do better than "
        f"{100 * bound:.1f} % here, and {100 * offload_only:.1f} % without recomputing (on "
        f"this link, copies alone cannot hide behind the step's compute; recomputing the "
        f"cheap activations is what makes the plan almost free). The copies out run back to "
        f"back through the forward pass, the reloads are spread over the backward pass, each "
        f"issued ahead of the op that reads it."
    )


def _estimate_8b(draw: bool) -> str:
    """The 8B estimate's table (docs/estimate.md): ``swapopt estimate`` run, its JSON read."""
    import json
    import subprocess
    import tempfile

    from swapopt_core._figures import format_bytes

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "estimate.json"
        command = [sys.executable, "-m", "swapopt_core", "estimate", "--model",
                   str(DOCS.parent / "benchmarks" / "configs" / "llama3_8b.json"), "--batch",
                   "1", "--seq", "4096", "--device", "h200", "--budget-mb", "70000", "--json",
                   str(out)]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        found = json.loads(out.read_text())
    plain, plan = found["plain"], found["plan"]
    rows = [
        ("parameters", "params_bytes"),
        ("gradients", "grads_bytes"),
        ("optimizer state on the device", "optimizer_state_bytes"),
        ("activations, peak", "activations_peak_bytes"),
        ("whole step, peak", "peak_bytes"),
    ]
    lines = ["| | plain | plan at 70,000 MiB |", "| --- | ---: | ---: |"]
    lines += [
        f"| {label} | {format_bytes(plain[key])} | {format_bytes(plan[key])} |"
        for label, key in rows
    ]
    lines += [
        f"| step time | {plain['step_ms']:.1f} ms | {plan['step_ms']:.1f} ms |",
        f"| resident optimizer state | | {100 * plan['resident_state_fraction']:.0f} % |",
        f"| swap_times | | {plan['swap_times']} |",
        f"| batches prefetched in backward | | {plan['prefetch_batches']} |",
        f"| activation budget | | {format_bytes(plan['activation_budget_bytes'])} |",
        "",
        f"{found['ops']:,} ops traced on fake tensors.",
    ]
    return "\n".join(lines) + "\n"


#: name -> (page, the function writing its text, whether ``--check`` leaves it out as slow)
SECTIONS: dict[str, tuple[str, Callable[[bool], str], bool]] = {
    "timeline": ("activation_offload.md", _timeline, False),
    "estimate-8b": ("estimate.md", _estimate_8b, True),
}
_SECTION = re.compile(
    r"<!-- regenerate: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /regenerate -->", re.S
)


def _wrap(text: str, width: int = 100) -> str:
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines) + "\n"


def regenerate(check: bool) -> list[str]:
    """Rewrite (or, with ``check``, compare) every section; return the stale ones' names."""
    stale: list[str] = []
    for name, (page, make, slow) in SECTIONS.items():
        if check and slow:
            continue
        path = DOCS / page
        text = path.read_text(encoding="utf-8")
        found = [m for m in _SECTION.finditer(text) if m["name"] == name]
        if len(found) != 1:
            raise SystemExit(f"{page}: expected one '<!-- regenerate: {name} -->' section")
        made = make(not check)
        body = made if made.startswith("|") else _wrap(made)
        if found[0]["body"] != body:
            stale.append(f"{page} ({name})")
            if not check:
                start, end = found[0].span("body")
                path.write_text(text[:start] + body + text[end:], encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = regenerate(args.check)
    if stale and args.check:
        print(f"stale: {', '.join(stale)}; run python docs/regenerate.py", file=sys.stderr)
        return 1
    print(f"rewrote: {', '.join(stale)}" if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
