"""``unsplit demo``: the same training run under many schedules, side by side.

A small causal transformer with dropout learns the Python standard library's
own source, character by character (:mod:`~unsplit.demo.data`), for
``steps`` Adam steps from one seed, under these schedules of the same global
batch: the reference (1 device), 8 devices, 1 device x 8 microbatches,
2 devices x 4 microbatches, and 2 real processes x 2 devices x 2 microbatches
(``jax.distributed`` over gloo on this machine), each in default and in
bitwise mode, and an elastic row: a bitwise run SIGKILLed mid-way and resumed
from its checkpoint on another topology (:mod:`~unsplit.demo.resume`). Contrast rows train the same model on the same data the usual
way (:mod:`~unsplit.demo.train`). :func:`run` returns a JSON-ready dict;
:mod:`~unsplit.demo.report` prints and plots it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from unsplit._src.models import transformer as tf
from unsplit._src.processes import launch
from unsplit.demo import data as demo_data
from unsplit.demo import processes as demo_processes
from unsplit.demo import progress as demo_progress
from unsplit.demo import resume as demo_resume
from unsplit.demo import train as dt


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One way to schedule the global batch: ``processes`` x devices x microbatches."""

    name: str
    devices: int  # in all processes together
    microbatches: int
    processes: int = 1
    bitwise: bool = False
    cost: float = 1.0
    compiles: float = 1.0
    fixed_s: float = 0.0

    @property
    def reference(self) -> str:
        return "reference, bitwise" if self.bitwise else "reference"


def schedules(bitwise: bool) -> list[Schedule]:
    """The five schedules of the issue, in default or bitwise mode."""
    b = bitwise
    x = ", bitwise" if b else ""
    # cost / compiles: measured on a 2-core CPU at the default settings, relative to the
    # reference's step and compile. Bitwise mode compiles its chunk program once per
    # device (a setup of about 8 s on 2 cores, whatever the model); the process rows
    # include starting the processes.
    return [
        Schedule(f"reference{x}", 1, 1, bitwise=b, cost=2.2 if b else 1, compiles=0.6 if b else 1),
        Schedule(f"8 devices{x}", 8, 1, bitwise=b, cost=3.1 if b else 3.2, compiles=0.8 if b else 1.2,
                 fixed_s=8.0 if b else 0.0),
        Schedule(f"1 device x 8 microbatches{x}", 1, 8, bitwise=b, cost=2.3 if b else 1.7,
                 compiles=0.1 if b else 0.7),
        Schedule(f"2 devices x 4 microbatches{x}", 2, 4, bitwise=b, cost=1.7 if b else 2.1,
                 compiles=0.2 if b else 0.7),
        Schedule(f"2 processes x 2 devices x 2 microbatches{x}", 4, 2, processes=2, bitwise=b,
                 cost=6.2 if b else 8.2, compiles=1.0, fixed_s=7.0 if b else 5.0),
    ]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Contrast:
    """A run trained the usual way, and the run it should have equalled."""

    name: str
    scheme: str  # see demo_train.flax_update and demo_train.multisteps_update
    devices: int
    microbatches: int
    compared_with: str
    cost: float
    compiles: float


BASELINE = "flax baseline"  # flax's batch-level dropout, the whole batch on 1 device
_BASELINE_COST = (0.9, 0.6, 0.0)
_ELASTIC_COST = (6.5, 2.0, 14.0)  # two launches (1 then 2 processes), both compile
CONTRASTS = (
    Contrast("per-device keys (shard_prng_key), 8 devices", "per_device_keys", 8, 1, BASELINE, 2.5, 0.6),
    Contrast("same key every microbatch (T5X), 1 x 8", "same_key_microbatches", 1, 8, BASELINE, 1.0, 1.0),
    Contrast("optax.MultiSteps mean of means, 1 x 8", "multisteps", 1, 8, "reference", 2.4, 2.2),
)  # fmt: skip


def bitwise_unavailable(config: dt.DemoConfig) -> str | None:
    """None if ``bitwise=True`` works in this install, else the reason it does not."""
    try:
        dt.unsplit_step(
            config, tf.token_loss(config.model()), devices=1, microbatches=1, bitwise=True
        )
    except NotImplementedError as e:
        return str(e)
    return None


def inert_leaves(params: Any) -> list[str]:
    """Paths of the attention key biases: parameters that cannot change the model's output.

    A key bias adds the same ``q . b`` to every attention logit of a query, and
    softmax ignores such a shift, so its gradient is 0 up to rounding. Adam
    rescales that rounding noise into full-size steps, in every run alike, so
    these values drift apart between *any* two runs and say nothing about the
    schedule; :func:`compare` leaves them out of ``max_abs_param_diff``.
    """
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return [p for p in paths if p.endswith("['key']['bias']")]


