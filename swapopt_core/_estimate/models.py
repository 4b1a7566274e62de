"""Build the model to estimate, and one step's inputs, on fake tensors.

``--model`` is either a transformers config file or ``module:factory``:

- ``CONFIG.json``: a transformers model config (``config.json`` of a hub model, e.g. a
  ``LlamaConfig``). The model is ``AutoModelForCausalLM.from_config(config)`` built inside
  ``FakeTensorMode``, so no weight is materialised; its dtype is ``--dtype``, else the config's
  ``torch_dtype``, else float32. The batch is ``input_ids`` of shape ``(B, S)`` with
  ``labels=input_ids``, and the loss is the model's ``.loss``.
- ``module:factory``: ``module`` is imported (the current folder is on the path) and
  ``factory()`` is called inside ``FakeTensorMode``. It returns a ``torch.nn.Module``, or a
  pair ``(model, example_batch)`` where ``example_batch(batch, seq)`` returns the model's
  inputs: a mapping (``model(**inputs)``), a tuple (``model(*inputs)``) or one tensor
  (``model(inputs)``). Without ``example_batch`` the model is called like a causal LM:
  ``model(input_ids=ids, labels=ids)`` with ids below ``model.config.vocab_size``. The
  model's output is the loss (a tensor; one that is not a scalar is summed), or has it as
  ``.loss`` or ``["loss"]``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swapopt_core._estimate.profiles import read_json

__all__ = ["ModelSpec", "loss_of", "model_spec"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """How to build the model and its inputs (called inside the fake mode).

    Attributes:
        label: What ``--model`` named, for the report.
        build: Returns ``(model, inputs)`` for a batch and a sequence length.
    """

    label: str
    build: Callable[[int, int], tuple[torch.nn.Module, Any]]


def model_spec(text: str, dtype: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` that ``--model text`` names (see the module docstring).

    Raises:
        ValueError: No such file, a file that is not a transformers config, a module that
            cannot be imported or has no such factory; the message says which and the fix.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype}: expected one of {', '.join(_DTYPES)}.")
    if text.endswith(".json") or Path(text).is_file():
        return _config_spec(text, dtype)
    if ":" in text:
        return _factory_spec(text, dtype)
    raise ValueError(
        f"--model {text}: expected a transformers config file (CONFIG.json) or "
        "module:factory; no such file, and it has no ':'."
    )


def _config_spec(path: str, dtype: str | None) -> ModelSpec:
    data = read_json("--model", path, "a JSON config")
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(
            f"--model {path}: not a transformers config (no 'model_type' key); pass the "
            'config.json of a causal LM, e.g. one with "model_type": "llama".'
        )
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"--model {path}: a config file needs transformers (pip install transformers)."
        ) from None
    named = data.pop("dtype", None) or data.pop("torch_dtype", None)  # read here, not there
    data.pop("torch_dtype", None)
    try:
        config = transformers.AutoConfig.for_model(**data)
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"--model {path}: transformers refuses the config ({error}).") from None
    wanted = _DTYPES.get(dtype or "") or _DTYPES.get(str(named)) or torch.float32

    def build(batch: int, seq: int) -> tuple[torch.nn.Module, Any]:
        model = _from_config(transformers, config, wanted)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        return model, {"input_ids": ids, "labels": ids}

    return ModelSpec(path, build)


def _from_config(transformers: Any, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The model in ``dtype``, made in it (``.to()`` cannot swap fake parameters)."""
    auto = transformers.AutoModelForCausalLM
    try:
        model: torch.nn.Module = auto.from_config(config, dtype=dtype)  # transformers >= 4.56
    except TypeError:  # older releases call it torch_dtype
        model = auto.from_config(config, torch_dtype=dtype)
    return model


def _factory_spec(text: str, dtype: str | None) -> ModelSpec:
    module_name, _, attribute = text.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model {text}: expected module:factory, e.g. mymodels:make_model.")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, "")  # like python -m: the current folder's modules are found
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--model {text}: cannot import {module_name!r} ({error}).") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(
            f"--model {text}: module {module_name!r} has no callable {attribute!r}; the factory "
            "returns a model or (model, example_batch)."
        )
    wanted = _DTYPES.get(dtype or "")

    def build(batch: int, seq: int) -> tuple[torch.nn.Module, Any]:
        made = factory()
        model, example = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"--model {text}: the factory returned {type(model).__name__}, expected a "
                "torch.nn.Module or (model, example_batch)."
            )
        if wanted is not None:
            for tensor in (*model.parameters(), *model.buffers()):
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(wanted)  # .to() cannot swap fake tensors
        if example is not None:
            return model, example(batch, seq)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if not isinstance(vocab, int):
            raise ValueError(
                f"--model {text}: the model has no config.vocab_size, so its inputs cannot be "
                "guessed; return (model, example_batch) from the factory, where "
                "example_batch(batch, seq) returns the model's inputs."
            )
        ids = torch.randint(0, vocab, (batch, seq))
        return model, {"input_ids": ids, "labels": ids}

    return ModelSpec(text, build)


def loss_of(model: torch.nn.Module, inputs: Any, label: str) -> tuple[Any, torch.Tensor]:
    """Run ``model`` on ``inputs``; its output and the loss to call backward on."""
    if isinstance(inputs, dict):
        out = model(**inputs)
    elif isinstance(inputs, tuple):
        out = model(*inputs)
    else:
        out = model(inputs)
    loss = out
    if not isinstance(loss, torch.Tensor):
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"--model {label}: the model returned {type(out).__name__} with no loss; return a "
            "loss tensor, or an output with .loss (transformers models do when given labels)."
        )
    return out, loss if loss.dim() == 0 else loss.sum()
