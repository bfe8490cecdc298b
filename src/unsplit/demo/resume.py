"""The demo's elastic row: a bitwise run killed mid-way and resumed on another topology.

:func:`run_elastic` trains the demo's model in bitwise mode on 1 process x 4
devices x 2 microbatches with a checkpoint (``unsplit.checkpoint``) every
quarter of the run, SIGKILLs that process after 60% of the steps (its last
steps since the checkpoint are lost, as in a preemption), then resumes from
the newest checkpoint on 2 processes x 2 devices x 1 microbatch to the end.
Both phases read grain's data order (``unsplit.data.global_steps``), so they
see the same records with the same ids as every other row; the final
parameters are compared with the bitwise reference's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import unsplit
from unsplit import testing
from unsplit.demo import elastic
from unsplit.demo import train as dt

FIRST = {"processes": 1, "devices": 4, "microbatches": 2}
SECOND = {"processes": 2, "devices": 2, "microbatches": 1}


def plan(steps: int) -> tuple[int, int]:
    """``(save_every, kill_after)``: a checkpoint every quarter, the kill after 60% of the steps.

    Example:
        >>> from unsplit.demo.resume import plan
        >>> plan(16), plan(200)
        ((4, 9), (50, 120))
    """
    return max(1, steps // 4), max(2, (6 * steps) // 10)


def name(steps: int) -> str:
    """The row's name, e.g. ``elastic: 1 x 4 x 2 killed at 9, resumed from 8 on 2 x 2 x 1, bitwise``."""
    f, s = FIRST, SECOND
    save_every, kill_after = plan(steps)
    return (
        f"elastic: {f['processes']} x {f['devices']} x {f['microbatches']} killed at "
        f"{kill_after}, resumed from {kill_after // save_every * save_every} on "
        f"{s['processes']} x {s['devices']} x {s['microbatches']}, bitwise"
    )


def run_elastic(
    config: dt.DemoConfig,
    on_progress: Callable[[int], None] = lambda step: None,
    timeout_s: float = 600.0,
) -> tuple[dt.Run, dict]:
    """Trains, kills and resumes the run; returns it and ``{"killed_after", "resumed_from"}``.

    Raises:
        unsplit.testing.LaunchError: a phase failed other than by the planned kill.
    """
    save_every, kill_after = plan(config.steps)
    with tempfile.TemporaryDirectory(prefix="unsplit-elastic-") as tmp:
        kwargs = {"config": dataclasses.asdict(config), "folder": tmp, "save_every": save_every}
        with _relay_progress(os.path.join(tmp, "progress"), on_progress):
            _first_phase(kwargs, kill_after, timeout_s)
            (timing, *_) = testing.run_local_processes(
                "unsplit.demo.resume:worker",
                num_processes=SECOND["processes"],
                devices_per_process=SECOND["devices"],
                kwargs={**kwargs, "microbatches": SECOND["microbatches"], "kill_after": None},
                timeout_s=timeout_s,
            )
        losses, snapshots = _read_run(tmp, config)
    run = dt.Run(losses, snapshots, timing["step_time_s"], timing["wall_s"])
    return run, {"killed_after": kill_after, "resumed_from": timing["resumed_from"]}


@contextlib.contextmanager
def _relay_progress(path: str, on_progress: Callable[[int], None]):
    """While inside, a helper thread passes the step the workers write to ``path`` on."""
    stop = threading.Event()

    def poll():
        while not stop.wait(0.25):
            done = _read_int(path)
            if done is not None:
                on_progress(done)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join()


def _first_phase(kwargs: dict, kill_after: int, timeout_s: float) -> None:
    """The first topology, SIGKILLed after step ``kill_after`` (the planned failure)."""
    try:
        testing.run_local_processes(
            "unsplit.demo.resume:worker",
            num_processes=FIRST["processes"],
            devices_per_process=FIRST["devices"],
            kwargs={**kwargs, "microbatches": FIRST["microbatches"], "kill_after": kill_after},
            timeout_s=timeout_s,
        )
        raise testing.LaunchError("the first phase finished instead of being killed")
    except testing.LaunchError:
        if _read_int(os.path.join(kwargs["folder"], "killed")) != kill_after:
            raise  # anything but the planned SIGKILL


def _read_run(folder: str, config: dt.DemoConfig) -> tuple[np.ndarray, dict]:
    """The losses of both phases (a step redone after the resume wins) and the snapshots."""
    losses = {}
    with open(os.path.join(folder, "losses")) as f:
        for line in f:  # the steps redone after the resume come later and win
            step, loss = line.split()
            losses[int(step)] = float(loss)
    snapshots = {}
    for step in config.snapshot_steps():
        with np.load(os.path.join(folder, f"snapshot{step}.npz")) as leaves:
            snapshots[step] = [leaves[f"l{i}"] for i in range(len(leaves.files))]
    return np.array([losses[s] for s in range(1, config.steps + 1)]), snapshots


def worker(
    config: dict, folder: str, save_every: int, microbatches: int, kill_after: int | None
) -> dict:
    """One process of either phase (run by ``unsplit.testing.run_local_processes``; not for direct use)."""
    import time

    cfg = dt.DemoConfig(**config)
    ecfg = elastic.ElasticConfig(
        global_batch=cfg.batch_size, length=cfg.length, width=cfg.width, layers=cfg.layers,
        heads=cfg.heads, dropout=cfg.dropout, learning_rate=cfg.learning_rate, seed=cfg.seed,
        bitwise=True, chunk_size=cfg.batch_size // 8, microbatches=microbatches,
    )  # fmt: skip
    began = time.perf_counter()
    run = elastic.setup(ecfg, unsplit.mesh_over(jax.local_device_count()))
    ckpt = unsplit.checkpoint.Checkpointer(os.path.join(folder, "ckpt"), settings=run.settings)
    params, opt_state, start = run.params, run.opt_state, 0
    if ckpt.latest_step() is not None:
        start, (params, opt_state) = ckpt.restore(like=(params, opt_state))
    update = elastic.train_step(run.step, run.optimizer)
    lead = jax.process_index() == 0
    snap_at = set(cfg.snapshot_steps())
    timed = time.perf_counter()
    for s in range(start, cfg.steps):
        if s == start + 1:
            timed = time.perf_counter()
        batch, ids, key = elastic.global_step(run, s)
        loss, params, opt_state = update(params, opt_state, batch, key, ids)
        done = s + 1
        if done % save_every == 0:
            ckpt.save(done, (params, opt_state))
        if lead:
            with open(os.path.join(folder, "losses"), "a") as f:
                f.write(f"{done} {float(np.asarray(loss.addressable_data(0)))!r}\n")
            if done in snap_at:
                leaves = elastic.host_params(params).values()
                arrays: dict[str, Any] = {f"l{i}": x for i, x in enumerate(leaves)}
                np.savez(os.path.join(folder, f"snapshot{done}.npz"), **arrays)
            _write_int(os.path.join(folder, "progress"), done)
        if done == kill_after and lead:
            ckpt.wait()
            _write_int(os.path.join(folder, "killed"), done)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    jax.block_until_ready(params)
    now = time.perf_counter()
    return {
        "resumed_from": start,
        "step_time_s": (now - timed) / max(1, cfg.steps - start - 1),
        "wall_s": now - began,
    }


def _write_int(path: str, value: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(value))
    os.replace(path + ".tmp", path)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
