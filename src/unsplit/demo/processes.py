"""The demo's multi-process rows: 2 real local processes x 2 devices x 2 microbatches.

:func:`run_processes` starts 2 JAX processes on this machine
(:func:`unsplit.testing.run_local_processes`, ``jax.distributed`` over
gloo on 127.0.0.1). Each runs :func:`process_worker`: the same model, data and
seed as the parent, a mesh over the 4 devices of both processes, and only its
own rows of each global batch (grain's order, ``unsplit.data.global_steps``),
assembled with their record ids by ``unsplit.global_batch``. Process 0
writes the parameter snapshots to an ``.npz`` file and its progress to a small
file, which the parent polls to move its progress bar.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit import models, testing
from unsplit.demo import data as demo_data
from unsplit.demo import train as dt

PROCESSES = 2
DEVICES_PER_PROCESS = 2
MICROBATCHES = 2


def run_processes(
    config: dt.DemoConfig,
    bitwise: list[bool],
    on_progress: Callable[[int, int], None] = lambda mode, step: None,
    timeout_s: float = 600.0,
) -> list[dt.Run]:
    """Trains one run per entry of ``bitwise`` in 2 local processes; returns the runs.

    Args:
        config: the demo's settings (the same as the parent's runs).
        bitwise: the mode of each run, e.g. ``[False, True]``.
        on_progress: called as ``on_progress(run_index, steps_done)`` while they train.
        timeout_s: bound on the whole launch; on expiry every process is killed.

    Raises:
        unsplit.testing.LaunchError: a process failed or ran out of time.
    """
    with tempfile.TemporaryDirectory(prefix="unsplit-demo-") as tmp:
        snapshots, status = os.path.join(tmp, "snapshots.npz"), os.path.join(tmp, "progress")
        kwargs = {
            "config": dataclasses.asdict(config),
            "bitwise": list(bitwise),
            "snapshots": snapshots,
            "progress": status,
        }
        stop = threading.Event()

        # The launch runs in the calling thread, so Ctrl-C reaches its cleanup (which
        # kills the processes); a helper thread relays their progress.
        def poll():
            while not stop.wait(0.25):
                done = _read_progress(status)
                if done is not None:
                    on_progress(*done)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            results = testing.run_local_processes(
                "unsplit.demo.processes:process_worker",
                num_processes=PROCESSES,
                devices_per_process=DEVICES_PER_PROCESS,
                kwargs=kwargs,
                timeout_s=timeout_s,
            )
        finally:
            stop.set()
            poller.join()
        runs = []
        with np.load(snapshots) as leaves:
            for m, r in enumerate(results[0]["runs"]):
                snaps = {
                    step: [leaves[f"m{m}_s{step}_l{i}"] for i in range(r["leaves"])]
                    for step in r["snapshot_steps"]
                }
                runs.append(dt.Run(np.asarray(r["losses"]), snaps, r["step_time_s"], r["wall_s"]))
        return runs


def _read_progress(path: str) -> tuple[int, int] | None:
    try:
        with open(path) as f:
            mode, step = f.read().split()
        return int(mode), int(step)
    except (OSError, ValueError):
        return None


def process_worker(config: dict, bitwise: list[bool], snapshots: str, progress: str) -> dict:
    """One of the processes (run by ``unsplit.testing.run_local_processes``; not for direct use)."""
    cfg = dt.DemoConfig(**config)
    model, params, opt = dt.initial_state(cfg)
    apply = dt.apply_fn(opt)
    mesh = dt.make_mesh(jax.device_count())
    data = demo_data.Dataset(cfg.batch_size, cfg.length, cfg.seed, mesh=mesh)  # only our rows
    loss_fn = models.token_loss(model)
    lead = jax.process_index() == 0
    replicated = NamedSharding(mesh, P())

    def replicate(tree):
        return jax.tree.map(lambda x: _replicated(np.asarray(x), replicated), tree)

    def local_rows(rows, ids):
        return unsplit.global_batch(rows, mesh, ids)

    runs, arrays = [], {}
    for m, b in enumerate(bitwise):
        step = dt.unsplit_step(
            cfg, loss_fn, devices=mesh.size, microbatches=MICROBATCHES, bitwise=b, mesh=mesh
        )

        def on_step(s, m=m):
            if lead and (s % 5 == 0 or s == cfg.steps):
                with open(progress + ".tmp", "w") as f:
                    f.write(f"{m} {s}")
                os.replace(progress + ".tmp", progress)

        r = dt.train(
            cfg,
            dt.unsplit_update(step, apply),
            replicate(params),
            replicate(jax.device_get(opt.init(params))),
            data,
            batch_fn=local_rows,
            on_step=on_step,
        )
        for s, leaves in r.snapshots.items():
            arrays.update({f"m{m}_s{s}_l{i}": x for i, x in enumerate(leaves)})
        runs.append(
            {
                "losses": r.losses.tolist(),
                "step_time_s": r.step_time_s,
                "wall_s": r.wall_s,
                "snapshot_steps": sorted(r.snapshots),
                "leaves": len(next(iter(r.snapshots.values()))),
            }
        )
    if lead:
        np.savez(snapshots, **arrays)
    return {"process": jax.process_index(), "runs": runs}


def _replicated(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The same host value on every device of a (multi-process) mesh."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
