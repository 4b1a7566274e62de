"""How many device bytes of swapped state are held right now, and the peak since install."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceLedger"]


@dataclass
class DeviceLedger:
    """Device bytes of swapped state held right now, and the peak since install.

    Staging adds a buffer's bytes when it allocates it and subtracts them when it gives the
    buffer back; ``SwapStats.resident_state_bytes`` and ``peak_resident_state_bytes`` read it.
    """

    current: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more held on the device."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        """Count ``nbytes`` given back."""
        self.current -= nbytes
