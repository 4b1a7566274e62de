"""The three workloads of ``device_budget.py``: a GPT-style decoder, a ResNet-style CNN and a
small Llama from a transformers ``LlamaConfig``, each with its fixed batch and loss.

Every workload is built from a seed, so two builds hold the same parameters bit for bit, and
its batch is made once, so every step of every variant sees the same data. The factories
(``gpt``, ``resnet``, ``llama``) take no argument at their default size, so they can also be
named as ``module:factory`` on the command line of ``swapopt estimate``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["SIZES", "Workload", "gpt", "llama", "resnet", "workload"]


@dataclass(frozen=True)
class Size:
    """One size of the three workloads (``SIZES``)."""

    gpt: dict[str, int]
    resnet: dict[str, int]
    llama: dict[str, int]


#: ``default``: small enough that the whole benchmark runs in about ten minutes on two cores
#: at the H200's link/compute ratio (about 3 MB/s here; see ``device_budget.py``);
#: ``medium``: about 1 M parameters (the ResNet 0.2 M), half an hour or more; ``issue``: the
#: issue's ~30 M GPT (a fully swapped step alone takes minutes); ``quick``: the smoke test's.
SIZES = {
    "quick": Size(
        gpt={"vocab": 256, "width": 64, "layers": 2, "seq": 32, "batch": 2},
        resnet={"width": 8, "image": 16, "batch": 4},
        llama={"vocab": 256, "width": 64, "layers": 2, "seq": 32, "batch": 2},
    ),
    "default": Size(
        gpt={"vocab": 512, "width": 64, "layers": 4, "seq": 64, "batch": 4},
        resnet={"width": 8, "image": 32, "batch": 8},
        llama={"vocab": 512, "width": 64, "layers": 4, "seq": 64, "batch": 4},
    ),
    "medium": Size(
        gpt={"vocab": 1024, "width": 128, "layers": 4, "seq": 128, "batch": 8},
        resnet={"width": 16, "image": 32, "batch": 32},
        llama={"vocab": 1024, "width": 128, "layers": 4, "seq": 128, "batch": 8},
    ),
    "issue": Size(
        gpt={"vocab": 8192, "width": 512, "layers": 8, "seq": 256, "batch": 8},
        resnet={"width": 64, "image": 64, "batch": 32},
        llama={"vocab": 8192, "width": 512, "layers": 8, "seq": 256, "batch": 8},
    ),
}


@dataclass
class Workload:
    """A model factory, the batch every step uses, and the loss of one forward.

    Attributes:
        name: Short name (``gpt``, ``resnet``, ``llama``).
        description: One line for the table's title.
        build: Makes the model, seeded (two calls give the same bits).
        inputs: The batch (input and target), made once.
        loss: The loss of one forward of ``model`` on ``inputs``.
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    inputs: tuple[torch.Tensor, torch.Tensor]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def _tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------- GPT


def _demo() -> object:
    try:
        return importlib.import_module("swapopt_core._cli.demo")
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module("swapopt_core._cli.demo")


