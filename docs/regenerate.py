"""Regenerate the numbers and the image the docs show from the examples that produce them.

Run from the repository root::

    python docs/regenerate.py           # rewrite the numbers in place, draw docs/img/*.png
    python docs/regenerate.py --check   # exit 1 if a page's numbers differ from what it writes

What it writes sits in the pages between ``<!-- regenerate: NAME -->`` and
``<!-- /regenerate -->``; the text between is replaced whole, so edit the template here, not
the page. The doc tests run ``--check`` (planning takes about a second; the image is drawn only
without ``--check``, since its pixels carry no claim the text does not also state).

- ``timeline`` (docs/activation_offload.md, docs/img/timeline.png): one training step of a
  Llama-70B-shaped decoder cut to 2 layers (``swapopt_core._planning.synthetic``), planned by
  the default planner at half its natural peak, simulated and drawn as ``swapopt plot`` draws
  it.
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


SECTIONS: dict[str, tuple[str, Callable[[bool], str]]] = {
    "timeline": ("activation_offload.md", _timeline),
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
    for name, (page, make) in SECTIONS.items():
        path = DOCS / page
        text = path.read_text(encoding="utf-8")
        found = [m for m in _SECTION.finditer(text) if m["name"] == name]
        if len(found) != 1:
            raise SystemExit(f"{page}: expected one '<!-- regenerate: {name} -->' section")
        body = _wrap(make(not check))
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
