"""The ``swapopt demo`` job: train a tiny GPT twice and compare plain and swapped AdamW.

Both runs start from the same weights and see the same synthetic batches; the only difference is
that the second run's optimizer has the swap pipeline installed. The demo then reports whether the
two runs ended bit for bit equal, and what the swap cost and saved.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from swapopt_core import SwapOptimizerConfig, SwapStats, swap_optimizer, swap_stats
from swapopt_core._cli.demo_progress import DemoProgress

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoOptions:
    """Settings of one demo run.

    Attributes:
        steps: Optimizer steps per run.
        swap_times: Number of batches the swapped optimizer's step is pipelined over.
        packed: Packed (True) or per-tensor (False) swap; None keeps the backend default.
        device: Torch device string; None picks CUDA when available, else CPU.
        seed: Seed of the initial weights and of the synthetic data.
        layers: Number of transformer blocks.
        width: Embedding width (a multiple of ``heads``).
        heads: Attention heads per block.
        vocab: Vocabulary size of the synthetic token stream.
        seq_len: Tokens per training sequence.
        batch_size: Sequences per batch.
        lr: AdamW learning rate.
        threads: Torch CPU threads during the runs; None keeps torch's setting.
    """

    steps: int = 100
    swap_times: int = 8
    packed: bool | None = None
    device: str | None = None
    seed: int = 0
    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 512
    seq_len: int = 64
    batch_size: int = 8
    lr: float = 3e-3
    threads: int | None = None


QUICK = DemoOptions(steps=30, layers=2, width=128, seq_len=32, threads=1)
"""``swapopt demo --quick``: a model and a run a few seconds long on a CPU.

One thread: on a busy machine a small model's steps gain nothing from more, and lose much
when those threads wait for cores that others hold.
"""


@dataclass
class RunResult:
    """What one training run measured."""

    first_loss: float
    final_loss: float
    step_seconds: list[float]
    state_bytes: int
    params: list[torch.Tensor]
    stats: SwapStats | None = None
    device_peak_bytes: int | None = None


@dataclass
class DemoReport:
    """Both runs of the demo, side by side."""

    options: DemoOptions
    device: torch.device
    num_params: int
    plain: RunResult
    swapped: RunResult

    @property
    def identical(self) -> bool:
        """Whether every final parameter of the two runs is bit-identical."""
        pairs = zip(self.plain.params, self.swapped.params, strict=True)
        return all(torch.equal(a, b) for a, b in pairs)


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        # Attention written out by hand: fused SDPA kernels may be non-deterministic in backward.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        x = x + self.proj((weights @ v).transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class _TinyGPT(nn.Module):
    """A small GPT-style decoder with learned positions and an untied output head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def make_batches(options: DemoOptions, count: int) -> torch.Tensor:
    """Builds ``count`` batches of a noisy repeating token pattern, deterministically.

    Every sequence walks a fixed random cycle of tokens from a random starting point; one token
    in ten is replaced by a random one, so the model can learn the cycle but not the noise.

    Returns:
        An int64 CPU tensor of shape ``(count, batch_size, seq_len + 1)``.
    """
    gen = torch.Generator().manual_seed(options.seed + 1)
    cycle = torch.randperm(options.vocab, generator=gen)[: min(options.vocab, 37)]
    shape = (count, options.batch_size)
    starts = torch.randint(len(cycle), shape + (1,), generator=gen)
    tokens = cycle[(starts + torch.arange(options.seq_len + 1)) % len(cycle)]
    noise = torch.randint(options.vocab, tokens.shape, generator=gen)
    return torch.where(torch.rand(tokens.shape, generator=gen) < 0.1, noise, tokens)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of all non-scalar tensors in the optimizer state (what a plain optimizer keeps)."""
    return sum(
        value.numel() * value.element_size()
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def _on_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is the accelerator torch was built for (CUDA, ROCm, XPU, MPS...)."""
    current = torch.accelerator.current_accelerator(check_available=True)
    return current is not None and device.type == current.type


def _sync(device: torch.device) -> None:
    if _on_accelerator(device):  # time the step's kernels, not just their launch
        torch.accelerator.synchronize(device)


def _train(
    template: nn.Module,
    batches: torch.Tensor,
    eval_batch: torch.Tensor,
    config: SwapOptimizerConfig | None,
    options: DemoOptions,
    progress: DemoProgress,
) -> RunResult:
    """Trains a copy of ``template``; with a ``config`` its AdamW runs swapped."""
    device = batches.device
    model = copy.deepcopy(template).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=0.1)
    if config is not None:
        swap_optimizer(opt, config)
    if _on_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)
    label = "swapped AdamW" if config is not None else "plain AdamW"
    progress.begin(label, len(batches))
    first_loss, step_seconds, state_bytes = float("nan"), [], 0
    for step, batch in enumerate(batches):
        loss = _loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        step_seconds.append(time.perf_counter() - start)
        if config is None:  # swapped state is measured by swap_stats instead
            state_bytes = max(state_bytes, _state_bytes(opt))
        value = loss.item()
        first_loss = value if step == 0 else first_loss
        progress.advance(value)
    with torch.no_grad():
        final_loss = _loss(model, eval_batch).item()
    return RunResult(
        first_loss=first_loss,
        final_loss=final_loss,
        step_seconds=step_seconds,
        state_bytes=state_bytes,
        params=[p.detach().cpu().clone() for p in model.parameters()],
        stats=swap_stats(opt) if config is not None else None,
        device_peak_bytes=(
            torch.accelerator.max_memory_allocated(device) if _on_accelerator(device) else None
        ),
    )