def gpt(vocab: int = 1024, width: int = 128, layers: int = 4, seq: int = 128) -> nn.Module:
    """``swapopt demo``'s GPT: pre-norm blocks, hand-written causal attention, GELU MLP."""
    torch.manual_seed(0)
    tiny_gpt = _demo()._TinyGPT  # type: ignore[attr-defined]
    return tiny_gpt(vocab=vocab, width=width, layers=layers, heads=max(1, width // 64), max_len=seq)


def _gpt_workload(vocab: int, width: int, layers: int, seq: int, batch: int) -> Workload:
    def loss(model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return _lm_loss(model(inputs[0]), inputs[1])

    return Workload(
        "gpt",
        f"GPT decoder, {layers} layers, width {width}, batch {batch} x {seq}",
        lambda: gpt(vocab, width, layers, seq),
        _tokens(vocab, batch, seq),
        loss,
    )


# --------------------------------------------------------------------------- ResNet


class _Block(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (1x1 where the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem, three stages of two blocks (``width``, 2x, 4x
    channels, the last two at stride 2), pooled 10-way head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks, channels = [], width
        for scale, stride in ((1, 1), (2, 2), (4, 2)):
            blocks += [
                _Block(channels, width * scale, stride),
                _Block(width * scale, width * scale, 1),
            ]
            channels = width * scale
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def resnet(width: int = 16) -> nn.Module:
    """The ResNet, seeded."""
    torch.manual_seed(0)
    return ResNet(width)


def _resnet_workload(width: int, image: int, batch: int) -> Workload:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, image, image, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)

    def loss(model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(inputs[0]), inputs[1])

    return Workload(
        "resnet",
        f"ResNet, 6 blocks, width {width}, batch {batch} x 3 x {image} x {image}",
        lambda: resnet(width),
        (images, labels),
        loss,
    )


# --------------------------------------------------------------------------- Llama


class _Logits(nn.Module):
    """A transformers causal LM that returns the logits tensor alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=ids, use_cache=False).logits
        return logits


def llama_config(vocab: int = 1024, width: int = 128, layers: int = 4, seq: int = 128) -> object:
    """A small ``LlamaConfig``: heads of 32, two query heads per key/value head, fp32."""
    from transformers import LlamaConfig

    heads = max(2, width // 32)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3 // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attn_implementation="eager",
        torch_dtype="float32",
    )


def llama(vocab: int = 1024, width: int = 128, layers: int = 4, seq: int = 128) -> nn.Module:
    """``LlamaForCausalLM`` from :func:`llama_config`, seeded, returning logits."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return _Logits(LlamaForCausalLM(llama_config(vocab, width, layers, seq)))


def _llama_workload(vocab: int, width: int, layers: int, seq: int, batch: int) -> Workload:
    def loss(model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return _lm_loss(model(inputs[0]), inputs[1])

    return Workload(
        "llama",
        f"Llama (transformers), {layers} layers, width {width}, batch {batch} x {seq}",
        lambda: llama(vocab, width, layers, seq),
        _tokens(vocab, batch, seq),
        loss,
    )


def workload(name: str, size: str = "default") -> Workload:
    """The workload ``name`` (``gpt``, ``resnet``, ``llama``) at ``size`` (``SIZES``)."""
    shapes = SIZES[size]
    if name == "gpt":
        return _gpt_workload(**shapes.gpt)
    if name == "resnet":
        return _resnet_workload(**shapes.resnet)
    if name == "llama":
        return _llama_workload(**shapes.llama)
    raise ValueError(f"unknown workload {name!r}; choose gpt, resnet or llama")


# --------------------------------------------------------------------------- estimate


class _WithLoss(nn.Module):
    """A workload's model returning its loss, for ``swapopt estimate``'s ``module:factory``."""

    def __init__(self, work: Workload) -> None:
        super().__init__()
        self.model = work.build()
        self._loss = work.loss

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(self.model, (inputs, targets))


def _estimate_factory(
    name: str,
) -> tuple[nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]]]:
    """``(model, example_batch)`` at the size ``BUDGET_MODELS_SIZE`` names (default
    ``default``): the batch has the workload's own shapes (``--batch``/``--seq`` ignored)."""
    import os

    work = workload(name, os.environ.get("BUDGET_MODELS_SIZE", "default"))
    shapes = [(t.shape, t.dtype) for t in work.inputs]

    def example_batch(batch: int, seq: int) -> tuple[torch.Tensor, ...]:
        del batch, seq  # the workload's own batch, as measured
        return tuple(
            torch.randn(shape) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
            for shape, dtype in shapes
        )

    return _WithLoss(work), example_batch


def estimate_gpt() -> tuple[nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]]]:
    """The GPT workload for ``swapopt estimate --model budget_models:estimate_gpt``."""
    return _estimate_factory("gpt")


def estimate_resnet() -> tuple[nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]]]:
    """The ResNet workload for ``swapopt estimate --model budget_models:estimate_resnet``."""
    return _estimate_factory("resnet")


def estimate_llama() -> tuple[nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]]]:
    """The Llama workload for ``swapopt estimate --model budget_models:estimate_llama``."""
    return _estimate_factory("llama")
