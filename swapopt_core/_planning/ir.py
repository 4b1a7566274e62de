"""What the tracer records and the planner produces, with their JSON forms.

A trace is the op sequence of one forward+backward: each op's name, duration and the
storages it reads and writes. A storage id (``sid``) names one device storage (views share
it). A schedule lists residency actions to issue before (``pre``) or after (``post``) ops.
See ``docs/formats.md`` for the JSON schema and the exact meaning of every action.

Bandwidths are in GB/s (10**9 bytes per second).

The trace is also what a session replays: with the schedule, it is the whole contract between
the planner and the executor (op names to match, where each op's new storages are among its
outputs), so a trace and a schedule read back from JSON drive a replay like fresh ones.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from swapopt_core._planning import checked_json as cj

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "Access",
    "AccessKind",
    "Action",
    "ActionKind",
    "ActivationTrace",
    "ResidencySchedule",
    "TraceOp",
]

#: Storages smaller than this are offloaded only when the budget cannot be met otherwise;
#: what a trace that does not say (``min_offload_bytes``) asks of its planner. 1 MiB.
DEFAULT_MIN_OFFLOAD_BYTES = 2**20


class AccessKind(str, Enum):
    """How an op touches a storage."""

    READ = "READ"
    WRITE = "WRITE"


class ActionKind(str, Enum):
    """What a schedule does to a storage at an op boundary."""

    COPY_D2H = "COPY_D2H"
    RELEASE_DEVICE = "RELEASE_DEVICE"
    COPY_H2D = "COPY_H2D"
    RELEASE_HOST = "RELEASE_HOST"


@dataclass(frozen=True)
class Access:
    """One op's access to one storage.

    Attributes:
        storage_id: The storage.
        kind: ``READ``, or ``WRITE`` (created or modified it).
        output: On the access that creates the storage in a trace a session recorded: the
            position of the new tensor among the op's outputs, flattened (pytree leaf order).
            Replay finds the storage there. ``None`` everywhere else.
    """

    storage_id: int
    kind: AccessKind
    output: int | None = None


@dataclass(frozen=True)
class TraceOp:
    """One op of the trace: its name, how long it ran, what it touched."""

    name: str
    duration_ms: float
    accesses: tuple[Access, ...] = ()


def _check_positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"ActivationTrace.{name} must be > 0 GB/s, got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class ActivationTrace:
    """A recorded (or synthetic) forward+backward.

    Attributes:
        ops: The ops in execution order.
        storage_sizes: Bytes of every activation storage; accesses to other storage ids
            (parameters, inputs) do not count towards device memory.
        retained_sids: Storages still alive after the step (outputs the user keeps): they
            are never released at their last access.
        memory_limit_bytes: Device budget for activation storages; ``None`` = unlimited.
        d2h_bandwidth_gbps: Device-to-host copy bandwidth in GB/s.
        h2d_bandwidth_gbps: Host-to-device copy bandwidth in GB/s.
        min_offload_bytes: Storages smaller than this are offloaded only when the budget
            cannot be met otherwise (a copy's fixed cost outweighs what they free). A session
            writes its ``OffloadConfig.min_offload_kib`` here, so a saved trace is planned
            again as the session planned it.
    """

    ops: tuple[TraceOp, ...]
    storage_sizes: Mapping[int, int]
    retained_sids: frozenset[int] = frozenset()
    memory_limit_bytes: int | None = None
    d2h_bandwidth_gbps: float = 16.0
    h2d_bandwidth_gbps: float = 16.0
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "storage_sizes", dict(self.storage_sizes))
        object.__setattr__(self, "retained_sids", frozenset(self.retained_sids))
        object.__setattr__(self, "min_offload_bytes", int(self.min_offload_bytes))
        _check_positive("d2h_bandwidth_gbps", self.d2h_bandwidth_gbps)
        _check_positive("h2d_bandwidth_gbps", self.h2d_bandwidth_gbps)
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 0:
            raise ValueError(
                "ActivationTrace.memory_limit_bytes must be >= 0 or None, "
                f"got {self.memory_limit_bytes!r}."
            )
        if self.min_offload_bytes < 0:
            raise ValueError(
                f"ActivationTrace.min_offload_bytes must be >= 0, got {self.min_offload_bytes!r}."
            )

    def with_limit(self, memory_limit_bytes: int | None) -> ActivationTrace:
        """The same trace under another budget."""
        return dataclasses.replace(self, memory_limit_bytes=memory_limit_bytes)

    def to_json(self) -> str:
        """Serialise in the schema of ``docs/formats.md``."""
        return json.dumps(
            {
                "ops": [
                    {
                        "name": op.name,
                        "duration_ms": op.duration_ms,
                        "accesses": [_access_json(a) for a in op.accesses],
                    }
                    for op in self.ops
                ],
                "storage_sizes": {
                    str(sid): size for sid, size in sorted(self.storage_sizes.items())
                },
                "retained_sids": sorted(self.retained_sids),
                "memory_limit_bytes": self.memory_limit_bytes,
                "d2h_bandwidth_gbps": self.d2h_bandwidth_gbps,
                "h2d_bandwidth_gbps": self.h2d_bandwidth_gbps,
                "min_offload_bytes": self.min_offload_bytes,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ActivationTrace:
        """Parse what ``to_json`` wrote.

        Every value is checked: sizes and byte counts are integers >= 0 that fit in int64,
        durations finite numbers >= 0, bandwidths finite and > 0, kinds known names, and
        retained storages listed in ``storage_sizes``.

        Raises:
            ValueError: Not JSON, nested too deeply, a missing key, or a value out of range;
                the message names its JSON path (``ops[3].duration_ms``), shows the value
                and says what is accepted.
        """
        data = cj.load_object(text, "trace")
        for key in ("ops", "storage_sizes"):
            if key not in data:
                raise ValueError(f"The trace has no {key!r}; every trace lists it.")
        sizes = {
            cj.index_key(sid, f"storage_sizes[{sid!r}]", what="a storage id", signed=True): (
                cj.as_int(size, f"storage_sizes[{sid!r}]")
            )
            for sid, size in cj.as_object(data["storage_sizes"], "storage_sizes").items()
        }
        retained = frozenset(
            _known_sid(sid, f"retained_sids[{i}]", sizes)
            for i, sid in enumerate(cj.as_list(data.get("retained_sids", []), "retained_sids"))
        )
        limit = data.get("memory_limit_bytes")
        return cls(
            tuple(_op_from(op, f"ops[{i}]") for i, op in enumerate(cj.as_list(data["ops"], "ops"))),
            sizes,
            retained,
            None if limit is None else cj.as_int(limit, "memory_limit_bytes"),
            _bandwidth(data, "d2h_bandwidth_gbps"),
            _bandwidth(data, "h2d_bandwidth_gbps"),
            cj.as_int(
                data.get("min_offload_bytes", DEFAULT_MIN_OFFLOAD_BYTES), "min_offload_bytes"
            ),
        )


def _known_sid(value: object, path: str, sizes: Mapping[int, int]) -> int:
    sid = cj.as_int(value, path, minimum=None, what="a storage id")
    if sid not in sizes:
        cj.fail(path, value, "a storage id listed in storage_sizes")
    return sid


def _bandwidth(data: Mapping[str, Any], key: str) -> float:
    return cj.as_number(data.get(key, 16.0), key, positive=True, unit="GB/s")


def _op_from(value: object, path: str) -> TraceOp:
    op = cj.as_object(value, path)
    for key in ("name", "duration_ms"):
        if key not in op:
            cj.fail(path, value, f"an op with a {key!r}")
    accesses = cj.as_list(op.get("accesses", []), f"{path}.accesses")
    return TraceOp(
        cj.as_text(op["name"], f"{path}.name"),
        cj.as_number(op["duration_ms"], f"{path}.duration_ms", unit="milliseconds"),
        tuple(_access_from(a, f"{path}.accesses[{j}]") for j, a in enumerate(accesses)),
    )


@dataclass(frozen=True)
class Action:
    """One residency action on one storage."""

    storage_id: int
    kind: ActionKind


@dataclass
class ResidencySchedule:
    """Actions to issue before (``pre``) and after (``post``) each op index."""

    pre: dict[int, list[Action]] = field(default_factory=dict)
    post: dict[int, list[Action]] = field(default_factory=dict)

    def add_pre(self, op: int, storage_id: int, kind: ActionKind) -> None:
        self.pre.setdefault(op, []).append(Action(storage_id, kind))

    def add_post(self, op: int, storage_id: int, kind: ActionKind) -> None:
        self.post.setdefault(op, []).append(Action(storage_id, kind))

    def actions(self) -> Iterable[tuple[str, int, Action]]:
        """Every action as ``("pre" | "post", op, action)``, in op order."""
        for op in sorted(set(self.pre) | set(self.post)):
            for action in self.pre.get(op, ()):
                yield "pre", op, action
            for action in self.post.get(op, ()):
                yield "post", op, action

    def __len__(self) -> int:
        return sum(len(v) for v in self.pre.values()) + sum(len(v) for v in self.post.values())

    def to_json(self) -> str:
        """Serialise in the schema of ``docs/formats.md``."""

        def side(actions: dict[int, list[Action]]) -> dict[str, list[dict[str, object]]]:
            return {
                str(op): [{"storage_id": a.storage_id, "kind": a.kind.value} for a in items]
                for op, items in sorted(actions.items())
                if items
            }

        return json.dumps({"pre": side(self.pre), "post": side(self.post)})

    @classmethod
    def from_json(cls, text: str) -> ResidencySchedule:
        """Parse what ``to_json`` wrote.

        Raises:
            ValueError: Not JSON, nested too deeply, or a malformed entry; the message names
                its JSON path (``pre["3"][0].kind``), shows the value and says what is
                accepted. Whether the ops and storages exist in a trace is checked where the
                schedule meets one (``simulate``, a session's ``load_plan``).
        """
        data = cj.load_object(text, "schedule")
        return cls(_side_from(data, "pre"), _side_from(data, "post"))


def _side_from(data: Mapping[str, Any], side: str) -> dict[int, list[Action]]:
    result: dict[int, list[Action]] = {}
    for op, items in cj.as_object(data.get(side, {}), side).items():
        path = f"{side}[{op!r}]"
        result[cj.index_key(op, path, what="an op index")] = [
            _action_from(item, f"{path}[{j}]") for j, item in enumerate(cj.as_list(items, path))
        ]
    return result


def _action_from(value: object, path: str) -> Action:
    action = cj.as_object(value, path)
    for key in ("storage_id", "kind"):
        if key not in action:
            cj.fail(path, value, f"an action with a {key!r}")
    return Action(
        cj.as_int(action["storage_id"], f"{path}.storage_id", minimum=None, what="a storage id"),
        cj.choice(action["kind"], f"{path}.kind", ActionKind),
    )


def _access_json(access: Access) -> dict[str, object]:
    written: dict[str, object] = {"storage_id": access.storage_id, "kind": access.kind.value}
    if access.output is not None:
        written["output"] = access.output
    return written


def _access_from(value: object, path: str) -> Access:
    access = cj.as_object(value, path)
    for key in ("storage_id", "kind"):
        if key not in access:
            cj.fail(path, value, f"an access with a {key!r}")
    output = access.get("output")
    return Access(
        cj.as_int(access["storage_id"], f"{path}.storage_id", minimum=None, what="a storage id"),
        cj.choice(access["kind"], f"{path}.kind", AccessKind),
        None if output is None else cj.as_int(output, f"{path}.output", what="an output position"),
    )
