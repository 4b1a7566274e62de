"""``resident_state_fraction`` on the MindSpore engine: the leading parameters in step order
whose state fits the share stay on the device for good, and the updates stay bit-exact
against plain MindSpore optimizers (CPU, loopback runtimes)."""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from swapopt_core import SwapOptError, swap_optimizer, swap_stats  # noqa: E402
from swapopt_core._planning.resident import resident_count  # noqa: E402
from tests.mindspore_backend.test_mindspore import (  # noqa: E402, F401
    FAMILIES,
    SHAPES,
    _pynative_cpu,
    assert_same,
    config,
    grads_for,
    make_params,
)

pytestmark = pytest.mark.mindspore

STEPS = 12
#: Swappable state bytes of each parameter of ``SHAPES`` for Adam-like families (two moments).
UNIT_BYTES = [2 * 4 * int(np.prod(shape)) for shape in SHAPES]


def expected_resident(fraction: float) -> set[int]:
    return set(range(resident_count(UNIT_BYTES, fraction)))


def check_layout(opt, fraction: float) -> None:
    engine = opt._swapopt_engine
    resident = expected_resident(fraction)
    assert engine.resident_indices() == resident
    assert {slot.index for slot in engine.slots.values()} == set(range(len(SHAPES))) - resident
    # Swapped state lives in host memory between steps; resident state is the Parameter's own.
    assert all(slot.state.data_ptr() == slot.host.data_ptr() for slot in engine.slots.values())
    swapped = sum(UNIT_BYTES[i] for i in range(len(SHAPES)) if i not in resident)
    assert swap_stats(opt).total_state_bytes == swapped


CASES = [
    pytest.param(family, runtime, fraction, packed, id=f"{runtime}-{fraction}-{family}-{packed}")
    for runtime, fractions in (("loopback", (0.3, 0.8, 1.0)), ("loopback-async", (0.5,)))
    for fraction in fractions
    for family in ("adam", "adamwd")
    for packed in (True, False)
    if runtime == "loopback" or packed
]


@pytest.mark.parametrize(("family", "runtime", "fraction", "packed"), CASES)
def test_resident_share_is_bit_exact_and_never_moves(family, runtime, fraction, packed):
    make = FAMILIES[family]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    cfg = config(
        runtime=runtime, swap_times=3, packed_swap=packed, resident_state_fraction=fraction
    )
    swap_optimizer(opt, cfg)
    check_layout(opt, fraction)
    for step in range(STEPS):
        grads = grads_for(step, params)
        ref(grads)
        opt(grads)
    assert_same(ref_params, params, ref, opt)
    check_layout(opt, fraction)
    stats = swap_stats(opt)
    # Only the swapped share crosses the link; the resident one never does.
    assert stats.h2d_bytes == stats.d2h_bytes == STEPS * stats.total_state_bytes
    assert stats.resident_state_bytes == 0


def test_the_whole_share_resident_moves_nothing():
    ref_params, params = make_params(), make_params()
    ref, opt = FAMILIES["adam"](ref_params), FAMILIES["adam"](params)
    swap_optimizer(opt, config(swap_times=4, resident_state_fraction=1.0))
    for step in range(4):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    assert_same(ref_params, params, ref, opt)
    stats = swap_stats(opt)
    assert stats.swapped_tensors == 0 and stats.h2d_bytes == stats.d2h_bytes == 0


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
def test_reconfigure_moves_only_the_changed_share_and_stays_exact(packed):
    ref_params, params = make_params(), make_params()
    ref, opt = FAMILIES["adamwd"](ref_params), FAMILIES["adamwd"](params)
    swap_optimizer(opt, config(swap_times=3, packed_swap=packed))
    engine = opt._swapopt_engine
    step = 0
    for fraction in (0.0, 0.8, 0.3, 1.0, 0.0):
        hosts = {(slot.key, slot.index): slot.host.data_ptr() for slot in engine.slots.values()}
        engine.reconfigure(
            config(swap_times=3, packed_swap=packed, resident_state_fraction=fraction)
        )
        check_layout(opt, fraction)
        # State that became resident was copied back to the device, off the host copies.
        for key, states in engine.keyed_states().items():
            for i in expected_resident(fraction):
                assert states[i].data_ptr() != hosts.get((key, i)), (key, i)
        for _ in range(3):
            ref(grads_for(step, params))
            opt(grads_for(step, params))
            step += 1
        assert_same(ref_params, params, ref, opt)
    with pytest.raises(SwapOptError, match=r"changes \['min_numel'\]"):
        engine.reconfigure(config(swap_times=3, packed_swap=packed, min_numel=7))


def test_a_device_budget_keeps_resident_what_fits_beside_the_staging():
    from swapopt_core._mindspore.budget import fit_device_budget

    ref_params, params = make_params(), make_params()
    ref, opt = FAMILIES["adam"](ref_params), FAMILIES["adam"](params)
    swap_optimizer(opt, config(swap_times=8))
    total = sum(UNIT_BYTES)
    budget = 0.75 * total  # r * S + 3 * (1 - r) * S / 8 = 0.75 S  ->  r = 0.6
    fraction = fit_device_budget(opt, budget / 2**20)
    assert fraction == pytest.approx(0.6)
    check_layout(opt, fraction)
    for step in range(6):
        ref(grads_for(step, params))
        opt(grads_for(step, params))
    assert_same(ref_params, params, ref, opt)
    # Below the staging floor (3/8 of the state) the key, the value and the floor are named.
    with pytest.raises(ValueError, match=r"swap_optimizer.device_budget_mb=0.01 is below the flo"):
        fit_device_budget(opt, 0.01)
