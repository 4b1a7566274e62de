"""Synthetic activation traces of Llama-shaped decoder training steps.

One step is the forward of every layer, the loss, then the backward in reverse, at the
granularity of the kernels a typical implementation launches: RMSNorm, the q/k/v/o
projections, RoPE, a flash-style attention (it saves q, k, v, its output and the
log-sum-exp), the residual adds, and the gated MLP (gate, up, SiLU, multiply, down). Backward
reads the saved activations and creates gradient storages that die after their last use;
weight gradients go to parameter storages, which are not activations.

Durations come from a roofline: matmuls (and attention) from their FLOPs at ``tflops``,
everything else from the bytes it reads and writes at ``hbm_tbps``, plus a launch cost.
Sizes are bf16 (fp32 for the norm and attention statistics). Both copy directions run at
``link_gbps``.

Ops that give the same bits when run again on the same inputs are marked ``recompute``: the
embedding lookup, norms, RoPE, SiLU, the gated multiply, residual adds, the matmuls (priced by
their duration), the flash attention forward, and the backward ops that create a fresh
gradient from their inputs. Not marked: ops that accumulate into a storage they read (the
``accumulate`` matmuls), the weight gradients (parameter storages), and the attention backward
(flash kernels sum ``dq`` with atomics, so its bits vary from run to run).
"""

from __future__ import annotations

from dataclasses import dataclass

from swapopt_core._planning.ir import Access, AccessKind, ActivationTrace, TraceOp

__all__ = ["SHAPES", "DecoderShape", "llama_training_trace"]

_PARAMS = 1 << 40  # parameter storage ids start here: they are not activations


