"""A tiny language model registered with MindFormers, its data and training YAML.

Importing the module registers ``TinyConfig`` (model type ``swapopt_tiny``) and ``TinyLM``,
which is what ``python -m swapopt_plugins.mindformers --register _mindformers_tiny`` does in
the launcher tests. The model has three parameters (512, 512 and 32 elements).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from mindformers.tools.register.register import MindFormerModuleType, MindFormerRegister
from mindspore import nn
from mindspore.mindrecord import FileWriter

VOCAB, HIDDEN, SEQ = 32, 16, 8


@MindFormerRegister.register(MindFormerModuleType.CONFIG, legacy=False, search_names="swapopt_tiny")
class TinyConfig:
    """What ``TinyLM`` is built from; MindFormers passes the YAML's ``model:`` keys."""

    def __init__(
        self,
        model_type: str = "swapopt_tiny",
        architectures: Any = None,
        vocab_size: int = VOCAB,
        hidden_size: int = HIDDEN,
        **_: Any,
    ) -> None:
        self.model_type = model_type
        self.architectures = architectures
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@MindFormerRegister.register(MindFormerModuleType.MODELS, legacy=False)
class TinyLM(nn.Cell):
    """Embedding, one dense layer and cross entropy; returns ``(loss,)`` like MindFormers."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Dense(config.hidden_size, config.vocab_size)
        self.loss = nn.CrossEntropyLoss()

    def construct(self, input_ids, labels):
        logits = self.proj(self.embed(input_ids)).reshape(-1, self.proj.out_channels)
        return (self.loss(logits, labels.reshape(-1)),)

    def get_gpt_transformer_config(self):
        """Read by MindFormers' LossCallback for its throughput estimate."""
        from mindformers.parallel_core.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=2,
            ffn_hidden_size=2 * HIDDEN,
            seq_length=SEQ,
            vocab_size=VOCAB,
        )


def write_dataset(path: Path, rows: int = 64) -> Path:
    """A fixed token data set in MindRecord format (``input_ids``, ``labels``: int32[8])."""
    writer = FileWriter(str(path), 1)
    schema = {"type": "int32", "shape": [SEQ]}
    writer.add_schema({"input_ids": schema, "labels": schema}, "swapopt_tiny")
    rng = np.random.default_rng(0)
    writer.write_raw_data(
        [
            {
                "input_ids": rng.integers(0, VOCAB, SEQ).astype(np.int32),
                "labels": rng.integers(0, VOCAB, SEQ).astype(np.int32),
            }
            for _ in range(rows)
        ]
    )
    writer.commit()
    return path


def train_config(data: Path, save_path: Path, steps: int, save_every: int) -> dict[str, Any]:
    """A pynative ``TrainConfig`` dict for ``TinyLM`` on CPU that saves checkpoints."""
    return {
        "training": {"steps": steps, "local_batch_size": 4, "global_batch_size": 4, "seed": 1},
        "checkpoint": {
            "enable_save": True,
            "save_path": str(save_path),
            "save_interleaved_steps": save_every,
        },
        "model": {"model_type": "swapopt_tiny", "architectures": "TinyLM"},
        "optimizer": {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 0},
        "train_dataset": {
            "dataloader": {"type": "MindDataset", "dataset_files": [str(data)], "shuffle": False},
            "num_parallel_workers": 1,
        },
        "context": {"device_target": "CPU"},
    }
