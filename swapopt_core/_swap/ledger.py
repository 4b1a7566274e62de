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

    #: What ``note_reserved`` subtracts from a reserved reading: the memory reserved at the
    #: window's start beyond what the swap held then (``None``: reserved is not known).
    _reserved_base: int | None = None

    def open_window(self, reserved: int | None = None) -> None:
        """Start a new ``window_peak`` from what is held now.

        Args:
            reserved: The runtime's ``reserved_bytes()`` now (``None``: unknown). What it
                holds beyond the swap's own bytes (other tensors, blocks cached by earlier
                steps, other optimizers sharing the runtime) is not the step's: only the
                growth from here on counts, on top of what the swap holds.
        """
        self.window_peak = self.current
        self._reserved_base = None if reserved is None else reserved - self.current
        self.note_reserved(reserved)

    def note_reserved(self, reserved: int | None) -> None:
        """Take a reading of the device's reserved memory into ``reserved_peak``.

        The swap held at least what the books say (``current``); with the allocator's
        reading, also the blocks it reserved and could not reuse yet.
        """
        sample = self.current
        if reserved is not None and self._reserved_base is not None:
            sample = max(sample, reserved - self._reserved_base)
        self.reserved_peak = max(self.reserved_peak, sample)

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more held on the device."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.window_peak = max(self.window_peak, self.current)

    def sub(self, nbytes: int) -> None:
        """Count ``nbytes`` given back."""
        self.current -= nbytes