def compare(snapshots: dict, reference: dict, skip: set[int] = frozenset()):
    """Max |param difference| at every snapshot step (leaves in ``skip`` left out).

    Returns:
        ``(curve, max_all, bit_identical)``: ``[[step, max diff], ...]``, the
        last step's max diff over every leaf, and whether every leaf is
        bit-identical at the last step.
    """

    def diffs(step):
        return [
            float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
            for a, b in zip(snapshots[step], reference[step], strict=True)
        ]

    curve = [
        [step, max(d for i, d in enumerate(diffs(step)) if i not in skip)]
        for step in sorted(snapshots)
    ]
    last = max(snapshots)
    same = all(
        a.dtype == b.dtype and a.tobytes() == b.tobytes()
        for a, b in zip(snapshots[last], reference[last], strict=True)
    )
    return curve, max(diffs(last)), same


def run(
    config: dt.DemoConfig,
    *,
    processes: bool = True,
    bar: Any = None,
    say: Callable[[str], None] = print,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Trains every schedule and contrast row; returns the JSON-ready results.

    Args:
        config: model, data and training settings.
        processes: also run the 2-process rows (local ``jax.distributed``).
        bar: an optional ``rich.progress.Progress`` to drive.
        say: where notes go (the time estimate, skipped rows).
        timeout_s: bound on the multi-process launch.

    Returns:
        ``{"config", "environment", "schedules", "contrast", "baselines",
        "skipped", "inert_params", "elapsed_s", ...}``; ``docs/demo.md``
        explains every field.
    """
    config.check()
    started = time.perf_counter()
    data = demo_data.Dataset(config.batch_size, config.length, config.seed)
    model, params, opt = dt.initial_state(config)
    apply = dt.apply_fn(opt)
    loss_fn = tf.token_loss(model)
    reason = bitwise_unavailable(config)
    modes = [False] if reason else [False, True]
    everything = [s for b in (False, True) for s in schedules(b)]
    plan = [s for s in everything if s.bitwise in modes and (processes or s.processes == 1)]
    skipped = [
        {"name": s.name, "reason": reason if s.bitwise not in modes else "--no-processes"}
        for s in everything
        if s not in plan
    ]
    if reason:
        say(f"[bold yellow]Skipping the bitwise rows:[/] {reason}")
    local = [s for s in plan if s.processes == 1]
    remote = [s for s in plan if s.processes > 1]

    progress = demo_progress.Progress(config.steps, bar)
    todo = [(s.cost, s.compiles, s.fixed_s) for s in local]
    todo += [_BASELINE_COST] + [(c.cost, c.compiles, 0.0) for c in CONTRASTS]
    todo += [(s.cost, s.compiles, s.fixed_s) for s in remote]
    elastic_row = True in modes and processes
    if elastic_row:
        todo.append(_ELASTIC_COST)
    else:
        skipped.append(
            {"name": demo_resume.name(config.steps), "reason": reason or "--no-processes"}
        )
    progress.plan(todo)
    runs: dict[str, dt.Run] = {}

    def one(name: str, cost: float, compiles: float, fixed_s: float, update, init) -> None:
        progress.label(name)
        todo.pop(0)
        t0 = time.perf_counter()
        marks = {}

        def on_step(step: int) -> None:
            progress.advance(
                cost * progress.step_s
                + (compiles * progress.compile_s + fixed_s if step == 1 else 0)
            )
            if name == "reference" and step in (1, 11):
                marks[step] = time.perf_counter()
                if step == 11:
                    progress.step_s = (marks[11] - marks[1]) / 10
                    progress.compile_s = marks[1] - t0
                    left = (config.steps - 11) * progress.step_s + progress.plan(todo)
                    total = marks[11] - started + left
                    say(
                        f"Estimated time on this machine: about {demo_progress.duration(total)} in all."
                    )

        runs[name] = dt.train(config, update, params, init(params), data, on_step=on_step)

    for s in local:
        step = dt.unsplit_step(
            config, loss_fn, devices=s.devices, microbatches=s.microbatches, bitwise=s.bitwise
        )
        one(s.name, s.cost, s.compiles, s.fixed_s, dt.unsplit_update(step, apply), opt.init)
    one(BASELINE, *_BASELINE_COST, dt.flax_update(model, opt, "one_device"), opt.init)
    for c in CONTRASTS:
        if c.scheme == "multisteps":
            update, init = dt.multisteps_update(model, opt, c.microbatches)
        else:
            update, init = dt.flax_update(model, opt, c.scheme), opt.init
        one(c.name, c.cost, c.compiles, 0.0, update, init)

    if remote:
        progress.label(remote[0].name + " (starting 2 processes)")
        seen = {"units": 0.0}
        start_s = remote[0].compiles * progress.compile_s + remote[0].fixed_s

        def on_progress(mode: int, step: int) -> None:
            progress.label(remote[mode].name)
            before = sum(s.cost for s in remote[:mode]) * config.steps
            now = start_s + (before + step * remote[mode].cost) * progress.step_s
            progress.advance(max(0.0, now - seen["units"]))
            seen["units"] = max(seen["units"], now)

        try:
            got = demo_processes.run_processes(
                config, [s.bitwise for s in remote], on_progress, timeout_s
            )
            runs.update({s.name: r for s, r in zip(remote, got, strict=True)})
        except launch.LaunchError as e:
            say(f"[bold red]The 2-process rows failed and are left out:[/] {e}")
            skipped += [{"name": s.name, "reason": f"launch failed: {e}"} for s in remote]
            remote = []
    elastic_info = None
    if elastic_row:
        label = demo_resume.name(config.steps)
        progress.label(label)
        cost, compiles, fixed_s = _ELASTIC_COST
        seen = {"units": 0.0}

        def on_elastic(step: int) -> None:
            now = compiles * progress.compile_s + fixed_s + step * cost * progress.step_s
            progress.advance(max(0.0, now - seen["units"]))
            seen["units"] = max(seen["units"], now)

        try:
            runs[label], elastic_info = demo_resume.run_elastic(config, on_elastic, timeout_s)
        except launch.LaunchError as e:
            say(f"[bold red]The elastic row failed and is left out:[/] {e}")
            skipped.append({"name": label, "reason": f"launch failed: {e}"})
    progress.advance(progress.total)

    inert = inert_leaves(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    skip = {i for i, p in enumerate(paths) if p in inert}

    def row(name: str, against: str, **fields) -> dict[str, Any]:
        r = runs[name]
        curve, all_diff, same = compare(r.snapshots, runs[against].snapshots, skip)
        return {
            "name": name,
            **fields,
            "final_loss": float(r.losses[-1]),
            "max_abs_param_diff": curve[-1][1],
            "max_abs_param_diff_all": all_diff,
            "bit_identical": same,
            "step_time_s": r.step_time_s,
            "wall_s": r.wall_s,
            "compared_with": against,
            "losses": r.losses.tolist(),
            "divergence": curve,
        }

    rows = [
        row(
            s.name,
            s.reference,
            devices=s.devices,
            processes=s.processes,
            microbatches=s.microbatches,
            bitwise=s.bitwise,
        )
        for s in plan
        if s.processes == 1 or s in remote
    ]
    if elastic_info is not None:
        rows.append(
            row(
                demo_resume.name(config.steps),
                "reference, bitwise",
                devices=demo_resume.SECOND["devices"] * demo_resume.SECOND["processes"],
                processes=demo_resume.SECOND["processes"],
                microbatches=demo_resume.SECOND["microbatches"],
                bitwise=True,
                **elastic_info,
            )
        )
    contrast = [
        row(
            c.name, c.compared_with, scheme=c.scheme, devices=c.devices, microbatches=c.microbatches
        )
        for c in CONTRASTS
    ]
    base = runs[BASELINE]
    result = {
        "config": dataclasses.asdict(config),
        "environment": _environment(),
        "schedules": rows,
        "contrast": contrast,
        "baselines": [
            {
                "name": BASELINE,
                "scheme": "one_device",
                "final_loss": float(base.losses[-1]),
                "step_time_s": base.step_time_s,
                "wall_s": base.wall_s,
                "losses": base.losses.tolist(),
            }
        ],
        "skipped": skipped,
        "inert_params": inert,
    }
    if True in modes:
        curve, _, _ = compare(
            runs["reference, bitwise"].snapshots, runs["reference"].snapshots, skip
        )
        result["default_vs_bitwise_reference_max_abs_param_diff"] = curve[-1][1]
    result["elapsed_s"] = time.perf_counter() - started
    return result


def _environment() -> dict[str, Any]:
    return {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
    }


def dumps(result: dict) -> str:
    """The results as indented JSON."""
    return json.dumps(result, indent=1)
