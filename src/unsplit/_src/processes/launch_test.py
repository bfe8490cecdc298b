"""The local-process launcher: it starts, collects, and ends every process on failure."""

import json
import os
import signal
import subprocess
import tempfile
import time

import jax
import pytest

from unsplit._src.processes import launch

TIMEOUT = 240  # seconds per launch; every process is killed when it expires
BOUND_S = 30  # a failure anywhere ends every process within this (a bound on hangs)


@pytest.mark.multiprocess
def test_launcher_starts_processes_and_collects_results():
    results = launch.run_local_processes(
        "unsplit._src.processes.launch:describe", timeout_s=TIMEOUT
    )
    assert [r["process_index"] for r in results] == [0, 1]
    assert all(r["devices"] == 4 and r["local_devices"] == 2 for r in results)


@pytest.mark.multiprocess
def test_launcher_reports_a_failing_worker_and_cleans_up():
    with pytest.raises(launch.LaunchError, match=r"process [01] of 2 failed \(exit code 1\)"):
        launch.run_local_processes(
            "unsplit._src.processes.launch:no_such_function", timeout_s=TIMEOUT
        )


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
                "unsplit._src.processes.launch_test:worker_peer_fails",
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
                    "unsplit._src.processes.launch_test:worker_peer_fails", i, 2, port, kwargs,
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
