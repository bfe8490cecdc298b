"""Gradient accumulation: ``unsplit.value_and_grad(microbatches=k)`` vs ``optax.MultiSteps``.

Both sides run the same global step of the test transformer (a weighted token
loss with dropout) over the same global batch, followed by the same Adam
update:

* **optax.MultiSteps** (the usual recipe): a jitted train step over ONE
  microbatch -- ``jax.value_and_grad`` of the microbatch's mean token loss,
  the model applied to the whole microbatch with one dropout key per call
  (``fold_in(seed, call)``, flax's usual ``rngs={"dropout": key}``) -- and
  ``optax.MultiSteps(optax.adam(lr), every_k_schedule=k)``. One global step is
  ``k`` such calls.
* **unsplit**: one jitted call over the whole global batch of
  ``unsplit.value_and_grad(loss, weighted=True, microbatches=k)`` (per-example
  vmap, microbatch ``lax.scan``) and ``optax.adam(lr)``.

It measures the step time ratio (``common.compare``: median over alternating
repeats, with min and max) and XLA's compiled temp memory of each program
(``compiled.memory_analysis()``), relative to one microbatch's plain
``jax.value_and_grad``. The two sides do not compute the same thing
(MultiSteps averages microbatch means, which is wrong for token-weighted
losses, and ties nothing to example ids); this is only about cost.

Run: ``python benchmarks/accumulation_bench.py`` (``--quick`` for a smoke run
that does not touch the docs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import common
import jax
import jax.numpy as jnp
import optax
from rich.console import Console

import unsplit
from unsplit.models import (
    Transformer,
    TransformerConfig,
    init_params,
    synthetic_batch,
    token_loss,
)

MARKER = "accumulation"
DOC = "benchmarks.md"
LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class Setup:
    config: TransformerConfig
    global_batch: int
    microbatches: int
    repeats: int
    inner: int
    warmup: int


FULL = Setup(
    config=TransformerConfig(vocab=256, length=64, width=128, heads=4, layers=2),
    global_batch=64,
    microbatches=8,
    repeats=41,
    inner=1,
    warmup=1,
)
QUICK = Setup(
    config=TransformerConfig(),
    global_batch=16,
    microbatches=8,
    repeats=3,
    inner=1,
    warmup=1,
)


def batch_mean_loss(model: Transformer):
    """The usual flax batch loss: the model on the whole (micro)batch, one dropout key."""

    def loss_fn(params, batch, key):
        logits = model.apply({"params": params}, batch["inputs"], rngs={"dropout": key})
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        mask = batch["mask"]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    return loss_fn


def multisteps_train_step(model: Transformer, k: int):
    """optax.MultiSteps recipe: a jitted step over ONE microbatch; ``k`` calls per update."""
    tx = optax.MultiSteps(optax.adam(LEARNING_RATE), every_k_schedule=k)
    loss_fn = batch_mean_loss(model)

    def train_step(params, opt_state, microbatch, seed_key, call):
        key = jax.random.fold_in(seed_key, call)  # one key per call
        loss, grads = jax.value_and_grad(loss_fn)(params, microbatch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, train_step


def unsplit_train_step(model: Transformer, k: int):
    """unsplit: one call over the global batch, ``k`` microbatches inside, then Adam."""
    tx = optax.adam(LEARNING_RATE)
    step = unsplit.value_and_grad(token_loss(model), weighted=True, microbatches=k)

    def train_step(params, opt_state, batch, seed_key, step_index):
        key = jax.random.fold_in(seed_key, step_index)
        loss, grads = step(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, train_step


def unsplit_eager_train_step(model: Transformer, k: int):
    """The same, with the ``Step`` called directly (its own jit) and a jitted Adam update."""
    tx = optax.adam(LEARNING_RATE)
    step = unsplit.value_and_grad(token_loss(model), weighted=True, microbatches=k)

    @jax.jit
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def train_step(params, opt_state, batch, seed_key, step_index):
        loss, grads = step(params, batch, jax.random.fold_in(seed_key, step_index))
        return *update(params, opt_state, grads), loss

    return train_step


class Runner:
    """A zero-argument callable that runs one global step and carries the state along."""

    def __init__(self, fn, params, opt_state, batches: list[Any], seed_key):
        self.fn, self.batches, self.seed_key = fn, batches, seed_key
        self.state = (params, opt_state)
        self.calls = 0

    def __call__(self):
        params, opt_state = self.state
        loss = None
        for batch in self.batches:
            params, opt_state, loss = self.fn(params, opt_state, batch, self.seed_key, self.calls)
            self.calls += 1
        self.state = (params, opt_state)
        return params, loss


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclasses.dataclass(frozen=True)
class Report:
    time_rows: list[list[str]]
    mem_rows: list[list[str]]
    model_text: str
    mem_note: str
    microbatches: int


def run(setup: Setup) -> Report:  # one function: every column of a row, timed side by side
    model = Transformer(setup.config)
    params = init_params(model)
    k, big = setup.microbatches, setup.global_batch
    micro = big // k
    batch = synthetic_batch(setup.config, big, seed=1)
    microbatches = [
        jax.tree.map(lambda x, i=i: x[i * micro : (i + 1) * micro], batch) for i in range(k)
    ]
    seed_key = jax.random.key(0)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    ms_tx, ms_step = multisteps_train_step(model, k)
    us_tx, us_step_k = unsplit_train_step(model, k)
    _, us_step_1 = unsplit_train_step(model, 1)
    ms_jit, us_jit_k, us_jit_1 = jax.jit(ms_step), jax.jit(us_step_k), jax.jit(us_step_1)
    ms_state, us_state = ms_tx.init(params), us_tx.init(params)

    # Compiled temp memory of each program (what XLA allocates beyond inputs and outputs).
    plain = jax.value_and_grad(batch_mean_loss(model))
    mem = {
        f"jax.value_and_grad, one microbatch ({micro} examples), no optimizer: reference": (
            common.compiled_temp_bytes(plain, params, microbatches[0], seed_key)
        ),
        f"optax.MultiSteps train step (one microbatch of {micro}; run {k}x per update)": (
            common.compiled_temp_bytes(ms_step, params, ms_state, microbatches[0], seed_key, 0)
        ),
        f"unsplit train step, microbatches={k} (whole global batch of {big})": (
            common.compiled_temp_bytes(us_step_k, params, us_state, batch, seed_key, 0)
        ),
        f"unsplit train step, microbatches=1 (whole global batch of {big})": (
            common.compiled_temp_bytes(us_step_1, params, us_state, batch, seed_key, 0)
        ),
    }
    ref = next(iter(mem.values()))
    mem_rows = [[name, mib(b), common.times_cell(common.ratio(b, ref))] for name, b in mem.items()]

    ms_name = f"optax.MultiSteps: {k} jitted calls of {micro} examples"
    candidates = {
        ms_name: Runner(ms_jit, params, ms_state, microbatches, seed_key),
        f"unsplit microbatches={k}: one jitted call of {big}": Runner(
            us_jit_k, params, us_state, [batch], seed_key
        ),
        f"unsplit microbatches=1: one jitted call of {big}": Runner(
            us_jit_1, params, us_state, [batch], seed_key
        ),
        f"unsplit microbatches={k}, `Step` called outside jit, jitted Adam": Runner(
            unsplit_eager_train_step(model, k), params, us_state, [batch], seed_key
        ),
    }
    results = common.compare(
        candidates,
        baseline=ms_name,
        repeats=setup.repeats,
        inner=setup.inner,
        warmup=setup.warmup,
    )
    for name, runner in candidates.items():
        params_out, loss = runner()
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((params_out, loss)))
        if not finite:
            raise RuntimeError(f"{name}: non-finite loss or params after {runner.calls} calls")
    time_rows = [[r.name, common.ratio_cell(r), f"{r.median_s * 1e3:.0f} ms"] for r in results]
    c = setup.config
    model_text = (
        f"Model: the test transformer (`TransformerConfig(vocab={c.vocab}, length={c.length}, "
        f"width={c.width}, heads={c.heads}, layers={c.layers})`, {n_params:,} parameters, "
        f"dropout {c.dropout}, attention dropout {c.attention_dropout}), weighted token loss "
        f"on ragged sequences, global batch {big} = {k} microbatches of {micro}, Adam "
        f"(lr {LEARNING_RATE}) on both sides. Timing: {setup.repeats} alternating rounds, "
        f"each the mean of {setup.inner} global steps."
    )
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    mem_note = (
        f"unsplit's scan carries the float32 gradient sum ({mib(grad_bytes)} here), which XLA "
        f"counts as temp; MultiSteps keeps its accumulator in the optimizer state (an input "
        f"and output of its program, so not temp)"
    )
    return Report(time_rows, mem_rows, model_text, mem_note, k)


def render(report: Report) -> str:
    time_table = common.markdown_table(
        ["global step", "time vs MultiSteps: median (min-max)", "median time (noise)"],
        report.time_rows,
    )
    mem_table = common.markdown_table(
        ["compiled program", "XLA temp memory", "vs one microbatch"], report.mem_rows
    )
    k, model_text, mem_note = report.microbatches, report.model_text, report.mem_note
    return (
        f"### Gradient accumulation: unsplit vs optax.MultiSteps\n\n"
        f"{model_text}\n\n"
        f"**Step time of one global step** (ratio to `optax.MultiSteps` within each round; "
        f"below 1 is faster; absolute times are for scale only):\n\n{time_table}\n\n"
        f"**Compiled temp memory** (`compiled.memory_analysis().temp_size_in_bytes`; "
        f"MultiSteps runs its per-microbatch program {k} times per update, so that "
        f"program bounds its memory; unsplit's program is the whole global step; {mem_note}):\n\n"
        f"{mem_table}\n"
    )


def print_tables(report: Report) -> None:
    console = Console(width=150)
    console.print(report.model_text)
    console.print(report.mem_note)
    for title, header, rows in (
        (
            "step time vs optax.MultiSteps",
            ["global step", "ratio (min-max)", "median"],
            report.time_rows,
        ),
        ("compiled temp memory", ["program", "temp", "vs one microbatch"], report.mem_rows),
    ):
        common.print_table(title, header, rows, width=150)


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(__doc__)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    report = run(setup)
    print_tables(report)
    write = common.should_write(args)
    if write:
        print(f"wrote {common.write_table(DOC, MARKER, render(report))}")


if __name__ == "__main__":
    main()
