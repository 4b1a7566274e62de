"""Device profiles: what one op and one copy cost on a device that is not here.

A profile holds sustained rates, not datasheet peaks, because the estimate prices eager ops one
at a time. The built-in GPU figures are derived from the vendors' datasheets as follows
(assumptions, stated so they can be argued with):

- ``bf16_tflops``: dense bf16/fp16 tensor-core peak times 0.7, about what large GEMMs sustain
  in public measurements of eager PyTorch (H100 and H200 SXM: 989 TFLOPS peak -> 690).
- ``fp32_tflops``: non-tensor-core fp32 peak times 0.8 (PyTorch does not use TF32 for matmuls
  unless asked; H100/H200 SXM: 67 TFLOPS -> 54).
- ``mem_bandwidth_gbps``: HBM peak times 0.9 (H100 SXM HBM3 3.35 TB/s -> 3015; H200 SXM
  HBM3e 4.8 TB/s -> 4320).
- ``h2d_gbps`` / ``d2h_gbps``: PCIe Gen5 x16, 64 GB/s per direction in theory, about 50 GB/s
  measured with pinned host memory.
- ``launch_overhead_us``: a few microseconds per eager op (launch and framework overhead).

The ``cpu`` profile is measured on this machine when it is first asked for (a matmul per
dtype, a large copy, a loop of tiny ops: well under a second), so that an estimate for CPU
training is priced with this CPU's own rates. Its link rates are the copy bandwidth (a
loopback runtime copies in host memory).

A profile file (``--profile FILE``) is a JSON object with the keys of :data:`PROFILE_KEYS`
(``name`` optional), each a finite number > 0.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_PROFILES",
    "PROFILE_KEYS",
    "DeviceProfile",
    "load_profile",
    "profile_named",
    "read_json",
]

#: The number keys of a profile file, with what each means.
PROFILE_KEYS = {
    "bf16_tflops": "sustained matmul rate in bf16/fp16, TFLOP/s",
    "fp32_tflops": "sustained matmul rate in fp32, TFLOP/s",
    "mem_bandwidth_gbps": "sustained device memory bandwidth, GB/s",
    "h2d_gbps": "host-to-device copy bandwidth, GB/s",
    "d2h_gbps": "device-to-host copy bandwidth, GB/s",
    "launch_overhead_us": "fixed cost of one op, microseconds",
}


@dataclass(frozen=True)
class DeviceProfile:
    """The rates one device is priced with (see the module docstring for the units)."""

    name: str
    bf16_tflops: float
    fp32_tflops: float
    mem_bandwidth_gbps: float
    h2d_gbps: float
    d2h_gbps: float
    launch_overhead_us: float

    def op_ms(self, flops: float, nbytes: float, low_precision: bool) -> float:
        """One op's time: ``max(flops / rate, bytes / bandwidth)`` plus the launch overhead."""
        rate = self.bf16_tflops if low_precision else self.fp32_tflops
        compute = flops / (rate * 1e12)
        memory = nbytes / (self.mem_bandwidth_gbps * 1e9)
        return max(compute, memory) * 1e3 + self.launch_overhead_us * 1e-3

    def to_dict(self) -> dict[str, object]:
        """The profile as a JSON-ready mapping (what a profile file holds)."""
        return asdict(self)


BUILTIN_PROFILES = {
    "h100": DeviceProfile("h100", 690.0, 54.0, 3015.0, 50.0, 50.0, 4.0),
    "h200": DeviceProfile("h200", 690.0, 54.0, 4320.0, 50.0, 50.0, 4.0),
}
_NAMES = (*BUILTIN_PROFILES, "cpu")


def profile_named(name: str) -> DeviceProfile:
    """The built-in profile ``name`` (``h100``, ``h200`` or ``cpu``, case-insensitive).

    Raises:
        ValueError: No built-in profile has that name; the message lists those that do.
    """
    key = name.strip().lower()
    if key == "cpu":
        return _measured_cpu()
    if key not in BUILTIN_PROFILES:
        raise ValueError(
            f"--device {name}: no built-in device profile has that name. Choose one of "
            f"{', '.join(_NAMES)}, or describe the device in a JSON file and pass "
            "--profile FILE."
        )
    return BUILTIN_PROFILES[key]


def read_json(flag: str, path: str, what: str) -> object:
    """The JSON in ``path``, or a ``ValueError`` naming ``flag``, the path and the fault
    (``what`` says what the file should be, e.g. ``"JSON"``, ``"a JSON config"``)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot be read ({error.strerror}).") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{flag} {path}: not {what} ({error}).") from None


def load_profile(path: str) -> DeviceProfile:
    """Read a profile file (a JSON object with every key of :data:`PROFILE_KEYS`).

    Raises:
        ValueError: The file cannot be read, is not a JSON object, lacks a key, or has a value
            that is not a finite number > 0; the message names the file, the key and the fix.
    """
    data = read_json("--profile", path, "JSON")
    example = ", ".join(f'"{key}": ...' for key in PROFILE_KEYS)
    if not isinstance(data, dict):
        raise ValueError(f"--profile {path}: expected a JSON object {{{example}}}.")
    values: dict[str, float] = {}
    for key, meaning in PROFILE_KEYS.items():
        if key not in data:
            raise ValueError(
                f"--profile {path}: the key {key!r} ({meaning}) is missing; a profile gives "
                f"every one of {', '.join(PROFILE_KEYS)}."
            )
        value = data[key]
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if number is None or not math.isfinite(number) or number <= 0:
            raise ValueError(
                f"--profile {path}: {key} = {value!r}, expected a finite number > 0 ({meaning})."
            )
        values[key] = float(number)
    unknown = sorted(set(data) - set(PROFILE_KEYS) - {"name"})
    if unknown:
        raise ValueError(
            f"--profile {path}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
            f"name, {', '.join(PROFILE_KEYS)}."
        )
    name = data.get("name", Path(path).stem)
    if not isinstance(name, str):
        raise ValueError(f"--profile {path}: name = {name!r}, expected a string.")
    return DeviceProfile(name, **values)


@lru_cache(maxsize=1)
def _measured_cpu() -> DeviceProfile:
    """This CPU's rates, measured once per process (see the module docstring)."""
    import torch

    def best_seconds(work: object, repeats: int = 3) -> float:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            work()  # type: ignore[operator]
            best = min(best, time.perf_counter() - start)
        return best

    n = 512
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # the first call sets up the kernel; it is not timed
        rates[dtype] = 2 * n**3 / best_seconds(lambda a=a, b=b: torch.mm(a, b)) / 1e12
    big = torch.empty(16 * 2**20, dtype=torch.uint8)
    out = torch.empty_like(big)
    out.copy_(big)
    copy_gbps = 2 * big.numel() / best_seconds(lambda: out.copy_(big)) / 1e9
    tiny = torch.zeros(4)
    loops = 200

    def tiny_ops() -> None:
        for _ in range(loops):
            torch.add(tiny, 1.0)

    overhead_us = best_seconds(tiny_ops) / loops * 1e6
    link = copy_gbps / 2  # a copy of N bytes reads N and writes N
    profile = DeviceProfile(
        "cpu", rates[torch.bfloat16], rates[torch.float32], copy_gbps, link, link, overhead_us
    )
    logger.info("measured cpu profile: %s", profile)
    return profile
