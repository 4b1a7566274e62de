"""Frozen, validated configuration of the optimizer-state swap."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from swapopt_core._options import (
    NO,
    YES,
    Invalid,
    Option,
    parse_bool,
    parse_choice,
    parse_int,
    parse_name,
    parse_name_list,
    read_options,
)

__all__ = ["OptionsConfig", "SwapOptimizerConfig"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


C = TypeVar("C", bound="OptionsConfig")


class OptionsConfig:
    """A config the integrations build from loose options: a YAML section, ``SWAPOPT_*``
    environment variables or command-line flags. Each config says how it reads its fields
    (``option_readers``); ``from_options`` is the one way they are read."""

    @classmethod
    def option_readers(cls, framework: str | None) -> dict[str, Option]:
        """How ``from_options`` reads each field (``framework`` as given to it)."""
        raise NotImplementedError(f"{cls.__name__} declares no option readers.")

    @classmethod
    def from_options(
        cls: type[C],
        values: Mapping[str, object],
        *,
        source: str | None = None,
        labels: Mapping[str, str] | None = None,
        framework: str | None = None,
        base: C | None = None,
    ) -> C:
        """Build a config from options as a YAML file, the environment or flags give them.

        Every integration reads its settings through here; ``option_readers`` says what each
        field accepts.

        Args:
            values: Field name to value; fields not given keep ``base``'s value.
            source: What holds the values, named in errors. Default: the class name.
            labels: How errors name each field (for example its environment variable).
            framework: ``"torch"`` or ``"mindspore"``, for configs whose names depend on
                the framework's registered plugins (``SwapOptimizerConfig``); ``None``
                checks what the config can without one.
            base: Values of the fields not given. Default: the field defaults.

        Raises:
            ValueError: An unknown field or a value the field does not accept; the message
                names the field as ``source.field`` (or its label), shows the value and
                says what is accepted.
        """
        options = cls.option_readers(framework)
        read = read_options(
            options, values, source=cls.__name__ if source is None else source, labels=labels
        )
        kept = {} if base is None else {name: getattr(base, name) for name in options}
        return cls(**{**kept, **read})


@dataclass(frozen=True)
class SwapOptimizerConfig(OptionsConfig):
    """How an optimizer's state is kept in host memory and streamed through the step.

    Args:
        swap_times: Number of byte-balanced batches the step is pipelined over. While batch
            ``i`` is updated, batch ``i + 1`` is copied in and batch ``i - 1`` copied out (at
            the same time, on runtimes with a copy queue per direction), so at most
            ``3 / swap_times`` of the state is on the device at any moment. Clamped to the
            number of parameters being stepped. Default: 16.
        state_keys: Names of the state entries to swap (for Adam/AdamW any of ``exp_avg``,
            ``exp_avg_sq``, ``max_exp_avg_sq``). ``None`` swaps every key the optimizer
            family declares. Keys the family does not own are rejected at install.
            Default: None.
        min_numel: State tensors with fewer elements stay on the device; tiny tensors cost
            more in copy latency than they save. ``0`` swaps everything. Default: 1024.
        include_master_params: Also swap optimizer-owned fp32 master weights, for families
            that keep them (MindFormers AdamW). Families without master weights reject
            ``True``. Default: False.
        packed_swap: ``True`` keeps all swapped state in one exact-size host buffer per dtype
            and moves each batch with one copy per dtype through three reusable device arenas;
            ``False`` gives every state tensor its own host mirror and device storage.
            ``None`` takes the runtime's default (packed for torch runtimes). Default: None.
        runtime: Transfer runtime by name. ``"auto"`` picks the runtime registered for the
            device the states live on (CUDA for CUDA tensors; CPU-only states are not
            swapped). ``"loopback"`` treats CPU tensors as the device and a separate CPU
            buffer as the host, so the whole engine runs without an accelerator, with
            synchronous copies; ``"loopback-async"`` does the same with a worker thread per
            copy direction, as CUDA streams would (paced by ``SWAPOPT_LOOPBACK_GBPS`` and
            ``SWAPOPT_LOOPBACK_JITTER_US``). Plugins may register more names.
            Default: "auto".
        prefetch_during_backward: Start copying the first ``prefetch_batches`` batches of
            the next step's state in at the first gradient of each backward (torch), so the
            step finds them on the device. Costs ``prefetch_batches / swap_times`` of the
            swapped state in device memory from then until the step; ``False`` keeps
            backward's peak as without it. Default: True.
        resident_state_fraction: Share of the swappable state bytes that stays on the device
            for good, never copied: the leading parameters in step order (``param_groups``
            order) whose state fits this share of the total. The step updates them first,
            while the first swapped batch comes in. ``0.0`` swaps all of it, ``1.0`` none
            (the state is still taken into account, so the share can change later).
            Default: 0.0.
        prefetch_batches: Batches of the next step's swapped state copied in during
            backward (see ``prefetch_during_backward``). Each costs about
            ``1 / swap_times`` of the swapped state in device memory from the first gradient
            until the step; clamped to the number of batches. ``0`` prefetches nothing, and
            so does ``prefetch_during_backward=False`` whatever this says. The step itself
            holds at most three batches either way. Default: 2.

    Raises:
        TypeError: A field has the wrong type.
        ValueError: A field is out of range.
    """

    swap_times: int = 16
    state_keys: tuple[str, ...] | None = None
    min_numel: int = 1024
    include_master_params: bool = False
    packed_swap: bool | None = None
    runtime: str = "auto"
    prefetch_during_backward: bool = True
    resident_state_fraction: float = 0.0
    prefetch_batches: int = 2

    @property
    def effective_prefetch_batches(self) -> int:
        """Batches prefetched during backward: ``prefetch_batches``, or 0 when switched off."""
        return self.prefetch_batches if self.prefetch_during_backward else 0

    def __post_init__(self) -> None:
        if not _is_int(self.swap_times):
            raise TypeError(
                f"SwapOptimizerConfig.swap_times must be an int, got {self.swap_times!r}. "
                "Pass the number of pipeline batches, e.g. swap_times=8."
            )
        if self.swap_times < 1:
            raise ValueError(
                f"SwapOptimizerConfig.swap_times must be at least 1, got {self.swap_times}. "
                "Use 1 to move all state in one batch, or more to lower the device peak."
            )
        if not _is_int(self.min_numel):
            raise TypeError(
                f"SwapOptimizerConfig.min_numel must be an int, got {self.min_numel!r}."
            )
        if self.min_numel < 0:
            raise ValueError(
                f"SwapOptimizerConfig.min_numel must be >= 0, got {self.min_numel}. "
                "Use 0 to swap every state tensor."
            )
        if self.state_keys is not None:
            keys = (self.state_keys,) if isinstance(self.state_keys, str) else self.state_keys
            try:
                keys = tuple(keys)
            except TypeError:
                raise TypeError(
                    "SwapOptimizerConfig.state_keys must be None or a sequence of state names, "
                    f"got {self.state_keys!r}."
                ) from None
            bad = [k for k in keys if not isinstance(k, str) or not k]
            if bad or not keys:
                raise ValueError(
                    "SwapOptimizerConfig.state_keys must name at least one state entry, "
                    f"got {self.state_keys!r}. Use None to swap every key the optimizer owns."
                )
            if len(set(keys)) != len(keys):
                raise ValueError(f"SwapOptimizerConfig.state_keys lists a key twice: {keys!r}.")
            object.__setattr__(self, "state_keys", keys)
        for name in ("include_master_params", "prefetch_during_backward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"SwapOptimizerConfig.{name} must be True or False, "
                    f"got {getattr(self, name)!r}."
                )
        if self.packed_swap is not None and not isinstance(self.packed_swap, bool):
            raise TypeError(
                f"SwapOptimizerConfig.packed_swap must be True, False or None, "
                f"got {self.packed_swap!r}. None takes the runtime's default."
            )
        fraction = self.resident_state_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise TypeError(
                "SwapOptimizerConfig.resident_state_fraction must be a number in [0, 1], "
                f"got {fraction!r}. Use 0.0 to swap all state, 1.0 to keep it all resident."
            )
        if not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
            raise ValueError(
                "SwapOptimizerConfig.resident_state_fraction must be in [0, 1], "
                f"got {fraction!r}. Use 0.0 to swap all state, 1.0 to keep it all resident."
            )
        object.__setattr__(self, "resident_state_fraction", float(fraction))
        if not _is_int(self.prefetch_batches):
            raise TypeError(
                "SwapOptimizerConfig.prefetch_batches must be an int, "
                f"got {self.prefetch_batches!r}. Pass how many batches to copy in during "
                "backward, e.g. prefetch_batches=2."
            )
        if self.prefetch_batches < 0:
            raise ValueError(
                f"SwapOptimizerConfig.prefetch_batches must be >= 0, got {self.prefetch_batches}. "
                "Use 0 to prefetch nothing during backward."
            )
        if not isinstance(self.runtime, str) or not self.runtime.strip():
            raise ValueError(
                f"SwapOptimizerConfig.runtime must be a runtime name, got {self.runtime!r}. "
                "Use 'auto', 'cuda', 'loopback' or 'loopback-async' (plugins may add more)."
            )

    @classmethod
    def option_readers(cls, framework: str | None) -> dict[str, Option]:
        """How ``from_options`` reads each field. Strings are accepted for every field:
        integers as decimal text, booleans as yes/no words, ``packed_swap`` also as
        ``auto``, ``state_keys`` as comma-separated names. With a ``framework`` (``"torch"``
        or ``"mindspore"``), ``runtime`` is checked against that framework's registered
        runtimes and ``state_keys`` against its families' state names, here rather than at
        install; ``None`` checks types only."""
        return _swap_options(framework)


def _runtime_names(framework: str) -> list[str]:
    from swapopt_core._plugins import runtime_names

    return runtime_names(framework)


def _state_key_names(framework: str) -> list[str]:
    from swapopt_core._plugins import state_key_names

    return state_key_names(framework)


def _swap_options(framework: str | None) -> dict[str, Option]:
    """How ``from_options`` reads each field of ``SwapOptimizerConfig``."""
    words = "/".join(YES + NO)
    if framework is None:
        runtime = Option(parse_name, "a runtime name")
        keys = Option(parse_name_list(None), "null, or distinct state names")
    else:
        names = functools.partial(_runtime_names, framework)
        state_names = functools.partial(_state_key_names, framework)
        runtime = Option(parse_choice(names), f"one of the {framework} runtimes {{choices}}", names)
        keys = Option(
            parse_name_list(state_names),
            "null, or distinct names out of {choices} (a list, or comma-separated)",
            state_names,
        )
    return {
        "swap_times": Option(parse_int(1), "an integer >= 1"),
        "state_keys": keys,
        "min_numel": Option(parse_int(0), "an integer >= 0"),
        "include_master_params": Option(parse_bool, f"a boolean ({words})"),
        "packed_swap": Option(
            _parse_packed, f"'auto' or null for the runtime's default, or a boolean ({words})"
        ),
        "runtime": runtime,
        "prefetch_during_backward": Option(parse_bool, f"a boolean ({words})"),
        "resident_state_fraction": Option(_parse_fraction, "a number in [0, 1]"),
        "prefetch_batches": Option(parse_int(0), "an integer >= 0"),
    }


def _parse_fraction(value: object) -> float:
    """A number in ``[0, 1]``, given as a number or its text."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise Invalid from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise Invalid
    return float(value)


def _parse_packed(value: object) -> bool | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "none")):
        return None
    return parse_bool(value)
