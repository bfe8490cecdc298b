"""Start several local JAX processes (``jax.distributed`` over gloo) and collect results.

Used by the tests, by ``unsplit demo`` and by users (:mod:`unsplit.testing`) to
run a function as a real multi-process program on one machine: each process
gets its own simulated CPU devices, joins a coordinator on 127.0.0.1, runs
``module:function(**kwargs)`` and returns a JSON-serializable result.

Nothing is left behind and nothing waits long:

* a worker whose function raises prints the traceback and exits at once
  (code 1) instead of waiting in ``jax.distributed``'s shutdown barrier;
* the launcher polls every process; as soon as one fails (an exception, a
  signal, any non-zero exit) it kills every process group it started and raises
  :class:`LaunchError` naming the process, its exit code, its error and the
  tail of every log;
* without the launcher, the ``jax.distributed`` settings end the others:
  a dead peer breaks their gloo collectives at once, and the coordination
  service ends a process whose peer stops sending heartbeats within
  ``HEARTBEAT_TIMEOUT_S`` seconds;
* a worker whose launcher dies (even by SIGKILL) exits within a second.

Example:
    >>> from unsplit._src.processes import launch
    >>> results = launch.run_local_processes(  # doctest: +SKIP
    ...     "unsplit._src.processes.launch:describe", num_processes=2, devices_per_process=2)
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
import threading
import time
import traceback
from typing import Any

#: ``jax.distributed.initialize(heartbeat_timeout_seconds=...)`` of the workers: a process
#: that stops sending heartbeats (dead, or frozen) ends the others within this many seconds.
HEARTBEAT_TIMEOUT_S = 10
_LAUNCHER_ENV = "UNSPLIT_LAUNCHER_PID"
_POLL_S = 0.02


class LaunchError(RuntimeError):
    """A worker process failed or the processes did not finish in time.

    Attributes:
        process_id: the process that failed first (``None`` on a timeout).
        exit_code: its exit code (negative: killed by that signal), or ``None``.
        logs: every process's log (stdout and stderr), indexed by process id.
    """

    def __init__(self, message: str, process_id=None, exit_code=None, logs=()):
        super().__init__(message)
        self.process_id = process_id
        self.exit_code = exit_code
        self.logs = list(logs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a ``jax.distributed`` coordinator).

    Example:
        >>> address = f"127.0.0.1:{free_port()}"  # coordinator_address=address
        >>> 0 < int(address.rsplit(":", 1)[1]) < 65536
        True
    """
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
        target: the function to run in every process, as ``"module:function"``
            or the (module-level) function itself; the workers import it from
            the current folder, ``PYTHONPATH`` or the installed packages;
            it is called as ``function(**kwargs)`` after ``jax.distributed`` is
            initialized, and must return something ``json.dumps`` accepts.
        num_processes: how many processes to start.
        devices_per_process: simulated CPU devices in each process.
        kwargs: JSON-serializable keyword arguments for the function.
        timeout_s: wall-clock bound for the whole run; on expiry every process
            is killed and :class:`LaunchError` is raised.

    Returns:
        The functions' results, indexed by process id.

    Raises:
        LaunchError: a process failed (its function raised, it was killed or it
            exited with a non-zero code) or time ran out. Every process has been
            killed when it is raised.
    """
    if callable(target):  # a module-level function: its importable name
        module = getattr(target, "__module__", None)
        name = getattr(target, "__qualname__", repr(target))
        if module in (None, "__main__") or "<locals>" in name:
            raise ValueError(
                f"target {name!r} cannot be imported by the workers (defined in {module!r}); "
                "Fix: define it at module level in an importable module, or pass "
                "'module:function'."
            )
        target = f"{module}:{name}"
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(
            f"target must be 'module:function'; got {target=!r}. "
            "Fix: e.g. target='my_tests.workers:train_step'."
        )
    env = worker_env(devices_per_process)
    env[_LAUNCHER_ENV] = str(os.getpid())
    payload = json.dumps(kwargs or {})
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="unsplit-launch-") as tmp:
        procs, outs, logs = [], [], []
        try:
            for pid in range(num_processes):
                out = os.path.join(tmp, f"result{pid}.json")
                log = open(os.path.join(tmp, f"log{pid}.txt"), "w+")  # noqa: SIM115
                cmd = worker_command(target, pid, num_processes, port, payload, out)
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,  # its own process group: killed as a whole
                    )
                )
                outs.append(out)
            _wait_all(procs, outs, logs, timeout_s)
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


def worker_env(devices_per_process: int) -> dict[str, str]:
    """This process's environment for a worker: ``devices_per_process`` CPU devices."""
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
    env["PYTHONUNBUFFERED"] = "1"  # a killed worker's last lines still reach its log
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env.pop(_LAUNCHER_ENV, None)
    return env


