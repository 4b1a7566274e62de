"""``swapopt run``: real subprocesses through the installed ``swapopt`` script and through
``python -m swapopt_core``, a real Lightning Trainer, and ``torchrun`` with two gloo ranks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from swapopt_core._cli.run import RunTarget, UsageError, _module_problem, parse_target
from swapopt_core._launch import started_by_cli

BIN = Path(sys.executable).parent
SWAPOPT = BIN / "swapopt"
NOTHING_SWAPPED = "no optimizer was swapped in this process"
IMPORT_WARNING = "was not started through `swapopt run`"

ECHO = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                  "run": os.environ.get("SWAPOPT_RUN")}))
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "message":
    sys.exit("stopped by the script")
if what == "raise":
    raise KeyError("from the script")
"""

SWAP_BY_HAND = """
import torch
from swapopt_core import SwapOptimizerConfig, swap_optimizer
param = torch.nn.Parameter(torch.zeros(4096))
opt = torch.optim.Adam([param])
swap_optimizer(opt, SwapOptimizerConfig(runtime="loopback"))
"""

PLAIN_ADAM = """
import torch
param = torch.nn.Parameter(torch.zeros(4096))
param.grad = torch.ones(4096)
torch.optim.Adam([param]).step()
"""

LIGHTNING = """
import json, sys
import torch
import pytorch_lightning as pl
from swapopt_core import is_swap_optimizer, swap_stats


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(32, 64)
        self.out = torch.nn.Linear(64, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.out(torch.tanh(self.hidden(x))), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Probe(pl.Callback):
    report = {}

    def on_train_end(self, trainer, module):  # before the swap callback unswaps at teardown
        opt = trainer.optimizers[0]
        Probe.report = {"swapped": is_swap_optimizer(opt)}
        if is_swap_optimizer(opt):
            stats = swap_stats(opt)
            Probe.report.update(steps=stats.steps, host=stats.host_state_bytes,
                                resident=stats.resident_state_bytes)


pl.seed_everything(0, verbose=False)
data = torch.utils.data.TensorDataset(torch.randn(24, 32), torch.randn(24, 1))
strategy = "ddp" if len(sys.argv) > 2 else "auto"
trainer = pl.Trainer(accelerator="cpu", devices=int(sys.argv[2]) if strategy == "ddp" else 1,
                     strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()])
model = Net()
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
if trainer.global_rank == 0:
    torch.save(model.state_dict(), sys.argv[1])
    print("REPORT " + json.dumps(Probe.report))
"""

LIGHTNING_NO_OPTIMIZER = """
import torch
import pytorch_lightning as pl


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return None  # legal: Lightning trains with a stand-in optimizer


data = torch.utils.data.TensorDataset(torch.randn(24, 32), torch.randn(24, 1))
trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
print("global_step", trainer.global_step)
"""

SWAP_ENV = {
    "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    "SWAPOPT_RUNTIME": "loopback",
    "SWAPOPT_MIN_NUMEL": "0",
    "SWAPOPT_SWAP_TIMES": "2",
}


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SWAPOPT_") and k not in ("RANK", "LOCAL_RANK")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="default", **extra)
    return env


