"""Start several local JAX processes (``jax.distributed`` over gloo) and collect results.

Used by the tests and by ``unsplit demo`` to run a function as a real
multi-process program on one machine: each process gets its own simulated CPU
devices, joins a coordinator on 127.0.0.1, runs ``module:function(**kwargs)``
and returns a JSON-serializable result. Time is bounded and every process is
killed on failure, timeout or interrupt.

Example:
    >>> from unsplit._src import launch
    >>> results = launch.run_local_processes(  # doctest: +SKIP
    ...     "unsplit._src.launch:describe", num_processes=2, devices_per_process=2)
    >>> [r["process_index"] for r in results]   # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any


class LaunchError(RuntimeError):
    """A worker process failed or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_processes(
    target: str,
    *,
    num_processes: int = 2,
    devices_per_process: int = 2,
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Runs ``target`` (``"module:function"``) in ``num_processes`` local JAX processes.

    Args:
        target: the function to run in every process, as ``"module:function"``;
            it is called as ``function(**kwargs)`` after ``jax.distributed`` is
            initialized, and must return something ``json.dumps`` accepts.
        num_processes: how many processes to start.
        devices_per_process: simulated CPU devices in each process.
        kwargs: JSON-serializable keyword arguments for the function.
        timeout_s: wall-clock bound for the whole run; on expiry every process
            is killed and :class:`LaunchError` is raised.

    Returns:
        The functions' results, indexed by process id.
    """
    port = free_port()
    env = dict(os.environ)
    # Keep the caller's other XLA flags: they can change the compiled code, and the
    # processes must compile exactly what the caller would.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    payload = json.dumps(kwargs or {})
    with tempfile.TemporaryDirectory(prefix="unsplit-launch-") as tmp:
        procs, outs, logs = [], [], []
        try:
            for pid in range(num_processes):
                out = os.path.join(tmp, f"result{pid}.json")
                log = open(os.path.join(tmp, f"log{pid}.txt"), "w+")  # noqa: SIM115
                cmd = [
                    sys.executable, "-m", "unsplit.testing", "--target", target,
                    "--process-id", str(pid), "--num-processes", str(num_processes),
                    "--port", str(port), "--kwargs", payload, "--out", out,
                ]  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
                outs.append(out)
                logs.append(log)
            _wait_all(procs, logs, timeout_s)
            results = []
            for out in outs:
                with open(out) as f:
                    results.append(json.load(f))
            return results
        finally:
            for p in procs:
                _kill(p)
            for log in logs:
                log.close()


def _wait_all(procs, logs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise LaunchError(
                f"process {failed[0]} exited with code {codes[failed[0]]}:\n" + _tails(logs)
            )
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise LaunchError(f"processes did not finish within {timeout_s:.0f}s:\n" + _tails(logs))
        time.sleep(0.05)


def _tails(logs, chars: int = 3000) -> str:
    parts = []
    for i, log in enumerate(logs):
        log.flush()
        log.seek(0)
        parts.append(f"--- process {i} ---\n{log.read()[-chars:]}")
    return "\n".join(parts)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def describe() -> dict[str, Any]:
    """A tiny worker: what this process sees (used to test the launcher)."""
    import jax

    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "devices": jax.device_count(),
    }


def worker_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m unsplit.testing",
        description="one worker process of unsplit.testing.run_local_processes",
    )
    parser.add_argument("--target", required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kwargs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=120,
    )
    module_name, fn_name = args.target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    result = fn(**json.loads(args.kwargs))
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    jax.distributed.shutdown()