def worker_command(
    target: str, process_id: int, num_processes: int, port: int, kwargs_json: str, out: str
) -> list[str]:
    """The command line of one worker (``python -m unsplit.testing ...``)."""
    return [
        sys.executable, "-m", "unsplit.testing", "--target", target,
        "--process-id", str(process_id), "--num-processes", str(num_processes),
        "--port", str(port), "--kwargs", kwargs_json, "--out", out,
    ]  # fmt: skip


def _wait_all(procs, outs, logs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # Processes seen dead in the same poll: a signal's victim or the earliest
            # exception is the cause; the others died of it (their peer vanished).
            errors = {i: _read_error(outs[i]) for i in failed}
            first = min(
                failed, key=lambda i: (codes[i] >= 0, errors[i].get("time", float("inf")), i)
            )
            for p in procs:  # stop the survivors now, before reading their logs
                _kill(p)
            texts = _read_logs(logs)
            raise LaunchError(
                _failure_message(first, codes, errors, len(procs), texts),
                process_id=first,
                exit_code=codes[first],
                logs=texts,
            )
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [i for i, c in enumerate(codes) if c is None]
            for p in procs:
                _kill(p)
            texts = _read_logs(logs)
            raise LaunchError(
                f"processes {running} did not finish within timeout_s={timeout_s:.0f}; every "
                "process was killed. Fix: look for a hang below (a process waiting in a "
                "collective the others never reached), or raise timeout_s.\n" + _tails(texts, {}),
                logs=texts,
            )
        time.sleep(_POLL_S)


def _failure_message(first, codes, errors, count, texts) -> str:
    code = codes[first]
    how = f"exit code {code}" if code >= 0 else f"exit code {code}, killed by {_signal(code)}"
    error = errors[first]
    what = f": {error['type']}: {error['message']}" if error else ""
    others = [i for i, c in enumerate(codes) if i != first]
    return (
        f"process {first} of {count} failed ({how}){what}\n"
        f"The other processes ({', '.join(map(str, others))}) were stopped. "
        f"Its log ends with the cause:\n" + _tails(texts, {first: 6000})
    )


def _signal(code: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return f"signal {-code}"


def _read_error(out: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError), open(out + ".error") as f:
        return json.load(f)
    return {}


def _read_logs(logs) -> list[str]:
    texts = []
    for log in logs:
        log.flush()
        log.seek(0)
        texts.append(log.read())
    return texts


def _tails(texts: list[str], sizes: dict[int, int], default: int = 2000) -> str:
    order = sorted(range(len(texts)), key=lambda i: i not in sizes)
    parts = []
    for i in order:
        chars = sizes.get(i, default)
        parts.append(
            f"--- process {i}: last {chars} characters of its log ---\n{texts[i][-chars:]}"
        )
    return "\n".join(parts)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
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
    """``python -m unsplit.testing``: one worker process of :func:`run_local_processes`."""
    parser = argparse.ArgumentParser(
        prog="python -m unsplit.testing",
        description="one worker process of unsplit.testing.run_local_processes: joins the "
        "jax.distributed coordinator on 127.0.0.1:PORT (process 0 starts it), runs "
        "MOD:FN(**KWARGS) and writes its JSON result to FILE",
    )
    parser.add_argument("--target", required=True, metavar="MOD:FN")
    parser.add_argument("--process-id", type=int, required=True, metavar="I")
    parser.add_argument("--num-processes", type=int, required=True, metavar="N")
    parser.add_argument("--port", type=int, required=True, metavar="P")
    parser.add_argument("--kwargs", default="{}", metavar="JSON")
    parser.add_argument("--out", required=True, metavar="FILE")
    args = parser.parse_args(argv)
    _exit_with_launcher()
    try:
        result = _run_target(args)
    except BaseException as e:  # SystemExit and Ctrl-C included
        _fail(args.out, e)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    import jax

    jax.distributed.shutdown()  # waits for the others: a clean exit leaves no peer behind


def _run_target(args: argparse.Namespace) -> Any:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=120,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
    module_name, _, fn_name = args.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise
        raise ModuleNotFoundError(
            f"the worker cannot import {module_name!r} ({e}); it searches the current folder "
            f"and PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}. Fix: run from the folder "
            "that contains it, add that folder to PYTHONPATH, or install the package."
        ) from e
    fn = getattr(module, fn_name)
    return fn(**json.loads(args.kwargs))


def _fail(out: str, error: BaseException) -> None:
    """Reports ``error`` and exits now: never wait in the shutdown barrier for peers."""
    traceback.print_exc()
    with contextlib.suppress(OSError), open(out + ".error", "w") as f:
        message = str(error).strip()
        if len(message) > 2000:
            message = message[:2000] + " ..."
        json.dump({"type": type(error).__name__, "message": message, "time": time.time()}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _exit_with_launcher() -> None:
    """When started by :func:`run_local_processes`, exit as soon as the launcher is gone."""
    launcher = os.environ.get(_LAUNCHER_ENV)
    if launcher is None or int(launcher) != os.getppid():
        return

    def watch():
        while os.getppid() == int(launcher):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="unsplit-launcher-watch").start()
