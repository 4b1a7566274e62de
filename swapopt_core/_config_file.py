"""The settings file named by ``SWAPOPT_CONFIG``: YAML, JSON or TOML, read by its suffix.

The file holds swapopt's settings by field name (``swap_times: 8``), either at its top level
or under a ``swapopt`` section (a YAML/JSON key, a TOML ``[swapopt]`` table), so that one
file can be shared with other tools: with the section, the other top-level keys are theirs
and left alone. ``read_config_file`` only loads and checks the shape (a mapping, known keys);
the values are checked by ``swapopt_core.options.read_settings`` with the one parser, under
labels that name the file and the key (``/path/cfg.yaml: swap_times='x' is invalid; ...``).
A ``null`` value leaves the setting to its default. Every problem is a ``ValueError`` whose
message starts with the file's path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from swapopt_core._variables import CONFIG_ENV, closest

__all__ = ["SECTION", "SUFFIXES", "VARIABLE_ONLY", "read_config_file"]

#: The optional top-level section that holds the settings in a shared file.
SECTION = "swapopt"
#: File suffix (lower case) -> format name.
SUFFIXES = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON", ".toml": "TOML"}
#: Keys that look like settings but are environment variables only -> the variable.
VARIABLE_ONLY = {
    "strict": "SWAPOPT_STRICT",
    "lightning_auto": "SWAPOPT_LIGHTNING_AUTO",
    "config": CONFIG_ENV,
    "run": "SWAPOPT_RUN",
    "disable_plugin_autoload": "SWAPOPT_DISABLE_PLUGIN_AUTOLOAD",
    "loopback_gbps": "SWAPOPT_LOOPBACK_GBPS",
    "loopback_jitter_us": "SWAPOPT_LOOPBACK_JITTER_US",
}


def _parse(path: str, kind: str, text: str) -> object:
    """The file's text as Python data; a ``ValueError`` naming the file for bad syntax."""
    if kind == "JSON":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON: {error}.") from None
    if kind == "TOML":
        try:
            import tomllib  # Python 3.11 on
        except ImportError:  # Python 3.10: the same parser as the package tomli
            try:
                import tomli as tomllib  # type: ignore[import-not-found,no-redef]
            except ImportError:
                raise ValueError(
                    f"{path}: reading a TOML file on Python 3.10 needs tomli (pip install "
                    "tomli); or write the settings as YAML or JSON."
                ) from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path}: not valid TOML: {error}.") from None
    try:
        import yaml  # type: ignore[import-untyped]  # PyYAML ships no type information
    except ImportError:
        raise ValueError(
            f"{path}: reading a YAML file needs PyYAML (pip install pyyaml); or write the "
            "settings as JSON or TOML (a .json or .toml file)."
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        detail = " ".join(str(error).split())
        raise ValueError(f"{path}: not valid YAML: {detail}.") from None


def _load(path: str) -> object:
    suffix = Path(path).suffix.lower()
    kind = SUFFIXES.get(suffix)
    if kind is None:
        raise ValueError(
            f"{CONFIG_ENV}={path!r}: the file's suffix {suffix or '(none)'!r} says no format; "
            f"accepted: {', '.join(SUFFIXES)} (YAML, JSON or TOML)."
        )
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ValueError(
            f"{path}: cannot read the settings file named by {CONFIG_ENV}: {reason}. "
            f"Fix the path, or unset {CONFIG_ENV}."
        ) from None
    try:
        return _parse(path, kind, text)
    except RecursionError:
        raise ValueError(f"{path}: nests lists or mappings too deeply to be settings.") from None


def _unknown(path: str, prefix: str, key: object, fields: Collection[str]) -> str:
    """Why ``key`` is refused, with the closest field name or the variable it must be."""
    if not isinstance(key, str):
        return f"{prefix}{key!r} is not a setting name (names are text)"
    label = f"{prefix}{key}"
    if key.lower() in VARIABLE_ONLY:
        variable = VARIABLE_ONLY[key.lower()]
        return (
            f"{label!r} is not read from the file: set the environment variable {variable} instead"
        )
    name = key.lower()
    name = name[len("swapopt_") :] if name.startswith("swapopt_") else name
    near = name if name in fields else closest(name, fields)
    return f"{label!r} is unknown" + (f" (did you mean {near!r}?)" if near else "")


def read_config_file(
    path: str, fields: Collection[str]
) -> tuple[dict[str, object], dict[str, str]]:
    """Load the settings file at ``path`` and check its shape and keys.

    Args:
        path: The file, as ``SWAPOPT_CONFIG`` names it (``~`` is expanded); its suffix
            (``.yaml``, ``.yml``, ``.json``, ``.toml``) says the format.
        fields: The setting names the file may hold.

    Returns:
        The settings the file gives (field name -> value as written; ``null`` left out) and
        the label each is named by in errors (``"/path/cfg.yaml: swapopt.swap_times"``).

    Raises:
        ValueError: The suffix is not one of those; the file is missing or unreadable, its
            syntax is bad, it (or its ``swapopt`` section) is not a mapping, or it holds a
            key that is no setting (each listed with the closest name). The message starts
            with the path.
    """
    data = _load(path)
    if data is None:  # an empty YAML file: no settings
        return {}, {}
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{path}: must hold a mapping of settings (or a {SECTION!r} section of them), "
            f"got {type(data).__name__} {data!r:.80}."
        )
    prefix = ""
    settings: Mapping[Any, object] = data
    if SECTION in data:
        section = data[SECTION]
        stray = sorted(key for key in data if isinstance(key, str) and key in fields)
        if stray:
            raise ValueError(
                f"{path}: {', '.join(map(repr, stray))} beside the {SECTION!r} section would "
                f"be ignored; move them into the {SECTION!r} section."
            )
        if section is None:
            return {}, {}
        if not isinstance(section, Mapping):
            raise ValueError(
                f"{path}: the {SECTION!r} section must be a mapping of settings, got "
                f"{type(section).__name__} {section!r:.80}."
            )
        settings, prefix = section, f"{SECTION}."
    problems = [_unknown(path, prefix, key, fields) for key in settings if key not in fields]
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}. Known settings: {sorted(fields)}.")
    values = {key: value for key, value in settings.items() if value is not None}
    return values, {key: f"{path}: {prefix}{key}" for key in values}
