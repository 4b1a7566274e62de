"""The device-budget case of ``gpu_check.py``: one memory target for the whole step.

A plain AdamW step of an MLP (forward, backward, update) is measured first: its peak from
the device's allocator and its time. The same model then trains under
``OffloadConfig(device_budget_mb=...)`` at 60 % of that peak with
``OffloadSession(config, optimizer=opt)``; the section reports the whole-step peak the
session's meter saw against the target, the plan's predicted peak and time, the step time
against plain, and whether parameters and state stayed equal to the plain run bit for bit.
On CUDA it also reports the allocator's own peaks during the budgeted steps
(``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, the plain model dropped and
the cache emptied first, so both runs are measured alone) against the target: the meter
counts allocated bytes only. On the smoke run (CPU) the loopback runtime plays the device
and the meter counts storages.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MiB = 2**20
#: The target as a share of the plain step's measured peak.
SHARE = 0.6


def _mlp(width: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # both runs start from the same weights
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks).to(device)


def section_device_budget(m: Any, sizes: Any, deadline: float, ctx: dict) -> dict:
    """Plain AdamW against the same model under a whole-step device budget."""
    swapopt = ctx["swapopt"]
    runtime = ctx["offload_runtime"]
    gen = torch.Generator(device=m.device).manual_seed(0)
    x = torch.randn(sizes.mlp_batch, sizes.mlp_width, generator=gen, device=m.device)

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, scale: float) -> None:
        model(x * scale).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain = _mlp(sizes.mlp_width, sizes.mlp_layers, m.device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    plain_peaks, plain_times = [], []
    for i in range(1 + sizes.replays):
        if m.cuda:
            m.sync()
            torch.cuda.reset_peak_memory_stats()
        seconds = m.timed(lambda s=i + 1.0, a=plain, o=plain_opt: train_step(a, o, s))
        if i > 0:
            plain_times.append(seconds)
            if m.cuda:
                plain_peaks.append(torch.cuda.max_memory_allocated())
    if m.cuda:
        natural = max(plain_peaks)
        source = "torch.cuda.max_memory_allocated (plain), the session's meter (budgeted)"
    else:
        probe_model = _mlp(sizes.mlp_width, sizes.mlp_layers, m.device)
        probe_opt = torch.optim.AdamW(probe_model.parameters(), lr=1e-3)
        probe = swapopt.OffloadSession(
            swapopt.OffloadConfig(device_budget_mb=2**20, runtime=runtime), optimizer=probe_opt
        )
        for _ in range(2):
            with probe:
                probe_model(x).square().mean().backward()
            probe_opt.step()
            probe_opt.zero_grad(set_to_none=True)
        natural = probe.stats().step_peak_device_bytes
        source = "the session's meter (loopback storage count)"
    target_mb = SHARE * natural / MiB
    # The plain run's parameters, kept on the host for the comparison: its model and state
    # leave the device, so the allocator's peaks below are the budgeted run's alone.
    plain_params = [p.detach().to("cpu", copy=True) for p in plain.parameters()]
    del plain, plain_opt
    model = _mlp(sizes.mlp_width, sizes.mlp_layers, m.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = swapopt.OffloadConfig(
        device_budget_mb=target_mb, runtime=runtime, min_offload_kib=sizes.min_offload_kib
    )
    session = swapopt.OffloadSession(config, optimizer=opt)

    def budgeted(scale: float) -> Callable[[], None]:
        def run() -> None:
            with session:
                model(x * scale).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    times, allocated, reserved = [], [], []
    if m.cuda:
        gc.collect()  # the plain model and optimizer, if a cycle holds them
        m.sync()
        torch.cuda.empty_cache()  # the plain run's cached blocks would hide reserved growth
    for i in range(1 + sizes.replays):
        if i >= 2 and time.monotonic() > deadline:
            break
        if m.cuda:
            m.sync()
            torch.cuda.reset_peak_memory_stats()
        seconds = m.timed(budgeted(i + 1.0))
        if i > 0:
            times.append(seconds)
            if m.cuda:
                allocated.append(torch.cuda.max_memory_allocated())
                reserved.append(torch.cuda.max_memory_reserved())
    # The plain run took as many steps with the same inputs: the bits must agree.
    equal = all(
        torch.equal(a, b.detach().cpu())
        for a, b in zip(plain_params, model.parameters(), strict=True)
    )
    stats = session.stats()
    target = int(target_mb * MiB)
    median = sorted(times)[len(times) // 2] if times else None
    plain_median = sorted(plain_times)[len(plain_times) // 2] if plain_times else None
    return {
        "runtime": runtime,
        "peak_source": source,
        "plain_peak_bytes": natural,
        "target_bytes": target,
        "step_peak_device_bytes": stats.step_peak_device_bytes,
        "peak_over_target": stats.step_peak_device_bytes / target if target else None,
        "planned_peak_over_target": (
            stats.planned_step_peak_device_bytes / target
            if stats.planned_step_peak_device_bytes is not None and target
            else None
        ),
        "allocated_peak_bytes": max(allocated) if allocated else None,
        "reserved_peak_bytes": max(reserved) if reserved else None,
        "allocated_peak_over_target": max(allocated) / target if allocated and target else None,
        "reserved_peak_over_target": max(reserved) / target if reserved and target else None,
        "allocator_peaks_source": (
            "torch.cuda.max_memory_allocated / max_memory_reserved over each budgeted step "
            "(plain model dropped, cache emptied first)"
            if allocated
            else "no allocator statistics on cpu"
        ),
        "step_over_plain": median / plain_median if median and plain_median else None,
        "step_over_planned": (
            median * 1e3 / stats.planned_step_ms if median and stats.planned_step_ms else None
        ),
        "params_bitwise_equal": equal and len(times) == len(plain_times),
        "stats": dataclasses.asdict(stats),
    }