def _run(command: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        env=_env(**extra),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _script(tmp_path: Path, text: str, name: str = "script.py") -> Path:
    path = tmp_path / "scripts" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _echo(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    return json.loads(done.stdout.strip().splitlines()[0])


FORMS = {
    "script": [str(SWAPOPT), "run"],
    "python -m": [sys.executable, "-m", "swapopt_core", "run"],
}


# ---- parsing (in-process, cheap) ---------------------------------------------------------


def test_parse_target() -> None:
    assert parse_target(["t.py", "-m", "--lr", "1"]) == RunTarget(
        "t.py", False, ("-m", "--lr", "1")
    )
    assert parse_target(["--", "-odd.py", "x"]) == RunTarget("-odd.py", False, ("x",))
    assert parse_target(["-m", "pkg.train", "-v"]) == RunTarget("pkg.train", True, ("-v",))
    assert parse_target(["-mpkg", "a"]) == RunTarget("pkg", True, ("a",))
    for words, message in (([], "name the script"), (["-m"], "-m needs"), (["--lr"], "'--lr'")):
        with pytest.raises(UsageError, match=message):
            parse_target(words)


def test_started_by_cli() -> None:
    assert started_by_cli(["/v/bin/python", "/v/bin/swapopt", "run", "t.py"])
    assert started_by_cli(["python", "-X", "utf8", "-m", "swapopt_core", "run", "t.py"])
    assert not started_by_cli(["python", "train.py"])
    assert not started_by_cli(["python", "-m", "pkg.train"])
    assert not started_by_cli(["python", "-c", "import swapopt_core"])


def test_integrations_are_registered_through_the_entry_point_group() -> None:
    from swapopt_core import get_plugin_manager

    manager = get_plugin_manager()
    for name in ("swapopt-accelerate", "swapopt-lightning", "swapopt-transformers"):
        plugin = manager.get_plugin(name)
        assert plugin is not None and hasattr(plugin, "swapopt_install_integrations"), name


def test_lightning_auto_follows_the_flags() -> None:
    from swapopt_core.options import enable_lightning_auto

    env: dict[str, str] = {}
    assert not enable_lightning_auto(env) and "SWAPOPT_LIGHTNING_AUTO" not in env
    env = {"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}
    assert enable_lightning_auto(env) and env["SWAPOPT_LIGHTNING_AUTO"] == "1"
    assert enable_lightning_auto({"SWAPOPT_ACTIVATION_BUDGET_MB": "64"})
    off = {"SWAPOPT_ACTIVATION_BUDGET_MB": "64", "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "none"}
    assert not enable_lightning_auto(off)
    mine = {"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "SWAPOPT_LIGHTNING_AUTO": "no"}
    assert not enable_lightning_auto(mine) and mine["SWAPOPT_LIGHTNING_AUTO"] == "no"
    with pytest.raises(ValueError, match="SWAPOPT_SWAP_TIMES='0'"):
        enable_lightning_auto(
            {"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "SWAPOPT_SWAP_TIMES": "0"}
        )


def test_an_integration_waits_for_its_framework_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from swapopt_plugins._integrations import Integration

    package = tmp_path / "swapopt_fake_framework"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[int] = []

    def install() -> bool:
        calls.append(sys.modules["swapopt_fake_framework"].VALUE)  # runs after the import
        return True

    fake = Integration("fake", ("swapopt_fake_framework",), install)
    assert fake.swapopt_install_integrations() is None  # no flag: nothing
    monkeypatch.setenv("SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    assert fake.swapopt_install_integrations() == "fake" and calls == []
    assert importlib.util.find_spec("swapopt_fake_framework") is not None and calls == []
    importlib.import_module("swapopt_fake_framework")
    assert calls == [1]
    monkeypatch.delitem(sys.modules, "swapopt_fake_framework")
    importlib.import_module("swapopt_fake_framework")
    assert calls == [1]  # once only
    missing = Integration("missing", ("swapopt_no_such_framework",), install)
    assert missing.swapopt_install_integrations() is None


# ---- running a script like python does ---------------------------------------------------


@pytest.mark.parametrize("form", sorted(FORMS))
def test_script_runs_as_main_with_its_argv(tmp_path: Path, form: str) -> None:
    script = _script(tmp_path, ECHO)
    done = _run([*FORMS[form], str(script), "a", "--flag", "-m"], tmp_path)
    assert done.returncode == 0, done.stderr
    seen = _echo(done)
    assert seen["argv"] == [str(script), "a", "--flag", "-m"]
    assert seen["path0"] == str(script.parent)
    assert seen["name"] == "__main__" and seen["run"] == "1"
    assert "integrations on:" in done.stderr and IMPORT_WARNING not in done.stderr


def test_module_form_and_separator(tmp_path: Path) -> None:
    _script(tmp_path, ECHO, name="echo_mod.py")
    done = _run([str(SWAPOPT), "run", "-m", "echo_mod", "x"], tmp_path / "scripts")
    assert done.returncode == 0, done.stderr
    seen = _echo(done)
    assert seen["argv"] == [str(tmp_path / "scripts" / "echo_mod.py"), "x"]
    assert seen["path0"] == str(tmp_path / "scripts") and seen["name"] == "__main__"
    done = _run(
        [sys.executable, "-m", "swapopt_core", "run", "--", "echo_mod.py"], tmp_path / "scripts"
    )
    assert done.returncode == 0 and _echo(done)["argv"] == ["echo_mod.py"]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_exit_codes_and_exceptions_propagate(tmp_path: Path, form: str) -> None:
    script = str(_script(tmp_path, ECHO))
    assert _run([*FORMS[form], script, "exit", "7"], tmp_path).returncode == 7
    assert _run([*FORMS[form], script, "exit", "0"], tmp_path).returncode == 0
    done = _run([*FORMS[form], script, "message"], tmp_path)
    assert done.returncode == 1 and "stopped by the script" in done.stderr
    done = _run([*FORMS[form], script, "raise"], tmp_path)
    assert done.returncode == 1
    trace = done.stderr.split("Traceback (most recent call last):\n", 1)[1]
    assert trace.splitlines()[0].strip().startswith(f'File "{script}"')  # runpy frames cut
    assert "KeyError: 'from the script'" in trace


def test_usage_errors(tmp_path: Path) -> None:
    for words, code, message in (
        ([], 2, "name the script"),
        (["--nope"], 2, "unknown option '--nope'"),
        (["missing.py"], 2, "no such script: 'missing.py'"),
    ):
        done = _run([str(SWAPOPT), "run", *words], tmp_path)
        assert done.returncode == code and message in done.stderr, done.stderr
    done = _run([str(SWAPOPT), "run", "--help"], tmp_path)
    assert done.returncode == 0 and "-m MODULE" in done.stdout
    done = _run(
        [str(SWAPOPT), "run", str(_script(tmp_path, ECHO))], tmp_path, SWAPOPT_SWAP_TIMES="0"
    )
    assert done.returncode == 2 and "SWAPOPT_SWAP_TIMES='0'" in done.stderr
    assert done.stdout == ""  # the script did not start


# ---- side by side with python itself -------------------------------------------------------


def _interpreter(form: str) -> str:
    """The interpreter a form runs on (the one its ``sys.executable`` names)."""
    if form == "script":
        return SWAPOPT.read_text().splitlines()[0].removeprefix("#!").strip()
    return sys.executable


def _without_banner(stderr: str) -> str:
    return "".join(line for line in stderr.splitlines(True) if not line.startswith("swapopt run: "))


READER = """
import json, os, sys
here = os.path.dirname(__file__)
os.chdir(os.sep)  # elsewhere: a relative __file__ would not find data.txt any more
with open(os.path.join(here, "data.txt")) as file:
    data = file.read()
print(json.dumps({"file": __file__, "argv": sys.argv, "path0": sys.path[0], "data": data}))
"""

INTERRUPTED = """
import atexit, signal, sys
atexit.register(lambda: print("atexit ran", flush=True))
def inner():
    signal.raise_signal(signal.SIGINT)  # what Ctrl-C does: KeyboardInterrupt in this frame
def outer():
    inner()
print("started", flush=True)
outer()
"""


def test_relative_script_path_gives_what_python_gives(tmp_path: Path) -> None:
    script = _script(tmp_path, READER, name="reader.py")
    (script.parent / "data.txt").write_text("next to the script")
    relative = str(script.relative_to(tmp_path))
    python = _run([_interpreter("script"), relative, "x"], tmp_path)
    swapopt = _run([*FORMS["script"], relative, "x"], tmp_path)
    assert python.returncode == 0 and json.loads(python.stdout)["data"], python.stderr
    assert (swapopt.returncode, swapopt.stdout) == (python.returncode, python.stdout), (
        swapopt.stderr
    )


@pytest.mark.parametrize("form", sorted(FORMS))
def test_missing_module_gives_pythons_one_line(tmp_path: Path, form: str) -> None:
    name = "no_such_package_xyz.mod"
    python = _run([_interpreter(form), "-m", name], tmp_path)
    swapopt = _run([*FORMS[form], "-m", name], tmp_path)
    assert python.returncode == 1 and len(python.stderr.splitlines()) == 1, python.stderr
    assert (swapopt.returncode, _without_banner(swapopt.stderr)) == (1, python.stderr)


def test_every_module_python_refuses_is_refused_in_its_words(tmp_path: Path) -> None:
    # A missing module, a package without __main__, a file name, a relative name.
    for name in ("no_such_module_xyz", "json", "os.py", ".relative"):
        python = _run([sys.executable, "-m", name], tmp_path)
        assert python.returncode == 1, python.stderr
        assert f"{sys.executable}: {_module_problem(name)}\n" == python.stderr
    assert _module_problem("json.tool") is None


@pytest.mark.parametrize("form", sorted(FORMS))
def test_keyboard_interrupt_ends_as_python_ends(tmp_path: Path, form: str) -> None:
    script = str(_script(tmp_path, INTERRUPTED, name="interrupted.py"))
    python = _run([_interpreter(form), script], tmp_path)
    swapopt = _run([*FORMS[form], script], tmp_path)
    assert python.returncode == -signal.SIGINT and "KeyboardInterrupt" in python.stderr
    assert python.stdout == "started\natexit ran\n"
    assert (swapopt.returncode, swapopt.stdout, _without_banner(swapopt.stderr)) == (
        python.returncode,
        python.stdout,
        python.stderr,
    )


# ---- the warnings ------------------------------------------------------------------------


def test_warns_at_exit_when_nothing_was_swapped(tmp_path: Path) -> None:
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, PLAIN_ADAM))], tmp_path, **SWAP_ENV)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(NOTHING_SWAPPED) == 1
    assert "SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE=cpu" in done.stderr
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, SWAP_BY_HAND))], tmp_path, **SWAP_ENV)
    assert done.returncode == 0 and NOTHING_SWAPPED not in done.stderr, done.stderr
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, PLAIN_ADAM))], tmp_path)
    assert done.returncode == 0 and NOTHING_SWAPPED not in done.stderr  # no flag, no warning
    budget = {"SWAPOPT_ACTIVATION_BUDGET_MB": "1"}
    done = _run([str(SWAPOPT), "run", str(_script(tmp_path, PLAIN_ADAM))], tmp_path, **budget)
    assert "no activations were offloaded in this process" in done.stderr, done.stderr
    session = _script(tmp_path, "import swapopt_core\nswapopt_core.OffloadSession()\n")
    done = _run([str(SWAPOPT), "run", str(session)], tmp_path, **budget)
    assert done.returncode == 0 and "no optimizer was swapped" not in done.stderr, done.stderr


