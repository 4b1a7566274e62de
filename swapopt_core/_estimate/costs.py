"""Price a recorded fake step with a device profile: the activation trace and the update.

The activation trace's op durations are ``DeviceProfile.op_ms`` of each op's FLOPs and bytes;
its link bandwidths are the profile's. The optimizer's update is memory-bound: its time is
the bytes torch's default (foreach) implementation reads and writes, over the memory
bandwidth. Per element of a parameter, in units of the parameter's element size:

- AdamW / Adam: 12 reads and 8 writes (decay the parameter, ``lerp_`` the first moment,
  ``mul_`` and ``addcmul_`` the second, its ``sqrt``, ``div_`` and ``add_`` of epsilon,
  ``addcdiv_`` into the parameter); 2 state tensors per parameter.
- SGD with momentum: 5 reads and 3 writes (decay, ``mul_``/``add_`` of the buffer, the
  update); 1 state tensor.

Optimizer state has the parameters' dtype (torch's optimizers make it with ``zeros_like``).
State of a parameter with fewer than ``min_numel`` elements is not swapped
(``SwapOptimizerConfig.min_numel``): it counts as fixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swapopt_core._estimate.fake_trace import FakeStep
from swapopt_core._estimate.profiles import DeviceProfile
from swapopt_core._planning.ir import ActivationTrace, TraceOp
from swapopt_core._planning.whole_step import OptimizerCosts

__all__ = ["OPTIMIZERS", "OptimizerModel", "activation_trace", "optimizer_costs"]


@dataclass(frozen=True)
class OptimizerModel:
    """How an optimizer's state and update scale with its parameters.

    Attributes:
        states: State tensors per parameter (each the parameter's size and dtype).
        element_passes: Element reads plus writes of one update per parameter element.
        launches: Kernel launches per pipeline batch (the foreach ops of one update).
    """

    states: int
    element_passes: int
    launches: int


#: The optimizers ``--optimizer`` knows.
OPTIMIZERS = {
    "adamw": OptimizerModel(states=2, element_passes=20, launches=10),
    "adam": OptimizerModel(states=2, element_passes=20, launches=10),
    "sgd": OptimizerModel(states=1, element_passes=8, launches=4),
    "adagrad": OptimizerModel(states=1, element_passes=10, launches=5),
    "rmsprop": OptimizerModel(states=1, element_passes=10, launches=5),
    "muon": OptimizerModel(states=1, element_passes=8, launches=4),
}


def activation_trace(step: FakeStep, profile: DeviceProfile) -> ActivationTrace:
    """The recorded step as an ``ActivationTrace``, each op priced with ``profile`` (an op
    without a kernel, a view, at nothing)."""
    ops = tuple(
        TraceOp(
            op.name,
            profile.op_ms(op.flops, op.nbytes, op.low_precision) if op.kernel else 0.0,
            op.accesses,
            op.recompute,
        )
        for op in step.ops
    )
    return ActivationTrace(
        ops,
        step.storage_sizes,
        step.retained,
        d2h_bandwidth_gbps=profile.d2h_gbps,
        h2d_bandwidth_gbps=profile.h2d_gbps,
        freed_after=step.freed_after,
    )


def optimizer_costs(
    params: Sequence[tuple[int, int]],
    optimizer: OptimizerModel,
    profile: DeviceProfile,
    min_numel: int = 1024,
) -> OptimizerCosts:
    """What the update costs.

    Args:
        params: ``(numel, element_size)`` of every trainable parameter, in step order.
        optimizer: The optimizer's model.
        profile: The device.
        min_numel: Parameters below this keep their state on the device.
    """
    units = []
    fixed = 0
    for numel, size in params:
        state = optimizer.states * numel * size
        if numel < min_numel:
            fixed += state
        else:
            units.append(state)
    state_bytes = optimizer.states * sum(n * s for n, s in params)
    moved = optimizer.element_passes * sum(n * s for n, s in params)
    update_ms = moved / (profile.mem_bandwidth_gbps * 1e9) * 1e3
    return OptimizerCosts(
        unit_bytes=tuple(units),
        update_ms_per_byte=update_ms / state_bytes if state_bytes else 0.0,
        fixed_state_bytes=fixed,
        batch_overhead_ms=optimizer.launches * profile.launch_overhead_us * 1e-3,
    )
