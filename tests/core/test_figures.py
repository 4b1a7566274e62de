"""The figures people see: ``str(SwapStats)``, ``str(OffloadStats)`` and the flat
``swapopt/...`` figures every logger gets, on a real swap and session (loopback, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swapopt_core import (
    OffloadConfig,
    OffloadSession,
    OffloadStats,
    SwapOptimizerConfig,
    SwapStats,
    swap_optimizer,
    swap_stats,
)
from swapopt_core._figures import (
    OFFLOAD_KEYS,
    SWAP_KEYS,
    offload_figures,
    summary_line,
    swap_figures,
)

MIB = 2**20


def _swap(**fields: object) -> SwapStats:
    base = dict(
        total_state_bytes=12 * MIB,
        resident_state_bytes=0,
        peak_resident_state_bytes=768 * 1024,
        host_state_bytes=12 * MIB,
        pinned_host_bytes=12 * MIB,
        h2d_bytes=60 * MIB,
        d2h_bytes=60 * MIB,
        steps=5,
        swapped_tensors=24,
        batches=16,
        packed=True,
        runtime="cuda",
    )
    base.update(fields)
    return SwapStats(**base)  # type: ignore[arg-type]


def _offload(**fields: object) -> OffloadStats:
    base = dict(
        peak_resident_activation_bytes=MIB // 2,
        d2h_bytes=12 * MIB,
        h2d_bytes=12 * MIB,
        warmups=1,
        replays=3,
        recomputes=8,
        host_peak_bytes=3 * MIB,
        planned_actions=10,
        budget_bytes=MIB,
        activation_budget_bytes=MIB,
    )
    base.update(fields)
    return OffloadStats(**base)  # type: ignore[arg-type]


def test_swap_stats_line() -> None:
    stats = _swap()
    line = str(stats)
    assert line == stats.format() and "\n" not in line
    assert "kept off the device: 94 % of 12.00 MiB (device peak 768.00 KiB)" in line
    assert "host 12.00 MiB (pinned 12.00 MiB)" in line
    assert "per step 12.00 MiB in, 12.00 MiB out; 5 steps" in line
    assert "24 tensors in 16 batches (packed), runtime cuda" in line
    assert repr(stats).startswith("SwapStats(total_state_bytes=12582912,")
    kept = _swap(resident_for_good_bytes=3 * MIB, resident_state_fraction=0.25, steps=0)
    assert "25% resident for good" in str(kept) and "per step 0 B in, 0 B out" in str(kept)


def test_offload_stats_line() -> None:
    stats = _offload()
    line = str(stats)
    assert line == stats.format() and "\n" not in line
    assert "activations: peak 512.00 KiB on the device against a 1.00 MiB budget (50 %)" in line
    assert "per step 3.00 MiB offloaded, 3.00 MiB fetched back, 2 recomputed" in line
    assert "host peak 3.00 MiB; warmups 1, replays 3, re-traces 0" in line
    assert repr(stats).startswith("OffloadStats(peak_resident_activation_bytes=524288,")
    whole = _offload(
        activation_budget_bytes=None, step_peak_device_bytes=5 * MIB,
        planned_step_peak_device_bytes=4 * MIB,
    )  # fmt: skip
    assert "keeps every activation on the device" in str(whole)
    assert "whole step peak 5.00 MiB (planned 4.00 MiB)" in str(whole)


def test_figures_add_up_and_use_the_documented_keys() -> None:
    a, b = _swap(), _swap(total_state_bytes=4 * MIB, peak_resident_state_bytes=MIB, steps=2)
    figures = swap_figures([a, b])
    assert set(figures) == set(SWAP_KEYS) and all(isinstance(v, float) for v in figures.values())
    assert figures["swapopt/state_mib"] == 16
    assert figures["swapopt/state_device_peak_mib"] == 1.75
    assert figures["swapopt/state_off_device_mib"] == 14.25
    assert figures["swapopt/state_host_mib"] == 24
    assert figures["swapopt/h2d_mib_per_step"] == 12 + 30  # each optimizer's average
    assert figures["swapopt/optimizer_steps"] == 5
    offload = offload_figures([_offload(), _offload(peak_resident_activation_bytes=MIB)])
    assert set(offload) == set(OFFLOAD_KEYS)
    assert offload["swapopt/activation_peak_mib"] == 1 and offload["swapopt/activation_steps"] == 4
    assert offload["swapopt/activation_offloaded_mib_per_step"] == 6
    assert offload["swapopt/activation_recomputes_per_step"] == 4
    assert offload["swapopt/activation_budget_mib"] == 1
    assert swap_figures([]) == {} == offload_figures([])
    assert summary_line([], []) is None
    assert summary_line([a], [_offload()]) == f"swapopt: {a}; {_offload()}"


def test_figures_of_a_real_swap_and_session() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())
    swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback", swap_times=2, min_numel=16))
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=1, min_offload_kib=0, runtime="loopback")
    )
    x = torch.randn(8, 64)
    for _ in range(3):
        with session:
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    stats, offload = swap_stats(opt), session.stats()
    figures = {**swap_figures([stats]), **offload_figures([offload])}
    assert figures["swapopt/state_host_mib"] == stats.host_state_bytes / MIB > 0
    assert figures["swapopt/d2h_mib_per_step"] == stats.d2h_bytes / 3 / MIB
    assert figures["swapopt/optimizer_steps"] == 3 and figures["swapopt/activation_steps"] == 3
    assert figures["swapopt/activation_budget_mib"] == pytest.approx(1, abs=1e-6)
    assert "runtime loopback" in str(stats) and "warmups 1, replays 2" in str(offload)
    assert dataclasses.replace(stats).format() == str(stats)
