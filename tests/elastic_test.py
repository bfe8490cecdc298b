"""examples/train_lm.py end to end: kill a run, resume it on another topology, same params.

Every run is the real command in a fresh process, time-bounded; a test kills
only the processes it started. The model is tiny and XLA's backend
optimizations are off (as in ``unsplit demo --quick``): these runs measure
equality, not speed.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import unsplit

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
TINY = ["--width", "16", "--layers", "1", "--heads", "2", "--length", "8", "--global-batch", "16"]
STEPS = 20
TIMEOUT_S = 300

# One xdist worker for the module: its module-scoped runs (the uninterrupted references, the
# saved checkpoint) are then made once, not once per worker that runs a test needing them.
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.xdist_group("elastic")]


def env():
    e = dict(os.environ)
    e["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # the script sets the device count
    e["JAX_PLATFORMS"] = "cpu"
    return e


def start(*args):
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--no-progress", *TINY, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        cwd=ROOT,
        start_new_session=True,  # its own group: a kill reaches the workers it started
    )


def finish(proc, timeout=TIMEOUT_S):
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def run(*args):
    code, out = finish(start(*args))
    return code, out


def params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def rel_l2(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted 20-step runs on 1 process x 1 device, per mode: {bitwise: params}."""
    out = {}
    for bitwise in (True, False):
        path = tmp_path_factory.mktemp("ref") / "params.npz"
        flags = ["--bitwise"] if bitwise else []
        code, log = run("--steps", STEPS, "--devices", 1, *flags, "--params-out", path)
        assert code == 0, log[-3000:]
        out[bitwise] = params(path)
    return out


@pytest.mark.parametrize("bitwise", [True, False], ids=["bitwise", "default"])
def test_killed_and_resumed_on_another_topology_ends_like_the_uninterrupted_run(
    bitwise, references, tmp_path
):
    ckpt, out = tmp_path / "ckpt", tmp_path / "params.npz"
    flags = ["--bitwise"] if bitwise else []
    # 1 process x 4 devices x 2 microbatches; checkpoints after steps 4 and 8; killed after 10.
    code, log = run(
        "--steps", STEPS, "--devices", 4, "--microbatches", 2, *flags,
        "--ckpt-dir", ckpt, "--save-every", 4, "--kill-after-step", 10,
    )  # fmt: skip
    assert code == -signal.SIGKILL, log[-3000:]
    assert "step 10 loss" in log and "step 11 loss" not in log
    # Resumed on 2 processes x 2 devices for the 12 steps after the checkpoint of step 8.
    code, log = run(
        "--steps", STEPS, "--devices", 2, "--processes", 2, *flags,
        "--ckpt-dir", ckpt, "--save-every", 4, "--resume", "--params-out", out,
    )  # fmt: skip
    assert code == 0, log[-3000:]
    assert "resumed from the checkpoint after step 8" in log, log[-3000:]
    assert "step 9 loss" in log and "step 20 loss" in log
    got, want = params(out), references[bitwise]
    assert sorted(got) == sorted(want)
    if bitwise:
        differ = [k for k in want if got[k].tobytes() != want[k].tobytes()]
        assert differ == [], differ
    else:
        # Attention key biases get no gradient signal (softmax ignores them): rounding noise.
        errors = {k: rel_l2(got[k], want[k]) for k in want if not k.endswith("['key']['bias']")}
        assert max(errors.values()) <= 1e-5, errors
        inert = {k: rel_l2(got[k], want[k]) for k in want if k.endswith("['key']['bias']")}
        print(f"\ndefault mode: max relative L2 per parameter {max(errors.values()):.1e}; "
              f"attention key biases (left out) {max(inert.values()):.1e}")  # fmt: skip


def _unfinished(ckpt):
    names = os.listdir(ckpt) if ckpt.exists() else []
    return [n for n in names if "tmp" in n and not n.startswith(("0.", "1."))]


def test_killed_during_a_save_resumes_from_the_previous_checkpoint(references, tmp_path):
    """SIGKILL while orbax writes a checkpoint: the previous one is used, the result unchanged."""
    for attempt in range(3):  # a kill that lands just after the save finished is retried
        ckpt = tmp_path / f"ckpt{attempt}"
        proc = start("--steps", STEPS, "--devices", 1, "--bitwise", "--ckpt-dir", ckpt,
                     "--save-every", 1)  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not _unfinished(ckpt) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            os.killpg(proc.pid, signal.SIGKILL)  # during the save of step >= 2
        finally:
            finish(proc)
        left = _unfinished(ckpt)
        if left:
            break
    assert left, "no kill landed during a save in 3 attempts"
    killed_step = int(left[0].split(".")[0])
    with unsplit.checkpoint.Checkpointer(ckpt, settings={}) as c:
        previous = c.latest_step()
    assert previous == killed_step - 1
    out = tmp_path / "params.npz"
    code, log = run("--steps", STEPS, "--devices", 1, "--bitwise", "--ckpt-dir", ckpt,
                    "--save-every", 1, "--resume", "--params-out", out)  # fmt: skip
    assert code == 0, log[-3000:]
    assert f"resumed from the checkpoint after step {previous} " in log
    assert _unfinished(ckpt) == []  # the unfinished save was removed, never read
    got, want = params(out), references[True]
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


# One launch changes the three settings the script records (each launch is a process of its
# own: CI runs the slowest multi-process cases once, not per parameter); the message names
# every changed setting, so each is checked. The checker's cases: elastic/checkpoint_test.py.
CHANGED = [("seed", "0", "1"), ("global_batch", "16", "32"), ("chunk_size", "2", "4")]


def test_resume_with_changed_settings_names_each_of_them(saved_run):
    flags = [a for name, _, now in CHANGED for a in (f"--{name.replace('_', '-')}", now)]
    code, log = run("--steps", 4, "--devices", 1, "--bitwise", "--chunk-size", 2,
                    "--ckpt-dir", saved_run, "--resume", *flags)  # fmt: skip
    assert code == 2, log[-3000:]
    for name, saved, now in CHANGED:
        assert re.search(rf"{name}: saved {saved}, this run {now}", log), (name, log[-3000:])
        assert f"{name}={saved}" in log, (name, log[-3000:])
    assert "Fix: resume with" in log


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The checkpoint directory of a 2-step bitwise run with chunk size 2."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    code, log = run("--steps", 2, "--devices", 1, "--bitwise", "--chunk-size", 2,
                    "--ckpt-dir", ckpt, "--save-every", 2)  # fmt: skip
    assert code == 0, log[-3000:]
    return ckpt