@dataclass(frozen=True)
class DecoderShape:
    """A decoder's shape and one step's batch."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    seq: int
    vocab: int
    batch: int = 1


#: The shapes the benchmark runs (the 70B shape with 16 of its 80 layers, as
#: on one GPU of a pipeline).
SHAPES = {
    "1b": DecoderShape("1b", 2048, 8192, 32, 8, 16, 4096, 128256),
    "8b": DecoderShape("8b", 4096, 14336, 32, 8, 32, 8192, 128256),
    "70b": DecoderShape("70b", 8192, 28672, 64, 8, 16, 4096, 128256),
    "tiny": DecoderShape("tiny", 1024, 2816, 8, 2, 8, 1024, 8192),
}


class _Builder:
    def __init__(self, tflops: float, hbm_tbps: float, launch_ms: float) -> None:
        self.flop_per_ms = tflops * 1e9
        self.byte_per_ms = hbm_tbps * 1e9
        self.launch_ms = launch_ms
        self.ops: list[TraceOp] = []
        self.sizes: dict[int, int] = {}
        self.next_sid = 0
        self.next_param = _PARAMS

    def new(self, nbytes: int) -> int:
        sid = self.next_sid
        self.next_sid += 1
        self.sizes[sid] = int(nbytes)
        return sid

    def param(self) -> int:
        self.next_param += 1
        return self.next_param

    def op(
        self,
        name: str,
        reads: tuple[int, ...],
        writes: tuple[int, ...],
        *,
        flops: float = 0.0,
        recompute: bool = True,
    ) -> None:
        """Add an op: a matmul-like one if ``flops`` is given, else memory-bound.

        ``recompute`` marks it pure and deterministic; an op that writes a storage it reads
        never is.
        """
        if flops:
            ms = flops / self.flop_per_ms
        else:
            moved = sum(self.sizes.get(s, 0) for s in (*reads, *writes))
            ms = moved / self.byte_per_ms
        kinds = {s: AccessKind.READ for s in reads}
        kinds.update({s: AccessKind.WRITE for s in writes})
        accesses = tuple(Access(s, k) for s, k in kinds.items())
        pure = recompute and not set(reads) & set(writes)
        self.ops.append(TraceOp(name, ms + self.launch_ms, accesses, pure))

    def matmul(
        self,
        name: str,
        a: int,
        w: int,
        out: int,
        m: int,
        k: int,
        n: int,
        *,
        accumulate: bool = False,
    ) -> None:
        reads = (a, w, out) if accumulate else (a, w)
        self.op(name, reads, (out,), flops=2.0 * m * k * n)  # accumulating: not pure

    def weight_grads(
        self, prefix: str, normed: int, grads: tuple[tuple[str, int, float], ...]
    ) -> None:
        """The weight gradients of the projections reading ``normed``: ``(name, grad, flops)``
        each, written to fresh parameter storages (not recomputable)."""
        for name, grad, flops in grads:
            self.op(
                f"{prefix}{name}_bwd_weight",
                (grad, normed),
                (self.param(),),
                flops=flops,
                recompute=False,
            )

    def norm_residual_bwd(
        self, prefix: str, index: int, grad: int, x: int, rstd: int, skip: int, nbytes: int
    ) -> int:
        """Backward of RMSNorm ``index`` (input ``x``, statistics ``rstd``) from ``grad``,
        then of its residual add (``skip`` the gradient that went around it).

        Returns:
            The gradient of the residual block's input.
        """
        dnorm = self.new(nbytes)
        self.op(f"{prefix}rmsnorm{index}_bwd", (grad, x, rstd), (dnorm,))
        dinput = self.new(nbytes)
        self.op(f"{prefix}residual{index}_bwd", (skip, dnorm), (dinput,))
        return dinput


def llama_training_trace(
    shape: DecoderShape,
    *,
    tflops: float = 650.0,
    hbm_tbps: float = 3.5,
    link_gbps: float = 50.0,
    launch_ms: float = 0.004,
    memory_limit_bytes: int | None = None,
) -> ActivationTrace:
    """One training step (forward, loss, backward) of ``shape`` as an ``ActivationTrace``.

    Args:
        shape: Model dimensions, sequence length and batch.
        tflops: Matmul throughput, TFLOP/s.
        hbm_tbps: Memory bandwidth for elementwise kernels, TB/s.
        link_gbps: Copy bandwidth of each direction, GB/s.
        launch_ms: Fixed cost added to every op.
        memory_limit_bytes: Budget stored in the trace.

    Returns:
        The trace; the loss is its only retained storage.
    """
    b = _Builder(tflops, hbm_tbps, launch_ms)
    t = shape.batch * shape.seq
    h, f, v = shape.hidden, shape.ffn, shape.vocab
    hd = h // shape.heads
    hkv = hd * shape.kv_heads
    act, stat = 2, 4  # bf16 activations, fp32 statistics
    attn_flops = 2.0 * shape.batch * shape.seq * shape.seq * h  # causal: half of 4*s^2*h

    x = b.new(t * h * act)
    b.op("embed", (b.param(),), (x,))
    saved = []
    for layer in range(shape.layers):
        p = f"L{layer}."
        w = {name: b.param() for name in ("n1", "q", "k", "v", "o", "n2", "g", "u", "d")}
        n1, r1 = b.new(t * h * act), b.new(t * stat)
        b.op(p + "rmsnorm1", (x, w["n1"]), (n1, r1))
        q, k, vv = b.new(t * h * act), b.new(t * hkv * act), b.new(t * hkv * act)
        b.matmul(p + "q_proj", n1, w["q"], q, t, h, h)
        b.matmul(p + "k_proj", n1, w["k"], k, t, h, hkv)
        b.matmul(p + "v_proj", n1, w["v"], vv, t, h, hkv)
        qr, kr = b.new(t * h * act), b.new(t * hkv * act)
        b.op(p + "rope", (q, k), (qr, kr))
        out, lse = b.new(t * h * act), b.new(shape.batch * shape.heads * shape.seq * stat)
        b.op(p + "attention", (qr, kr, vv), (out, lse), flops=attn_flops)
        o = b.new(t * h * act)
        b.matmul(p + "o_proj", out, w["o"], o, t, h, h)
        h1 = b.new(t * h * act)
        b.op(p + "residual1", (x, o), (h1,))
        n2, r2 = b.new(t * h * act), b.new(t * stat)
        b.op(p + "rmsnorm2", (h1, w["n2"]), (n2, r2))
        g, u = b.new(t * f * act), b.new(t * f * act)
        b.matmul(p + "gate_proj", n2, w["g"], g, t, h, f)
        b.matmul(p + "up_proj", n2, w["u"], u, t, h, f)
        a = b.new(t * f * act)
        b.op(p + "silu", (g,), (a,))
        m = b.new(t * f * act)
        b.op(p + "mul", (a, u), (m,))
        d = b.new(t * h * act)
        b.matmul(p + "down_proj", m, w["d"], d, t, f, h)
        x_next = b.new(t * h * act)
        b.op(p + "residual2", (h1, d), (x_next,))
        saved.append((x, n1, r1, qr, kr, vv, out, lse, h1, n2, r2, g, a, u, m, w))
        x = x_next

    nf, rf = b.new(t * h * act), b.new(t * stat)
    wf, wh = b.param(), b.param()
    b.op("final_norm", (x, wf), (nf, rf))
    logits = b.new(t * v * act)
    b.matmul("lm_head", nf, wh, logits, t, h, v)
    loss, lse_loss = b.new(stat), b.new(t * stat)
    b.op("cross_entropy", (logits,), (loss, lse_loss))
    dlogits = b.new(t * v * act)
    b.op("cross_entropy_bwd", (logits, lse_loss), (dlogits,))
    dnf = b.new(t * h * act)
    b.matmul("lm_head_bwd_input", dlogits, wh, dnf, t, v, h)
    b.op("lm_head_bwd_weight", (dlogits, nf), (b.param(),), flops=2.0 * t * v * h, recompute=False)
    dx = b.new(t * h * act)
    b.op("final_norm_bwd", (dnf, x, rf), (dx,))

    for layer in reversed(range(shape.layers)):
        p = f"L{layer}."
        x, n1, r1, qr, kr, vv, out, lse, h1, n2, r2, g, a, u, m, w = saved[layer]
        dm = b.new(t * f * act)
        b.matmul(p + "down_bwd_input", dx, w["d"], dm, t, h, f)
        b.op(p + "down_bwd_weight", (dx, m), (b.param(),), flops=2.0 * t * h * f, recompute=False)
        da, du = b.new(t * f * act), b.new(t * f * act)
        b.op(p + "mul_bwd", (dm, a, u), (da, du))
        dg = b.new(t * f * act)
        b.op(p + "silu_bwd", (da, g), (dg,))
        dn2 = b.new(t * h * act)
        b.matmul(p + "gate_bwd_input", dg, w["g"], dn2, t, f, h)
        b.matmul(p + "up_bwd_input", du, w["u"], dn2, t, f, h, accumulate=True)
        b.weight_grads(p, n2, (("gate", dg, 2.0 * t * h * f), ("up", du, 2.0 * t * h * f)))
        dh1 = b.norm_residual_bwd(p, 2, dn2, h1, r2, dx, t * h * act)
        dout = b.new(t * h * act)
        b.matmul(p + "o_bwd_input", dh1, w["o"], dout, t, h, h)
        b.op(p + "o_bwd_weight", (dh1, out), (b.param(),), flops=2.0 * t * h * h, recompute=False)
        dq, dk, dv = b.new(t * h * act), b.new(t * hkv * act), b.new(t * hkv * act)
        b.op(
            p + "attention_bwd",
            (dout, qr, kr, vv, out, lse),
            (dq, dk, dv),
            flops=2.5 * attn_flops,
            recompute=False,  # atomics sum dq: not bit-reproducible
        )
        dqr, dkr = b.new(t * h * act), b.new(t * hkv * act)
        b.op(p + "rope_bwd", (dq, dk), (dqr, dkr))
        dn1 = b.new(t * h * act)
        b.matmul(p + "q_bwd_input", dqr, w["q"], dn1, t, h, h)
        b.matmul(p + "k_bwd_input", dkr, w["k"], dn1, t, hkv, h, accumulate=True)
        b.matmul(p + "v_bwd_input", dv, w["v"], dn1, t, hkv, h, accumulate=True)
        qkv = (("q", dqr, 2.0 * t * h * h), ("k", dkr, 2.0 * t * h * hkv))
        b.weight_grads(p, n1, (*qkv, ("v", dv, 2.0 * t * h * hkv)))
        dx = b.norm_residual_bwd(p, 1, dn1, x, r1, dh1, t * h * act)
    b.op("embed_bwd", (dx,), (b.param(),), recompute=False)

    return ActivationTrace(
        tuple(b.ops), b.sizes, frozenset({loss}), memory_limit_bytes, link_gbps, link_gbps
    )
