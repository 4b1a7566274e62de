"""Replay a residency schedule against a trace in simulated time.

The model has one compute stream and one copy stream per direction. Host issue order for op
``i`` is: the ``pre`` actions in list order, op ``i``, the ``post`` actions in list order, then
the natural frees of op ``i``. ``t`` is the compute clock: the time at which all compute work
issued so far has finished. Copy durations are ``bytes / (bandwidth * 1e9)`` seconds.

Actions, issued at compute time ``t``:

* ``COPY_D2H(s)``: ``s`` must be on the device. If its host copy is already valid nothing
  happens. Otherwise the copy runs on the D2H stream from ``max(t, D2H stream free, end of a
  copy into s still running)``; the host copy counts in host bytes from the issue on. ``s``
  stays on the device.
* ``RELEASE_DEVICE(s)``: if ``s`` is on the device and has a valid host copy, or can be
  recomputed (below), compute waits until every copy using ``s`` has finished
  (``t = max(t, D2H end of s, H2D end of s)``), then ``s`` is freed. Otherwise it does nothing
  (counted in ``ignored_actions``).
* ``COPY_H2D(s)``: if ``s`` is on the device nothing happens (ignored). Otherwise ``s`` needs a
  valid host copy; it is allocated at ``t`` (it counts as resident from then on, in flight or
  not) and copied on the H2D stream from ``max(t, H2D stream free, D2H end of s)``. Ops that
  access ``s`` wait for the end of that copy.
* ``RELEASE_HOST(s)``: drops a host copy of a storage that is on the device (host bytes only);
  otherwise ignored.
* ``RECOMPUTE(s)``: if ``s`` is on the device nothing happens (ignored). Otherwise the op that
  made ``s`` runs again on the compute stream: ``s`` must be recomputable and its producer's
  inputs on the device (a reload in flight counts: the recompute waits for it). ``s`` is
  allocated when the recompute starts and the compute clock advances by the producer's
  duration. A valid host copy of ``s`` stays valid (the bytes are the same).

**Recomputable.** The producer of ``s`` is the op of its first access, a write by an op marked
``recompute``. With ``k`` the last op that has run (``i - 1`` in ``pre`` of op ``i``, ``i`` in
``post``), ``s`` is recomputable when nothing in ops ``producer+1 .. k`` wrote ``s`` or any of
the producer's *inputs* (the storages it accessed and did not create), and no input has been
freed. A release without a host copy asks more: that ``s`` has a recipe (below) and that this
holds until ``s`` is next read (or until the end, for a kept output; now, for a storage past
its last access). Other outputs of the producer are temporaries of the recompute and are not
counted.

**Recipes** (``recipes.py``). As the replay does, the simulator keeps a recipe for every
storage with a ``RECOMPUTE`` action or released without ever being copied out, from its
producer to its drop op (or, when it is off the device without a host copy then, until it
dies). A recipe holds its producer's inputs: an input whose last access passed while a recipe
still holds it stays alive (on the device, unless released) and dies when the last such
recipe goes.

Op ``i``: a storage appears on the device at the start of its first access (normally the
write that creates it). An accessed storage that is not on the device is brought back on
demand: with a valid host copy it is allocated and copied on the H2D stream (after whatever
that stream is doing) while compute waits (``demand_fetches``); without one, a recomputable
storage is recomputed, its inputs brought back first by the same rule
(``demand_recomputes``). The op starts at ``max(t, ends of the copies into the storages it
accesses, ends of the copies out of the storages it writes)`` and runs for its duration; a
write makes the host copy stale (it is never copied back). Natural free: after the post
actions of op ``i``, every storage freed then (its last access, or the trace's ``freed_after``
for one the caller held longer) that is not retained and no recipe holds leaves the device,
with its host copy; its memory returns when the copies still using it end
(at ``t`` when none runs). Retained storages must be on the device when the step ends: one
still off is brought back then, and the step ends when the last copy into one lands. Storage
ids absent from ``storage_sizes`` never count.

Errors (``ValueError`` naming the op and the storage): an action on a storage absent from
``storage_sizes`` or at an op index outside the trace, ``COPY_D2H`` of a storage that is not on
the device, ``COPY_H2D`` of a storage without a valid host copy, ``RECOMPUTE`` of a storage that
cannot be recomputed there or whose inputs are off the device, and an access to a storage that
has neither a valid host copy nor a way to be recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

from swapopt_core._planning.index import TraceIndex
from swapopt_core._planning.ir import ActivationTrace, ResidencySchedule
from swapopt_core._planning.machine import CopySpan, Machine, RecomputeSpan, SimulationResult
from swapopt_core._planning.recipes import recipe_lives

__all__ = [
    "CopySpan",
    "Machine",
    "RecomputeSpan",
    "SimulationResult",
    "TraceIndex",
    "simulate",
]


def _check_ops(side: dict, n: int, name: str) -> None:
    for op in side:
        if not 0 <= op < n:
            raise ValueError(f"The schedule has {name} actions at op {op}; the trace has {n} ops.")


def simulate(
    trace: ActivationTrace,
    schedule: ResidencySchedule | None = None,
    *,
    record: bool = True,
    index: TraceIndex | None = None,
) -> SimulationResult:
    """Replay ``schedule`` on ``trace`` with the rules of the module docstring.

    Args:
        trace: The ops, storages and bandwidths.
        schedule: The actions; ``None`` replays the trace with no actions.
        record: Keep ``timeline`` and ``copies`` (turn off for speed when only totals matter).
        index: A ``TraceIndex`` of ``trace`` built earlier, to save rebuilding it.

    Returns:
        The timing, memory and copy figures of the replay.

    Raises:
        ValueError: The schedule names an unknown storage or op, copies out a storage that is
            not on the device, or needs a host copy that does not exist.
    """
    ix = index if index is not None else TraceIndex(trace)
    machine = Machine(ix, record=record, recipes=recipe_lives(ix, schedule))
    pre: dict[int, Sequence] = {}
    post: dict[int, Sequence] = {}
    if schedule is not None:
        _check_ops(schedule.pre, ix.n, "pre")
        _check_ops(schedule.post, ix.n, "post")
        pre, post = schedule.pre, schedule.post
    for i in range(ix.n):
        for action in pre.get(i, ()):
            machine.apply(action.kind, action.storage_id, f"before op {i}")
        machine.run_op(i)
        for action in post.get(i, ()):
            machine.apply(action.kind, action.storage_id, f"after op {i}")
        machine.natural_free(i)
    machine.finish()
    return machine.result()
