"""Two processes, gloo on CPU, FSDP2 (``fully_shard``): swapped equals plain, bit for bit.

Each rank (``_fsdp2_worker.py``) trains a sharded model with a plain optimizer and again
with the optimizer swapped on the loopback runtime (packed and per-tensor, AdamW and Adam
with amsgrad), and compares the local shards of every parameter and state entry. It also
checkpoints mid-run and resumes into a fresh sharded model, swapped and plain. A second
launch (``_fsdp2_dcp_worker.py``) checkpoints through ``torch.distributed.checkpoint``
(``get_optimizer_state_dict``, ``dcp.save``, ``dcp.load``, ``set_optimizer_state_dict``) and
resumes bit for bit against the plain run doing the same. The ranks write their results as
JSON; this test turns them into assertion messages.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:  # pragma: no cover - torch without FSDP2
    pytest.skip(
        "torch.distributed.fsdp.fully_shard (FSDP2) is not available", allow_module_level=True
    )

WORKER = Path(__file__).with_name("_fsdp2_worker.py")
DCP_WORKER = Path(__file__).with_name("_fsdp2_dcp_worker.py")
REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(out_dir: Path, worker: Path = WORKER) -> list[int | str]:
    """Start every rank of ``worker`` like torchrun would and wait for all of them."""
    port = _free_port()
    procs = []
    logs = []
    for rank in range(WORLD_SIZE):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD_SIZE),
            LOCAL_WORLD_SIZE=str(WORLD_SIZE),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )
        log = open(out_dir / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), str(out_dir)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    codes: list[int | str] = []
    try:
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=TIMEOUT_S))
            except subprocess.TimeoutExpired:
                codes.append(f"timed out after {TIMEOUT_S} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    return codes


def _results(out_dir: Path, worker: Path) -> list[dict]:
    """Launch ``worker`` on every rank; each rank's results with its exit code and log."""
    codes = _launch(out_dir, worker)
    results = []
    for rank, code in enumerate(codes):
        file = out_dir / f"rank{rank}.json"
        log = (out_dir / f"rank{rank}.log").read_text()[-4000:]
        if not file.exists():
            pytest.fail(f"rank {rank} wrote no results (exit {code}). Its output:\n{log}")
        result = json.loads(file.read_text())
        result["exit"] = code
        result["log"] = log
        results.append(result)
    return results


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _results(tmp_path_factory.mktemp("fsdp2_gloo"), WORKER)


@pytest.fixture(scope="module")
def dcp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _results(tmp_path_factory.mktemp("fsdp2_dcp"), DCP_WORKER)


def _finished(rank_results: list[dict]) -> None:
    for result in rank_results:
        assert result.get("done") and result["exit"] == 0, (
            f"rank {result['rank']} exited with {result['exit']} after cases "
            f"{list(result['cases'])}. Its output:\n{result['log']}"
        )


def test_every_rank_finished(rank_results: list[dict]) -> None:
    _finished(rank_results)


def test_every_dcp_rank_finished(dcp_results: list[dict]) -> None:
    _finished(dcp_results)


def _case_names(worker: Path) -> list[str]:
    # Read the worker's list without importing torch.distributed state into pytest.
    paths = [str(REPO), str(worker.parent)]  # the DCP worker imports _fsdp2_worker
    sys.path[:0] = paths
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location(worker.stem, worker)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return [name for name, _ in module.CASES]
    finally:
        for path in paths:
            sys.path.remove(path)


@pytest.mark.parametrize("case", _case_names(WORKER))
def test_case(rank_results: list[dict], case: str) -> None:
    _check_case(rank_results, case)


@pytest.mark.parametrize("case", _case_names(DCP_WORKER))
def test_dcp_case(dcp_results: list[dict], case: str) -> None:
    _check_case(dcp_results, case)


def _check_case(rank_results: list[dict], case: str) -> None:
    failures = []
    for result in rank_results:
        outcome = result["cases"].get(case)
        if outcome is None:
            failures.append(f"rank {result['rank']}: case did not run (exit {result['exit']})")
        elif not outcome["ok"]:
            failures.append(f"rank {result['rank']}: {outcome['error']}\n{outcome['traceback']}")
    assert not failures, "\n".join(failures)
