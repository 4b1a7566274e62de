"""Two processes, gloo on CPU, FSDP2: optimizers swapped through the generic path.

Each rank (``_fsdp2_families_worker.py``) trains a sharded model with a plain optimizer (SGD,
Adagrad, RMSprop, Adadelta, Adamax, ASGD, NAdam, RAdam) and again with it swapped (loopback
runtime, packed and per-tensor): the optimizer's own ``step`` runs on one batch of DTensor
parameters at a time. The local shards of every parameter and state entry must equal the
plain run's bit for bit, also after a checkpoint through ``torch.distributed.checkpoint`` and
a resume. The launch and the reporting are ``test_fsdp2_gloo.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")
from test_fsdp2_gloo import _case_names, _check_case, _finished, _results  # noqa: E402

WORKER = Path(__file__).with_name("_fsdp2_families_worker.py")


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _results(tmp_path_factory.mktemp("fsdp2_families"), WORKER)


def test_every_rank_finished(rank_results: list[dict]) -> None:
    _finished(rank_results)


@pytest.mark.parametrize("case", _case_names(WORKER))
def test_case(rank_results: list[dict], case: str) -> None:
    _check_case(rank_results, case)
