"""How many device bytes of swapped state are held right now, and the peak since install."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceLedger"]


@dataclass
class DeviceLedger:
    """Device bytes of swapped state held right now, and the peak since install.

    Staging adds a buffer's bytes when it allocates it and subtracts them when it gives the
    buffer back; the state kept on the device for good (``resident_state_fraction``) is
    counted as ``held``. ``SwapStats.resident_state_bytes`` and ``peak_resident_state_bytes``
    read it; ``window_peak`` is the peak since the last ``open_window`` (one step's).
    """

    current: int = 0
    peak: int = 0
    held: int = 0
    window_peak: int = 0
    #: The most device memory the swap held reserved during a step (``note_reserved``).
    reserved_peak: int = 0

    def hold(self, nbytes: int) -> None:
        """The state kept on the device for good is ``nbytes`` now."""
        self.add(nbytes - self.held)
        self.held = nbytes

    def open_window(self) -> None:
        """Start a new ``window_peak`` from what is held now."""
        self.window_peak = self.current

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more held on the device."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.window_peak = max(self.window_peak, self.current)

    def sub(self, nbytes: int) -> None:
        """Count ``nbytes`` given back."""
        self.current -= nbytes
