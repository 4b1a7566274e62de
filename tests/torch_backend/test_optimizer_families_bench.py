"""``benchmarks/optimizer_families.py --quick``, in process: the table has a row for every
optimizer on both runtimes, each served by the path it names, and every row ends with the
same parameters and state as the plain optimizer."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType

from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "optimizer_families.py"


def _script() -> ModuleType:
    name = "optimizer_families_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_quick_run_has_every_row_and_keeps_the_bits() -> None:
    script = _script()
    out = io.StringIO()
    report = script.run(["--quick", "--steps", "1"], console=Console(file=out, width=200))
    rows = [row for result in report["results"] for row in result["rows"]]
    names = script.row_names()
    assert "AdamW dedicated" in names and "AdamW generic" in names and "Muon" in names
    expected = [(name, runtime) for name in names for runtime in script.RUNTIMES]
    assert [(row["optimizer"], row["runtime"]) for row in rows] == expected
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["bit_exact"], (row["optimizer"], row["runtime"])
        assert row["swapped_s"] > 0 and row["plain_s"] > 0
        assert row["peak_over_plain_state"] is not None
        generic = row["optimizer"] != "AdamW dedicated"
        assert row["adapter"] == ("PerParameterAdapter" if generic else "TorchAdamAdapter")
        assert (row["over_dedicated"] is not None) == (row["optimizer"] == "AdamW generic")
    head, table = report["table"]["head"], report["table"]["rows"]
    assert len(table) == len(expected)
    assert all(cells[head.index("bit-exact")] == "yes" for cells in table)
    assert "AdamW generic" in out.getvalue()
