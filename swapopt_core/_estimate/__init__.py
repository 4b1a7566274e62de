"""``swapopt estimate``: plan a training step before it runs, from a fake-tensor trace.

See ``docs/estimate.md``. The parts: ``models`` (what ``--model`` names), ``fake_trace`` (one
step recorded on fake tensors), ``profiles`` (device rates), ``costs`` (the trace and the
update priced), ``breakdown`` (plain training and the plan), ``report`` (table and JSON).
"""

from swapopt_core._estimate.breakdown import Breakdown, Estimate, estimate
from swapopt_core._estimate.models import ModelSpec, model_spec
from swapopt_core._estimate.profiles import DeviceProfile, load_profile, profile_named
from swapopt_core._estimate.report import estimate_json, render_estimate

__all__ = [
    "Breakdown",
    "DeviceProfile",
    "Estimate",
    "ModelSpec",
    "estimate",
    "estimate_json",
    "load_profile",
    "model_spec",
    "profile_named",
    "render_estimate",
]
