"""One parser for swapopt's options, wherever they are written.

Keyword arguments, a YAML section, ``SWAPOPT_*`` environment variables and command-line
flags all reach a config through ``read_options``: it checks the keys, turns strings into
the field's type with one vocabulary (``yes``/``no`` words, ``auto``, numbers), and raises
a ``ValueError`` that names where the value came from, what it was and what is accepted.
The configs (``SwapOptimizerConfig.from_options``, ``OffloadConfig.from_options``) declare
their fields with ``Option``; nothing else in swapopt parses an option.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_BYTES",
    "NO",
    "YES",
    "Invalid",
    "Option",
    "parse_bool",
    "parse_choice",
    "parse_int",
    "parse_rate",
    "parse_mib",
    "parse_name",
    "parse_name_list",
    "read_options",
]

#: Words read as True and False, case-insensitive (YAML and kwargs may also give bools).
YES = ("1", "true", "yes", "y", "on", "t")
NO = ("0", "false", "no", "n", "off", "f")
#: Words that mean "no value" where a field accepts None.
NONE_WORDS = ("none", "null")
#: The largest byte count a size may come to: sizes become int64 byte counts downstream.
MAX_BYTES = 2**63 - 1


class Invalid(Exception):
    """Raised by a parser for a value it does not accept; ``read_options`` words the error."""


def _word(value: object) -> str | None:
    return value.strip().lower() if isinstance(value, str) else None


def parse_bool(value: object) -> bool:
    """A bool, or one of the ``YES`` / ``NO`` words."""
    if isinstance(value, bool):
        return value
    word = _word(value)
    if word in YES:
        return True
    if word in NO:
        return False
    raise Invalid


def env_flag(environ: Mapping[str, str], name: str, meaning: str = "") -> bool:
    """Environment variable ``name`` as a yes/no word; unset or empty: no.

    Raises:
        ValueError: It holds another word: the message names it, shows the value and lists
            the accepted words (with ``meaning``, what a yes does).
    """
    raw = environ.get(name, "")
    if not raw.strip():
        return False
    try:
        return parse_bool(raw)
    except Invalid:
        yes = f"; a yes word {meaning}" if meaning else ""
        raise ValueError(
            f"environment variable {name}={raw!r} is invalid; accepted: a boolean "
            f"({'/'.join(YES + NO)}, any case; empty for no){yes}."
        ) from None


def parse_int(minimum: int) -> Callable[[object], int]:
    """A parser for integers >= ``minimum``, given as an int or its decimal text."""

    def parse(value: object) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise Invalid from None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise Invalid
        return value

    return parse


def parse_mib(*, allow_none: bool, unit: int = 2**20) -> Callable[[object], float | None]:
    """A parser for a size (a number >= 0, or its text); ``none`` if allowed.

    Args:
        allow_none: Whether ``None`` and the ``NONE_WORDS`` mean "no value".
        unit: Bytes per unit (``2**20`` for MiB, ``2**10`` for KiB): sizes whose bytes
            would not fit in an int64 are refused, as are infinities and NaN.
    """

    def parse(value: object) -> float | None:
        number = _number(value, allow_none=allow_none)
        if number is not None and not (0 <= number < float("inf") and number * unit <= MAX_BYTES):
            raise Invalid
        return number

    return parse


def _number(value: object, *, allow_none: bool) -> float | None:
    """A number given as an int, a float or its text; ``None`` for "no value" if allowed."""
    word = _word(value)
    if allow_none and (value is None or word in NONE_WORDS or word == ""):
        return None
    if word is not None:
        try:
            value = float(word)
        except ValueError:
            raise Invalid from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid
    return float(value)


def parse_rate(value: object) -> float | None:
    """A finite number > 0 (or its text); empty or a ``NONE_WORDS`` word means no limit."""
    number = _number(value, allow_none=True)
    if number is not None and not 0 < number < float("inf"):
        raise Invalid
    return number


def parse_choice(choices: Callable[[], Collection[str]]) -> Callable[[object], str]:
    """A parser for one name out of ``choices()`` (asked only when a value is checked)."""

    def parse(value: object) -> str:
        if not isinstance(value, str) or value.strip() not in choices():
            raise Invalid
        return value.strip()

    return parse


def parse_name(value: object) -> str:
    """Any non-empty name (checked against a registry later, where it is looked up)."""
    if not isinstance(value, str) or not value.strip():
        raise Invalid
    return value.strip()


def parse_name_list(choices: Callable[[], Collection[str]] | None) -> Callable[[object], Any]:
    """A parser for ``None`` or distinct names (a sequence, or comma-separated text)."""

    def parse(value: object) -> tuple[str, ...] | None:
        if value is None or _word(value) in NONE_WORDS:
            return None
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        if not isinstance(value, list | tuple) or not value:
            raise Invalid
        names = tuple(value)
        if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
            raise Invalid
        if choices is not None and not set(names) <= set(choices()):
            raise Invalid
        return names

    return parse


@dataclass(frozen=True)
class Option:
    """One field of a config as ``read_options`` reads it.

    Attributes:
        parse: Turns a given value into the field's value; raises ``Invalid`` otherwise.
        accepted: What is accepted, in words, for error messages; ``{choices}`` is filled
            in with ``choices()`` when given.
        choices: The names the field accepts, asked only for an error message.
    """

    parse: Callable[[object], Any]
    accepted: str
    choices: Callable[[], Collection[str]] | None = None

    def describe(self) -> str:
        if self.choices is None:
            return self.accepted
        return self.accepted.format(choices=sorted(self.choices()))


def read_options(
    options: Mapping[str, Option],
    values: Mapping[str, object],
    *,
    source: str,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Check and convert ``values`` against the fields in ``options``.

    Args:
        options: Field name to its ``Option``.
        values: Field name to value, as given; a field not given is left out of the result.
        source: What holds the values, named in errors (``"swap_optimizer"``,
            ``"SwapOptimizerCallback"``, ``"environment"``).
        labels: How to name a field in errors (``{"swap_times": "SWAPOPT_SWAP_TIMES"}``);
            by default ``source.field``.

    Returns:
        The converted value of every field given.

    Raises:
        ValueError: ``values`` is not a mapping, names a field that does not exist (the
            message lists those that do) or holds a value the field does not accept (the
            message names the field, shows the value and says what is accepted).
    """
    if not isinstance(values, Mapping):
        raise ValueError(
            f"{source} must be a mapping of option names to values, got {values!r}. "
            f"Accepted options: {sorted(options)}."
        )
    unknown = sorted(set(values) - set(options), key=str)
    if unknown:
        raise ValueError(
            f"{source} has no option {', '.join(map(repr, unknown))}; accepted options: "
            f"{sorted(options)}."
        )
    labels = labels or {}
    result: dict[str, Any] = {}
    for name, value in values.items():
        option = options[name]
        try:
            result[name] = option.parse(value)
        except Invalid:
            label = labels.get(name, f"{source}.{name}")
            raise ValueError(
                f"{label}={value!r} is invalid; accepted: {option.describe()}."
            ) from None
    return result
