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
import time
from collections.abc import Callable
from typing import Any

import jax

from unsplit import models, testing
from unsplit.demo import data as demo_data
from unsplit.demo import processes as demo_processes
from unsplit.demo import progress as demo_progress
from unsplit.demo import resume as demo_resume
from unsplit.demo import rows
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
    # reference's step and first step (its compiles). Bitwise mode compiles its chunk
    # program once per device (8 programs for the 8-device row; the later rows reuse
    # them); the process rows include starting the processes.
    return [
        Schedule(f"reference{x}", 1, 1, bitwise=b, cost=4.6 if b else 1, compiles=1.0),
        Schedule(f"8 devices{x}", 8, 1, bitwise=b, cost=7 if b else 15, compiles=7 if b else 0.9),
        Schedule(f"1 device x 8 microbatches{x}", 1, 8, bitwise=b, cost=3 if b else 2,
                 compiles=0.1 if b else 0.8),
        Schedule(f"2 devices x 4 microbatches{x}", 2, 4, bitwise=b, cost=4.5 if b else 22,
                 compiles=0.3 if b else 1.1),
        Schedule(f"2 processes x 2 devices x 2 microbatches{x}", 4, 2, processes=2, bitwise=b,
                 cost=3 if b else 22, compiles=2.7 if b else 4.0),
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


BASELINE = rows.BASELINE
BASELINE_COST = (1.8, 0.7, 0.0)
ELASTIC_COST = (17.0, 6.0, 0.0)  # two launches (1 then 2 processes), both compile
CALIBRATE_AT = 11  # the reference's step 1 (compile) to this step times the estimate
CONTRASTS = (
    Contrast("per-device keys (shard_prng_key), 8 devices", "per_device_keys", 8, 1, BASELINE, 22, 0.9),
    Contrast("same key every microbatch (T5X), 1 x 8", "same_key_microbatches", 1, 8, BASELINE, 1.3, 1.0),
    Contrast("optax.MultiSteps mean of means, 1 x 8", "multisteps", 1, 8, "reference", 2.2, 0.7),
)  # fmt: skip


def bitwise_unavailable(config: dt.DemoConfig, loss_fn: Callable) -> str | None:
    """None if ``bitwise=True`` works in this install, else the reason it does not."""
    try:
        dt.unsplit_step(config, loss_fn, devices=1, microbatches=1, bitwise=True)
    except NotImplementedError as e:
        return str(e)
    return None


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
        "skipped", "inert_params", "elapsed_s", ...}``; the demo guide (https://unsplit.readthedocs.io/en/latest/demo/)
        explains every field.
    """
    config.check()
    trainer = Trainer(config, say, bar, started=time.perf_counter())
    plan = make_plan(config, processes, bitwise_unavailable(config, trainer.loss_fn))
    if plan.reason:
        say(f"[bold yellow]Skipping the bitwise rows:[/] {plan.reason}")
    trainer.todo = plan.costs()
    trainer.progress.plan(trainer.todo)
    train_local(trainer, plan)
    train_processes(trainer, plan, timeout_s)
    elastic_info = train_elastic(trainer, plan, timeout_s)
    trainer.progress.advance(trainer.progress.total)
    return results(trainer, plan, elastic_info)


@dataclasses.dataclass
class Plan:
    """Which rows run: the local and 2-process schedules, the elastic row, and what is skipped."""

    reason: str | None  # why bitwise mode is unavailable (None: it is available)
    local: list[Schedule]
    remote: list[Schedule]
    elastic: bool
    skipped: list[dict[str, str]]

    @property
    def bitwise(self) -> bool:
        return self.reason is None

    def costs(self) -> list[tuple[float, float, float]]:
        """``(step cost, compiles, fixed s)`` of every run, in the order they run."""
        todo = [(s.cost, s.compiles, s.fixed_s) for s in self.local]
        todo += [BASELINE_COST] + [(c.cost, c.compiles, 0.0) for c in CONTRASTS]
        todo += [(s.cost, s.compiles, s.fixed_s) for s in self.remote]
        return [*todo, ELASTIC_COST] if self.elastic else todo


def make_plan(config: dt.DemoConfig, processes: bool, reason: str | None) -> Plan:
    """The rows to run given ``--no-processes`` and ``reason`` (bitwise mode unavailable)."""
    modes = [False] if reason else [False, True]
    everything = [s for b in (False, True) for s in schedules(b)]
    chosen = [s for s in everything if s.bitwise in modes and (processes or s.processes == 1)]
    skipped = [
        {"name": s.name, "reason": reason if s.bitwise not in modes else "--no-processes"}
        for s in everything
        if s not in chosen
    ]
    elastic = reason is None and processes
    if not elastic:
        skipped.append(
            {"name": demo_resume.name(config.steps), "reason": reason or "--no-processes"}
        )
    return Plan(
        reason=reason,
        local=[s for s in chosen if s.processes == 1],
        remote=[s for s in chosen if s.processes > 1],
        elastic=elastic,
        skipped=skipped,
    )


class Trainer:
    """The shared state of every local run: data, model, initial params, progress, results."""

    def __init__(self, config: dt.DemoConfig, say: Callable[[str], None], bar: Any, started: float):
        self.config, self.say, self.started = config, say, started
        self.data = demo_data.Dataset(config.batch_size, config.length, config.seed)
        self.model, self.params, self.opt = dt.initial_state(config)
        self.apply = dt.apply_fn(self.opt)
        self.loss_fn = models.token_loss(self.model)  # one object: bitwise compiles once
        self.progress = demo_progress.Progress(config.steps, bar)
        self.todo: list[tuple[float, float, float]] = []
        self.runs: dict[str, dt.Run] = {}

    def train(self, name: str, cost: tuple[float, float, float], update, init) -> None:
        """Trains row ``name`` in this process, moving the bar by its estimated ``cost``."""
        self.progress.label(name)
        self.todo.pop(0)
        on_step = self._on_step(name, *cost, began=time.perf_counter())
        self.runs[name] = dt.train(
            self.config, update, self.params, init(self.params), self.data, on_step=on_step
        )

    def _on_step(self, name: str, cost: float, compiles: float, fixed_s: float, began: float):
        progress, marks = self.progress, {}

        def on_step(step: int) -> None:
            first = compiles * progress.compile_s + fixed_s if step == 1 else 0.0
            progress.advance(cost * progress.step_s + first)
            if name == "reference" and step in (1, CALIBRATE_AT):
                marks[step] = time.perf_counter()
                if step == CALIBRATE_AT:
                    self._calibrate(marks[1] - began, marks[CALIBRATE_AT] - marks[1])

        return on_step

    def _calibrate(self, compile_s: float, steps_s: float) -> None:
        """Refines the estimate from the reference's first compile and steps; says the total."""
        progress = self.progress
        progress.step_s = steps_s / (CALIBRATE_AT - 1)
        progress.compile_s = compile_s
        left = (self.config.steps - CALIBRATE_AT) * progress.step_s + progress.plan(self.todo)
        total = time.perf_counter() - self.started + left
        self.say(f"Estimated time on this machine: about {demo_progress.duration(total)} in all.")

    def follow(self, costs: list[tuple[float, float, float]]):
        """A callback ``(index, step)`` moving the bar through runs of ``costs`` done elsewhere."""
        progress, seen = self.progress, {"s": 0.0}

        def seconds(cost: tuple[float, float, float], steps: int) -> float:
            step_cost, compiles, fixed_s = cost
            return compiles * progress.compile_s + fixed_s + steps * step_cost * progress.step_s

        def on_progress(index: int, step: int) -> None:
            now = sum(seconds(c, self.config.steps) for c in costs[:index])
            now += seconds(costs[index], step)
            progress.advance(max(0.0, now - seen["s"]))
            seen["s"] = max(seen["s"], now)

        return on_progress


def train_local(trainer: Trainer, plan: Plan) -> None:
    """The schedules of this process, the flax baseline and the contrast rows."""
    config, model, opt = trainer.config, trainer.model, trainer.opt
    for s in plan.local:
        step = dt.unsplit_step(
            config,
            trainer.loss_fn,
            devices=s.devices,
            microbatches=s.microbatches,
            bitwise=s.bitwise,
        )
        update = dt.unsplit_update(step, trainer.apply)
        trainer.train(s.name, (s.cost, s.compiles, s.fixed_s), update, opt.init)
    trainer.train(BASELINE, BASELINE_COST, dt.flax_update(model, opt, "one_device"), opt.init)
    for c in CONTRASTS:
        if c.scheme == "multisteps":
            update, init = dt.multisteps_update(model, opt, c.microbatches)
        else:
            update, init = dt.flax_update(model, opt, c.scheme), opt.init
        trainer.train(c.name, (c.cost, c.compiles, 0.0), update, init)


def train_processes(trainer: Trainer, plan: Plan, timeout_s: float) -> None:
    """The 2-process rows (one launch of 2 processes); on failure, noted and left out."""
    remote = plan.remote
    if not remote:
        return
    trainer.progress.label(remote[0].name + " (starting 2 processes)")
    follow = trainer.follow([(s.cost, s.compiles, s.fixed_s) for s in remote])

    def on_progress(index: int, step: int) -> None:
        trainer.progress.label(remote[index].name)
        follow(index, step)

    try:
        got = demo_processes.run_processes(
            trainer.config, [s.bitwise for s in remote], on_progress, timeout_s
        )
    except testing.LaunchError as e:
        trainer.say(f"[bold red]The 2-process rows failed and are left out:[/] {e}")
        plan.skipped += [{"name": s.name, "reason": f"launch failed: {e}"} for s in remote]
        plan.remote = []
        return
    trainer.runs.update({s.name: r for s, r in zip(remote, got, strict=True)})


def train_elastic(trainer: Trainer, plan: Plan, timeout_s: float) -> dict | None:
    """The elastic row: ``{"killed_after", "resumed_from"}``, or None if it did not run."""
    if not plan.elastic:
        return None
    label = demo_resume.name(trainer.config.steps)
    trainer.progress.label(label)
    follow = trainer.follow([ELASTIC_COST])
    try:
        trainer.runs[label], info = demo_resume.run_elastic(
            trainer.config, lambda step: follow(0, step), timeout_s
        )
    except testing.LaunchError as e:
        trainer.say(f"[bold red]The elastic row failed and is left out:[/] {e}")
        plan.skipped.append({"name": label, "reason": f"launch failed: {e}"})
        plan.elastic = False
        return None
    return info


def results(trainer: Trainer, plan: Plan, elastic_info: dict | None) -> dict[str, Any]:
    """The JSON-ready result of every run (the demo guide: https://unsplit.readthedocs.io/en/latest/demo/#the-json)."""
    runs = trainer.runs
    inert = rows.inert_leaves(trainer.params)
    flat = jax.tree_util.tree_flatten_with_path(trainer.params)[0]
    skip = {i for i, (p, _) in enumerate(flat) if jax.tree_util.keystr(p) in inert}

    def row(name: str, against: str, **fields) -> dict[str, Any]:
        return rows.result_row(name, runs[name], runs[against], against, skip, **fields)

    result = {
        "config": dataclasses.asdict(trainer.config),
        "environment": rows.environment(),
        "schedules": rows.schedule_rows(row, plan, elastic_info, trainer.config.steps),
        "contrast": [rows.contrast_row(row, c) for c in CONTRASTS],
        "baselines": [rows.baseline_row(runs[BASELINE])],
        "skipped": plan.skipped,
        "inert_params": inert,
    }
    if plan.bitwise:
        curve, _, _ = rows.compare(
            runs["reference, bitwise"].snapshots, runs["reference"].snapshots, skip
        )
        result["default_vs_bitwise_reference_max_abs_param_diff"] = curve[-1][1]
    result["elapsed_s"] = time.perf_counter() - trainer.started
    return result
