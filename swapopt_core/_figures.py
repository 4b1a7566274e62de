"""Figures for people: byte counts in binary units, and the stats' one-line summaries."""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps the number at 1 or above.

    Example:
        >>> format_bytes(3 * 2**20), format_bytes(512), format_bytes(1536)
        ('3.00 MiB', '512 B', '1.50 KiB')
    """
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    value = float(nbytes)
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
