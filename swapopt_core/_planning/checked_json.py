"""Strict reading of the trace and schedule JSON: every value checked where it is read.

``ActivationTrace.from_json`` and ``ResidencySchedule.from_json`` read through these helpers,
so a hand-edited or hostile file is refused with a ``ValueError`` that names the JSON path
(``ops[3].duration_ms``), shows the value as JSON writes it (``NaN``, ``Infinity``, ``-5``)
and says what is accepted, instead of failing later with an ``OverflowError`` or planning
with nonsense. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import NoReturn, TypeVar

# Byte counts and ids are int64 downstream (the session, the runtimes, numpy timelines).
from swapopt_core._options import MAX_BYTES

__all__ = [
    "MAX_BYTES",
    "as_bool",
    "as_int",
    "as_list",
    "as_number",
    "as_object",
    "as_record",
    "as_text",
    "choice",
    "fail",
    "index_key",
    "load_object",
]

_SHOWN = 60  # characters of a refused value quoted in an error

E = TypeVar("E", bound=Enum)


def _show(value: object) -> str:
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def fail(path: str, value: object, accepted: str) -> NoReturn:
    """Raise the one error of this module: path, value, what is accepted."""
    raise ValueError(f"{path}={_show(value)} is invalid; expected {accepted}.")


def load_object(text: str, what: str) -> dict[str, object]:
    """``text`` parsed as a JSON object, or a ``ValueError`` that says why not."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"The {what} is not valid JSON: {error}") from None
    except RecursionError:
        raise ValueError(
            f"The {what} nests JSON arrays or objects too deeply to be a {what}; "
            "a trace is at most four levels deep."
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"The {what} must be a JSON object, got {type(data).__name__}.")
    return data


def as_object(value: object, path: str) -> dict[str, object]:
    if not isinstance(value, dict):
        fail(path, value, "a JSON object")
    return value


def as_record(value: object, path: str, required: tuple[str, ...], what: str) -> dict[str, object]:
    """A JSON object that has every key in ``required`` (``what`` names it: "an op")."""
    record = as_object(value, path)
    for key in required:
        if key not in record:
            fail(path, value, f"{what} with a {key!r}")
    return record


def as_list(value: object, path: str) -> list[object]:
    if not isinstance(value, list):
        fail(path, value, "a JSON array")
    return value


def as_bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        fail(path, value, "true or false")
    return value


def as_text(value: object, path: str) -> str:
    if not isinstance(value, str):
        fail(path, value, "a string")
    return value


def as_int(value: object, path: str, *, minimum: int | None = 0, what: str = "bytes") -> int:
    """A JSON integer from ``minimum`` up to int64's largest (``None``: no lower bound)."""
    low = -MAX_BYTES - 1 if minimum is None else minimum
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_BYTES:
        floor = "" if minimum is None else f" >= {minimum}"
        fail(path, value, f"an integer{floor} that fits in int64 ({what})")
    return value


def as_number(value: object, path: str, *, positive: bool = False, unit: str) -> float:
    """A finite JSON number >= 0 (> 0 when ``positive``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        fail(path, value, f"a finite number {'> 0' if positive else '>= 0'} ({unit})")
    return float(value)


def choice(value: object, path: str, kind: type[E]) -> E:
    """One member of the enum ``kind``, by its value."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        fail(path, value, f"one of {[member.value for member in kind]}")


def index_key(key: str, path: str, *, what: str, signed: bool = False) -> int:
    """An object key that holds a decimal integer (>= 0 unless ``signed``)."""
    text = key.strip()
    digits = text[1:] if signed and text.startswith("-") else text
    if not digits.isdecimal() or not digits.isascii():
        fail(path, key, f"a key holding a decimal integer{'' if signed else ' >= 0'} ({what})")
    return as_int(int(text), path, minimum=None if signed else 0, what=what)