def run_demo(
    options: DemoOptions, console: Console | None = None, *, plain_progress: bool | None = None
) -> DemoReport:
    """Trains the tiny GPT with plain AdamW, then with swapped AdamW, from identical starts.

    Args:
        options: Model, data and swap settings.
        console: Where the progress goes; a default console when None. A terminal gets a
            live bar; anything else (a CI log, a pipe) plain lines.
        plain_progress: Plain lines (True) or the live bar (False) whatever ``console`` is;
            None decides by ``console``.

    Returns:
        Both runs' measurements.
    """
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device(options.device or (accelerator.type if accelerator else "cpu"))
    config = SwapOptimizerConfig(
        swap_times=options.swap_times,
        packed_swap=options.packed,
        runtime="loopback" if device.type == "cpu" else "auto",
    )
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching global state
        torch.manual_seed(options.seed)
        template = _TinyGPT(
            options.vocab, options.width, options.layers, options.heads, options.seq_len
        )
    num_params = sum(p.numel() for p in template.parameters())
    data = make_batches(options, options.steps + 1).to(device)
    batches, eval_batch = data[:-1], data[-1]
    logger.info("demo: %d parameters on %s, %d steps each run", num_params, device, options.steps)
    progress = DemoProgress(console or Console(), plain=plain_progress)
    progress.note(
        f"swapopt demo: TinyGPT {num_params / 1e6:.2f}M params on {device}, two runs of "
        f"{options.steps} steps (plain AdamW, then swapped AdamW)"
    )
    threads = torch.get_num_threads()
    try:
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        with progress:
            plain = _train(template, batches, eval_batch, None, options, progress)
            swapped = _train(template, batches, eval_batch, config, options, progress)
    finally:
        torch.set_num_threads(threads)
    return DemoReport(options, device, num_params, plain, swapped)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.2f} MiB"


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x" if denominator else "n/a"


def render_report(report: DemoReport) -> Table:
    """Lays the two runs out as a rich table, plain AdamW next to swapped AdamW."""
    opts, plain, swapped, stats = report.options, report.plain, report.swapped, report.swapped.stats
    assert stats is not None, "the swapped run always records swap stats"
    table = Table(
        title=f"swapopt demo: TinyGPT {report.num_params / 1e6:.2f}M params, {opts.steps} steps "
        f"on {report.device} (runtime {stats.runtime}, swap_times {opts.swap_times}, "
        f"{'packed' if stats.packed else 'per-tensor'}, {stats.swapped_tensors} states swapped)"
    )
    table.add_column("")
    table.add_column("plain AdamW", justify="right")
    table.add_column("swapped AdamW", justify="right")
    table.add_column("comparison")
    # States below min_numel are not swapped: they stay on the device in both runs.
    swapped_peak = stats.peak_resident_state_bytes + max(
        plain.state_bytes - stats.total_state_bytes, 0
    )
    plain_ms = statistics.median(plain.step_seconds) * 1e3
    swapped_ms = statistics.median(swapped.step_seconds) * 1e3
    steps = max(stats.steps, 1)
    rows = [
        ("loss at step 1", f"{plain.first_loss:.6f}", f"{swapped.first_loss:.6f}", ""),
        (
            "final loss",
            f"{plain.final_loss:.6f}",
            f"{swapped.final_loss:.6f}",
            "equal" if plain.final_loss == swapped.final_loss else "DIFFERENT",
        ),
        ("final parameters", "", "", "bit-identical" if report.identical else "NOT bit-identical"),
        (
            "peak device opt. state",
            _mib(plain.state_bytes),
            _mib(swapped_peak),
            f"{_ratio(swapped_peak, plain.state_bytes)} of plain",
        ),
    ]
    if plain.device_peak_bytes is not None and swapped.device_peak_bytes is not None:
        rows.append(
            (
                "peak device memory allocated",
                _mib(plain.device_peak_bytes),
                _mib(swapped.device_peak_bytes),
                f"{_ratio(swapped.device_peak_bytes, plain.device_peak_bytes)} of plain",
            )
        )
    rows += [
        (
            "host opt. state",
            _mib(0),
            _mib(stats.host_state_bytes),
            f"pinned {_mib(stats.pinned_host_bytes)}",
        ),
        ("moved H2D", _mib(0), _mib(stats.h2d_bytes), f"{_mib(stats.h2d_bytes // steps)}/step"),
        ("moved D2H", _mib(0), _mib(stats.d2h_bytes), f"{_mib(stats.d2h_bytes // steps)}/step"),
        (
            "median opt.step()",
            f"{plain_ms:.2f} ms",
            f"{swapped_ms:.2f} ms",
            f"{_ratio(swapped_ms, plain_ms)} swapped/plain",
        ),
    ]
    for row in rows:
        table.add_row(*row)
    return table