def test_first_use_warning_without_swapopt_run(tmp_path: Path) -> None:
    # Importing reads no environment (tests/core/test_imports.py); the first plugin manager,
    # which every swap and offload session builds, warns.
    first_use = (
        "import swapopt_core, swapopt_core.options; "
        "swapopt_core.get_plugin_manager(); swapopt_core.new_plugin_manager()"
    )
    command = [sys.executable, "-c", first_use]
    done = _run(command, tmp_path, SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE="CPU")
    assert done.returncode == 0 and done.stderr.count(IMPORT_WARNING) == 1, done.stderr
    assert "swapopt run train.py" in done.stderr
    for extra in (
        {"SWAPOPT_RUN": "1"},
        {"LOCAL_RANK": "1"},
        {"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "none"},
    ):
        done = _run(command, tmp_path, **{"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu", **extra})
        assert done.returncode == 0 and IMPORT_WARNING not in done.stderr, (extra, done.stderr)
    quiet = [sys.executable, "-W", "ignore:SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE", *command[1:]]
    done = _run(quiet, tmp_path, SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE="cpu")
    assert IMPORT_WARNING not in done.stderr


# ---- Lightning ---------------------------------------------------------------------------


def _lightning_report(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(s for s in done.stdout.splitlines() if s.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def _same_state(a: Path, b: Path) -> None:
    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert left.keys() == right.keys()
    assert all(torch.equal(left[k], right[k]) for k in left)


def test_lightning_script_is_swapped_and_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    script = str(_script(tmp_path, LIGHTNING))
    plain = _lightning_report(_run([sys.executable, script, str(tmp_path / "plain.pt")], tmp_path))
    assert plain == {"swapped": False}
    done = _run([str(SWAPOPT), "run", script, str(tmp_path / "swap.pt")], tmp_path, **SWAP_ENV)
    swapped = _lightning_report(done)
    assert "integrations on:" in done.stderr and "lightning" in done.stderr
    assert swapped["swapped"] and swapped["steps"] == 3
    assert swapped["host"] > 0 and swapped["resident"] == 0  # all state in host memory
    assert NOTHING_SWAPPED not in done.stderr
    _same_state(tmp_path / "plain.pt", tmp_path / "swap.pt")


def test_lightning_module_without_optimizer_trains_and_is_told_once(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    script = str(_script(tmp_path, LIGHTNING_NO_OPTIMIZER))
    done = _run([str(SWAPOPT), "run", script], tmp_path, **SWAP_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global_step 3" in done.stdout
    assert done.stderr.count("nothing to swap") == 1, done.stderr
    assert NOTHING_SWAPPED not in done.stderr  # said once, by the callback


def test_lightning_trainer_warns_with_the_flag_and_without_swapopt_run(tmp_path: Path) -> None:
    # The callbacks-factory entry point runs for every Trainer; with the flag but without
    # `swapopt run` (and without SWAPOPT_LIGHTNING_AUTO) it adds nothing, so it says once
    # that this Trainer keeps its state on the device (docs/lightning.md).
    pytest.importorskip("pytorch_lightning")
    trainers = (
        "import pytorch_lightning as pl\n"
        "for _ in range(2):\n"
        "    trainer = pl.Trainer(accelerator='cpu', logger=False, enable_progress_bar=False)\n"
        "    print('CALLBACKS', sorted(type(c).__name__ for c in trainer.callbacks))\n"
    )
    command = [sys.executable, str(_script(tmp_path, trainers))]
    done = _run(command, tmp_path, SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE="cpu")
    assert done.returncode == 0 and done.stderr.count(IMPORT_WARNING) == 1, done.stderr
    assert "SwapOptimizerCallback" not in done.stdout
    for extra in ({"SWAPOPT_RUN": "1"}, {"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "none"}):
        done = _run(command, tmp_path, **{"SWAPOPT_OFFLOAD_OPTIMIZER_DEVICE": "cpu", **extra})
        assert done.returncode == 0 and IMPORT_WARNING not in done.stderr, (extra, done.stderr)
    done = _run(command, tmp_path, SWAPOPT_LIGHTNING_AUTO="1")
    assert done.returncode == 0 and done.stdout.count("SwapOptimizerCallback") == 2, done.stdout


@pytest.mark.slow
def test_lightning_under_torchrun_two_gloo_ranks(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    torchrun = shutil.which("torchrun", path=str(BIN))
    if torchrun is None:
        pytest.skip(f"no torchrun next to {sys.executable}")
    script = str(_script(tmp_path, LIGHTNING))
    launch = [torchrun, "--standalone", "--nproc_per_node", "2"]
    runs = {}
    for name, prefix, extra in (
        ("plain", [], {}),
        ("swap", ["--no-python", str(SWAPOPT), "run"], SWAP_ENV),
    ):
        out = tmp_path / f"{name}.pt"
        runs[name] = _lightning_report(
            _run([*launch, *prefix, script, str(out), "2"], tmp_path, **extra)
        )
    assert runs["plain"] == {"swapped": False}
    assert runs["swap"]["swapped"] and runs["swap"]["steps"] == 3 and runs["swap"]["resident"] == 0
    _same_state(tmp_path / "plain.pt", tmp_path / "swap.pt")
