"""MindFormers' ``SwapOptimizerCallback`` with a MindSpore optimizer swapopt cannot serve.

``mindspore.nn.Adagrad`` through MindFormers' ``CallbackHandler``: left unswapped with one
``SwapOptWarning`` and training bit for bit as without swapopt; ``SWAPOPT_STRICT=1`` raises.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest

# MindFormers opens its log folder under the working directory at import; keep it out of the repo.
os.environ.setdefault("LOG_MF_PATH", os.path.join(tempfile.gettempdir(), "swapopt-mindformers-log"))
pytest.importorskip("mindformers")

import _mindformers_tiny as T  # noqa: E402
import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindformers.pynative.callback import CallbackHandler  # noqa: E402
from mindformers.pynative.trainer.train_state import TrainerState  # noqa: E402

from swapopt_core import SwapOptWarning, UnsupportedOptimizerError, is_swap_optimizer  # noqa: E402
from swapopt_core._automatic import STRICT_ENV  # noqa: E402
from swapopt_plugins.mindformers import SwapOptimizerCallback  # noqa: E402

pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _pynative_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_ENV, raising=False)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")


def _tiny() -> tuple[T.TinyLM, ms.nn.Adagrad]:
    ms.set_seed(3)
    model = T.TinyLM(T.TinyConfig())
    return model, ms.nn.Adagrad(model.trainable_params(), learning_rate=1e-2)


def _train(optimizer: ms.nn.Adagrad, model: T.TinyLM, steps: int) -> None:
    grad_fn = ms.value_and_grad(
        lambda ids, labels: model(ids, labels)[0], None, optimizer.parameters
    )
    rng = np.random.default_rng(1)
    for _ in range(steps):
        ids = ms.Tensor(rng.integers(0, T.VOCAB, (4, T.SEQ)).astype(np.int32))
        _, grads = grad_fn(ids, ids)
        optimizer(grads)


def test_unserved_optimizer_trains_unswapped_with_one_warning() -> None:
    model, optimizer = _tiny()
    plain_model, plain = _tiny()
    callback = SwapOptimizerCallback(runtime="loopback", min_numel=0, swap_times=2)
    handler = CallbackHandler(callbacks=[callback], model=model, optimizer=optimizer)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handler.on_train_begin(None, TrainerState(max_steps=2))
        handler.on_train_begin(None, TrainerState(max_steps=2))  # a second train: no repeat
    said = [str(w.message) for w in record if issubclass(w.category, SwapOptWarning)]
    assert len(said) == 1 and "mindspore.nn.optim.ada_grad.Adagrad" in said[0], said
    assert "SWAPOPT_STRICT=1" in said[0] and not is_swap_optimizer(optimizer)
    _train(optimizer, model, 2)
    _train(plain, plain_model, 2)
    for a, b in zip(plain.get_parameters(), optimizer.get_parameters(), strict=True):
        assert a.name == b.name and np.array_equal(a.asnumpy(), b.asnumpy()), a.name
    handler.on_train_end(None, TrainerState())  # logs that nothing was swapped


def test_strict_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "true")
    _, optimizer = _tiny()
    callback = SwapOptimizerCallback(runtime="loopback")
    with pytest.raises(UnsupportedOptimizerError, match="Adagrad"):
        callback.on_train_begin(None, TrainerState(), optimizer=optimizer)
