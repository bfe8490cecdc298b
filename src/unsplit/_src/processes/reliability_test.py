"""Never silently wrong, never hung: failing peers, bad rows, bad ids, bad CLI arguments.

The agreement between processes has its own module (``agreement_test.py``).
"""

import importlib
import json
import os
import pathlib
import signal
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit
from unsplit import cli
from unsplit._src.processes import launch

BOUND_S = 30  # a failure anywhere ends every process within this (a bound on hangs)


# ---- peer failure: 2 processes, one raises or dies ------------------------------------


def worker_peer_fails(how: str, pid_dir: str, survivor: str):
    """Process 1 raises or is SIGKILLed; process 0 waits in a collective or keeps busy."""
    from jax.experimental import multihost_utils

    with open(os.path.join(pid_dir, f"{jax.process_index()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    multihost_utils.sync_global_devices("both started")
    if jax.process_index() == 1:
        time.sleep(0.5)
        if how == "raise":
            raise RuntimeError("boom on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    if survivor == "collective":
        multihost_utils.sync_global_devices("process 1 never gets here")
    else:
        time.sleep(10 * BOUND_S)  # busy with its own work: only jax.distributed can end it
    return "survived"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("how", "survivor", "message"),
    [
        ("raise", "collective", r"process 1 of 2 failed \(exit code 1\): RuntimeError: boom"),
        ("kill", "busy", r"process 1 of 2 failed \(exit code -9, killed by SIGKILL\)"),
    ],
)
def test_a_failing_process_ends_the_launch_quickly_naming_it(how, survivor, message):
    with tempfile.TemporaryDirectory() as pid_dir:
        start = time.monotonic()
        with pytest.raises(launch.LaunchError, match=message) as e:
            launch.run_local_processes(
                "unsplit._src.processes.reliability_test:worker_peer_fails",
                kwargs={"how": how, "pid_dir": pid_dir, "survivor": survivor},
                timeout_s=120,
            )
        assert time.monotonic() - start < BOUND_S + 15  # + starting the processes
        pids = [int(_read(os.path.join(pid_dir, f"{i}.pid"))) for i in range(2)]
    assert e.value.process_id == 1 and e.value.exit_code == (1 if how == "raise" else -9)
    assert "--- process 1: last" in str(e.value)  # its log tail, then the others'
    if how == "raise":
        assert "RuntimeError: boom on purpose" in e.value.logs[1]
    assert all(_gone(pid) for pid in pids)  # no orphans


@pytest.mark.multiprocess
def test_the_target_can_be_the_function_and_an_unimportable_one_is_explained():
    results = launch.run_local_processes(launch.describe, timeout_s=120)
    assert [r["process_index"] for r in results] == [0, 1]
    with pytest.raises(launch.LaunchError, match=r"cannot import 'no_such_module_xyz'.*PYTHONPATH"):
        launch.run_local_processes("no_such_module_xyz:main", timeout_s=120)
    with pytest.raises(ValueError, match=r"cannot be imported by the workers"):
        launch.run_local_processes(lambda: None)


@pytest.mark.multiprocess
def test_without_the_launcher_jax_distributed_ends_the_survivor():
    """The workers' own settings: a raising peer exits at once, its heartbeat stops."""
    with tempfile.TemporaryDirectory() as tmp:
        port = launch.free_port()
        kwargs = json.dumps({"how": "raise", "pid_dir": tmp, "survivor": "busy"})
        env = launch.worker_env(devices_per_process=1)
        procs = []
        try:
            for i in range(2):
                cmd = launch.worker_command(
                    "unsplit._src.processes.reliability_test:worker_peer_fails", i, 2, port, kwargs,
                    os.path.join(tmp, f"out{i}.json"),
                )  # fmt: skip
                log = open(os.path.join(tmp, f"log{i}.txt"), "w")  # noqa: SIM115
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
                log.close()
            procs[1].wait(timeout=120)  # process 1 raises once both have started
            failed_at = time.monotonic()
            procs[0].wait(timeout=BOUND_S)  # raises TimeoutExpired if it hangs on
            ended_after = time.monotonic() - failed_at
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        survivor_log = _read(os.path.join(tmp, "log0.txt"))
    assert procs[1].returncode == 1 and procs[0].returncode != 0
    assert ended_after < BOUND_S
    assert "another task died" in survivor_log or "unhealthy" in survivor_log, survivor_log[-2000:]


# ---- global_batch: a process's bad rows -----------------------------------------------


@pytest.mark.parametrize(
    ("rows", "error", "message"),
    [
        ({"x": [[1.0, 2.0], [3.0, 4.0]]}, TypeError, r"leaf \['x'\]\[0\]\[0\] is a scalar .*"
         r"nested Python list .*Fix: convert it to an array, e.g. np.asarray\(rows\)"),
        ({"x": np.ones((4, 2)), "y": np.ones(3)}, ValueError, r"leaves have different row "
         r"counts \(\['x'\]: 4, \['y'\]: 3\).*Fix: give every leaf the same number of rows"),
        ({"x": np.ones((6, 2))}, ValueError, r"this process has rows=6, not divisible by its 4 "
         r"devices along the batch axes \('data',\).*Fix: pass a multiple of 4 rows .*\(e.g. 4\)"),
        ({}, ValueError, r"local_batch has no array leaves"),
    ],
)  # fmt: skip
def test_global_batch_refuses_bad_rows_with_the_fix(rows, error, message):
    mesh = jax.make_mesh((4,), ("data",))
    with pytest.raises(error, match=message):
        unsplit.global_batch(rows, mesh)


def test_global_batch_refuses_bad_arguments():
    mesh = jax.make_mesh((4,), ("data",))
    rows = {"x": np.ones((4, 2), np.float32)}
    with pytest.raises(ValueError, match=r"batch_axes must name axes of the mesh \('data',\)"):
        unsplit.global_batch(rows, mesh, batch_axes="model")
    with pytest.raises(ValueError, match=r"check must be one of .*got check='sometimes'"):
        unsplit.global_batch(rows, mesh, check="sometimes")
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh; got dict"):
        unsplit.global_batch(rows, {"data": 4})


def test_global_batch_splits_over_the_named_batch_axes():
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    rows = {"x": np.arange(8, dtype=np.float32)}
    batch, ids = unsplit.global_batch(rows, mesh, batch_axes="data")
    assert batch["x"].sharding.spec == jax.P("data")
    np.testing.assert_array_equal(np.asarray(ids), np.arange(8))


# ---- 64-bit ids: words must be integers, and ids >= 2**31 survive a user's jit ----------


@pytest.mark.parametrize(
    ("hi", "lo", "error", "message"),
    [
        (np.zeros(2, np.float32), np.zeros(2, np.uint32), TypeError,
         r"Ids64.hi must hold integer words \(uint32\); got dtype=float32.*truncated"),
        (np.zeros(2, np.uint32), jnp.ones(2), TypeError, r"Ids64.lo must hold integer words"),
        (np.zeros(2, np.uint32), np.zeros(3, np.uint32), ValueError,
         r"same shape.*got hi.shape=\(2,\) and lo.shape=\(3,\)"),
        (np.array([2**31]), np.zeros(1, np.uint32), ValueError,
         r"Ids64.hi words must lie in \[0, 2147483647\]; got min=2147483648"),
        (np.zeros(1, np.int64), np.array([2**32]), ValueError,
         r"Ids64.lo words must lie in \[0, 4294967295\]"),
    ],
)  # fmt: skip
def test_ids64_refuses_float_words_bad_ranges_and_mismatched_shapes(hi, lo, error, message):
    with pytest.raises(error, match=message):
        unsplit.Ids64(hi=hi, lo=lo)


def test_64_bit_ids_pass_through_a_users_jit_exactly():
    key = jax.random.key(0)
    records = np.arange(4, dtype=np.int64) + 2**33
    expected = unsplit.example_keys(key, records)  # outside jit: split exactly on the host

    @jax.jit
    def user_step(key, ids):
        return unsplit.example_keys(key, ids)

    exact = user_step(key, unsplit.ids64(records))
    assert (jax.random.key_data(exact) == jax.random.key_data(expected)).all()
    # The hazard the docs warn about: JAX turns an int64 NumPy argument into int32 when
    # x64 is off, so ids 2**33 + i become i. If this starts failing, JAX changed that.
    truncated = user_step(key, records)
    small = unsplit.example_keys(key, np.arange(4))
    assert (jax.random.key_data(truncated) == jax.random.key_data(small)).all()
    # global_batch gives the two-word form for 64-bit ids, whatever their values, so every
    # process returns the same kind of ids.
    mesh = jax.make_mesh((4,), ("data",))
    _, ids = unsplit.global_batch({"x": np.ones((4, 1))}, mesh, local_ids=np.arange(4))
    assert isinstance(ids, unsplit.Ids64)
    _, ids = unsplit.global_batch(
        {"x": np.ones((4, 1))}, mesh, local_ids=np.arange(4, dtype=np.uint32)
    )
    assert not isinstance(ids, unsplit.Ids64)


def test_truncated_ids_that_turned_negative_are_refused_with_the_cause():
    truncated = jnp.asarray(np.array([1, 2**31 + 5], np.int64))  # int32 -2147483643
    with pytest.raises(ValueError, match=r"int64 ids >= 2\*\*31 that JAX truncated.*ids64"):
        unsplit.example_keys(jax.random.key(0), truncated)


# ---- the demo's arguments: refused before any work, argparse style --------------------


def _demo_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "argument --seed: seed must be in [0, 2**63 - 1] (an integer); got -1"),
        (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
        (["--learning-rate", "nan"], "argument --learning-rate: learning_rate must be > 0 and "
         "finite; got nan"),
        (["--learning-rate", "inf"], "learning_rate must be > 0 and finite; got inf"),
        (["--learning-rate", "0"], "learning_rate must be > 0 and finite; got 0"),
        (["--dropout", "nan"], "argument --dropout: dropout must be in (0, 1); got nan"),
        (["--dropout", "1"], "dropout must be in (0, 1); got 1"),
        (["--steps", "0"], "argument --steps: steps must be >= 2 (an integer); got 0"),
        (["--batch-size", "-8"], "argument --batch-size: batch_size must be >= 8 (an integer); "
         "got -8"),
        (["--length", "2"], "argument --length: length must be >= 4 (an integer); got 2"),
        (["--width", "0"], "argument --width: width must be >= 1 (an integer); got 0"),
        (["--layers", "-1"], "argument --layers: layers must be >= 1 (an integer); got -1"),
        (["--heads", "0"], "argument --heads: heads must be >= 1 (an integer); got 0"),
        (["--plot", "out.txt"], "--plot out.txt: matplotlib cannot write '.txt' files"),
    ],
)  # fmt: skip
def test_bad_demo_arguments_fail_before_any_work(capsys, argv, message):
    assert message in _demo_error(capsys, *argv)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_paths_fail_before_any_work(capsys, option):
    # /proc refuses new files even to root, so this holds whoever runs the tests.
    path = "/proc/unsplit-out.png"
    err = _demo_error(capsys, option, path)
    assert f"{option} {path}: cannot write there" in err and "Fix:" in err


def test_json_and_plot_must_be_different_files(capsys, tmp_path):
    path = str(tmp_path / "out.png")
    err = _demo_error(capsys, "--json", path, "--plot", path)
    assert "--json and --plot name the same file" in err
    assert not os.path.exists(path)  # the write check leaves nothing behind


# ---- docs/testing.md: its example runs as written --------------------------------------


@pytest.mark.multiprocess
def test_the_testing_docs_example_runs(tmp_path, monkeypatch):
    page = (pathlib.Path(__file__).parents[3] / "docs" / "testing.md").read_text()
    section = page.split("## A test of your own step on 2 processes", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "multiprocess_doc_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)  # the workers import it by name too
    example = importlib.import_module("multiprocess_doc_example")
    example.test_two_processes_compute_the_one_device_step()
