"""The parts of ``device_check.py`` that measure in the check's own process (one part each).

Each function appends markdown to ``lines``; every row is measured on its own and a
row that raises is reported as failed with the reason (``common.failure``), the
others measured. ``time_left()`` is the seconds the part may still take.

* :func:`grid`: bitwise bits over device counts and microbatches, and 3 AdamW steps
  through ``unsplit.train_step`` with FSDP params, on the devices found;
* :func:`timing`: the user's own jitted step (``jax.jit(jax.value_and_grad(...))``,
  the same per-example keys: the same work) against default mode and bitwise mode
  (the default chunk, one chunk per device, the largest that fits) on the small test
  transformer (batch 64) and a 4-layer width-256 one (batch 32): time, first call and
  memory (the GPT-2-small size is ``realistic_check.py``);
* :func:`precision`: how far default mode's grads at 2 and 8 microbatches are from
  1 microbatch's (relative L2), and bitwise's and the user's jitted step's from default
  mode's, at the backend's default matmul precision and under
  ``jax.default_matmul_precision("highest")`` around the call;
* :func:`coupled`: a contrastive step (``batch_loss``): bitwise bits across
  microbatches, default mode's time against the plain jitted loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import common
import jax
import numpy as np

import unsplit
from unsplit.models import (
    Transformer,
    TransformerConfig,
    fsdp_specs,
    init_params,
    on_mesh,
    synthetic_batch,
    token_loss,
)

TimeLeft = Callable[[], float]
SMALL = TransformerConfig(vocab=96, length=64, width=128, heads=4, layers=2)
MID = TransformerConfig(vocab=96, length=64, width=256, heads=4, layers=4)


def device_counts(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8) if d <= n]


def attempt(lines: list[str], row: Callable[[], str], label: str) -> None:
    """``lines.append(row())``; a row that raises is reported as ``| label | failed: ... |``."""
    try:
        lines.append(row())
    except Exception as error:  # one row's failure is a finding: report it, go on
        lines.append(f"| {label} | {common.failure(error)} |")


def problem(config: TransformerConfig, size: int):
    model = Transformer(config)
    host = jax.tree.map(np.asarray, init_params(model))
    batch = jax.tree.map(np.asarray, synthetic_batch(config, size, seed=1))
    return model, host, batch


def grid(lines: list[str], time_left: TimeLeft = lambda: math.inf) -> None:
    import optax

    model, host, batch = problem(SMALL, 64)
    key = jax.random.key(0)
    loss = token_loss(model)
    counts = device_counts(jax.device_count())
    first: list = []
    lines += ["", "### Bitwise grid (test transformer, batch 64, chunk 8)", "",
              "| devices | microbatches | loss and grads bit-identical to the first row |",
              "|---|---|---|"]  # fmt: skip

    def grid_row(n: int, microbatches: int) -> str:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        step = unsplit.value_and_grad(
            loss, weighted=True, mesh=mesh, microbatches=microbatches, bitwise=True
        )
        out = jax.device_get(step(on_mesh(host, mesh), batch, key))
        if not first:
            first.append(out)
        return f"| {n} | {microbatches} | {unsplit.testing.bits_equal(out, first[0])} |"

    for n in counts:
        for microbatches in (1, 2, 4, 8):
            if time_left() < 30:
                lines.append(f"| {n} | {microbatches} | skipped (time) |")
                continue
            attempt(lines, lambda n=n, k=microbatches: grid_row(n, k), f"{n} | {microbatches}")
    lines += ["", "### 3 AdamW steps through `unsplit.train_step`, FSDP params (params and "
              "optimizer state vs the first row)", "",
              "| devices | microbatches | bit-identical |", "|---|---|---|"]  # fmt: skip
    trained: list = []

    def train_row(n: int, microbatches: int) -> str:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        params = on_mesh(host, mesh, fsdp_specs(host, "data", n))
        optimizer = optax.adamw(1e-3)
        with jax.set_mesh(mesh):
            opt_state = optimizer.init(params)
        step = unsplit.value_and_grad(
            loss, weighted=True, mesh=mesh, bitwise=True, microbatches=microbatches
        )
        train = unsplit.train_step(step, optimizer)
        for i in range(3):
            _, params, opt_state = train(params, opt_state, batch, jax.random.fold_in(key, i))
        out = jax.device_get((params, opt_state))
        if not trained:
            trained.append(out)
        return f"| {n} | {microbatches} | {unsplit.testing.bits_equal(out, trained[0])} |"

    for n in counts:
        for microbatches in (1, 4):
            if time_left() < 30:
                lines.append(f"| {n} | {microbatches} | skipped (time) |")
                continue
            attempt(lines, lambda n=n, k=microbatches: train_row(n, k), f"{n} | {microbatches}")


def timing(lines: list[str], time_left: TimeLeft = lambda: math.inf) -> None:
    for title, config, size in (
        ("the small test transformer", SMALL, 64),
        ("a 4-layer width-256 transformer", MID, 32),
    ):
        if time_left() < 45:
            lines += ["", f"{title}: skipped (time)"]
            continue
        timing_table(lines, title, config, size, time_left, traced=config is SMALL)


def timing_table(
    lines: list[str],
    title: str,
    config: TransformerConfig,
    size: int,
    time_left: TimeLeft,
    traced: bool = False,
) -> None:
    """One model's rows against the user's jitted step, every device on one data axis."""
    n = max(device_counts(jax.device_count()))
    model, host, data = problem(config, size)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = on_mesh(host, mesh)
    batch = on_mesh(data, mesh, jax.tree.map(lambda _: jax.P("data"), data))
    key = jax.random.key(0)
    loss = token_loss(model)
    count = sum(np.size(x) for x in jax.tree.leaves(host))

    def ours(chunk_size=None, bitwise=True):
        step = unsplit.value_and_grad(
            loss, weighted=True, mesh=mesh, bitwise=bitwise, chunk_size=chunk_size
        )
        return common.Candidate(
            call=lambda: step(params, batch, key),
            memory=lambda: common.step_memory(step, params, batch, key),
        )

    def plain():
        fn = common.plain_step(loss, size)
        return common.Candidate(
            call=lambda: fn(params, batch, key),
            memory=lambda: common.compiled_bytes(fn.lower(params, batch, key).compile()),
        )

    def fitting():
        probe = unsplit.value_and_grad(loss, weighted=True, mesh=mesh, bitwise=True)
        chunk = unsplit.chunk_size_for(size, n, step=probe, params=params, batch=batch, key=key)
        return ours(chunk)

    rows = {
        common.PLAIN: plain,
        "default mode": lambda: ours(bitwise=False),
        "bitwise, chunk 8 (default)": ours,
        f"bitwise, chunk {size // n} (one per device)": lambda: ours(size // n),
        "bitwise, the largest chunk that fits (`chunk_size_for`)": fitting,
    }
    lines += ["", f"### Step time: {title}, batch {size} on {n} device(s)", "",
              f"`TransformerConfig(vocab={config.vocab}, length={config.length}, width="
              f"{config.width}, heads={config.heads}, layers={config.layers})`, "
              f"{count / 1e6:.2f}M params, token loss, dropout 0.1.", ""]  # fmt: skip
    mark = len(lines)  # each row's first call as it ends, until the table replaces them
    table = common.measure_rows(
        rows, baseline=common.PLAIN, repeats=15, time_left=time_left, row_s=15,
        progress=lines.append,
    )  # fmt: skip
    del lines[mark:]
    lines += table
    if traced and time_left() > 40:  # launches per step: the small model is launch-bound
        import realistic_check

        bitwise = unsplit.value_and_grad(loss, weighted=True, mesh=mesh, bitwise=True)
        lines += realistic_check.profile(
            lambda: bitwise(params, batch, key), "a bitwise step (chunk 8)"
        )


def precision(lines: list[str], time_left: TimeLeft = lambda: math.inf) -> None:
    model, params, batch = problem(SMALL, 64)
    key = jax.random.key(0)
    loss = token_loss(model)
    plain = common.plain_step(loss, 64)
    lines += ["", "### Precision: grads' relative L2 distance (test transformer, batch 64)", "",
              "| compared | backend's default precision | "
              "`jax.default_matmul_precision(\"highest\")` around the call |",
              "|---|---|---|"]  # fmt: skip
    compared = {
        "default mode, 2 microbatches vs 1": (dict(microbatches=2), dict()),
        "default mode, 8 microbatches vs 1": (dict(microbatches=8), dict()),
        "bitwise vs default mode (1 microbatch)": (dict(bitwise=True), dict()),
        "the user's jitted step vs default mode": (None, dict()),
    }

    references = {}  # (setting, reference options): its grads, computed once

    def distance(options, reference, setting) -> float:
        with jax.default_matmul_precision(setting):
            if (setting, str(reference)) not in references:
                step = unsplit.value_and_grad(loss, weighted=True, **reference)
                references[setting, str(reference)] = step(params, batch, key)
            want = references[setting, str(reference)]
            if options is None:
                got = plain(params, batch, key)
            else:
                got = unsplit.value_and_grad(loss, weighted=True, **options)(params, batch, key)
        return unsplit.testing.rel_l2(got[1], want[1])

    for label, (options, reference) in compared.items():
        if time_left() < 20:
            lines.append(f"| {label} | skipped (time) | |")
            continue
        attempt(
            lines,
            lambda o=options, r=reference, label=label: (
                f"| {label} | {distance(o, r, None):.2g} | {distance(o, r, 'highest'):.2g} |"
            ),
            label,
        )


def coupled(lines: list[str], time_left: TimeLeft = lambda: math.inf) -> None:
    """A contrastive step (``batch_loss``): bits across microbatches, time vs plain jit."""
    import coupled_bench as cb

    params, data = cb.problem(256, 512, tokens=16)
    key = jax.random.key(3)
    lines += ["", "### Contrastive step (batch_loss), batch 256, 16-token towers", "",
              "| bitwise step | loss and grads bit-identical to 1 microbatch |",
              "|---|---|"]  # fmt: skip
    first: list = []

    def bits_row(k: int) -> str:
        step = unsplit.value_and_grad(
            cb.features_fn, batch_loss=cb.batch_loss_fn, microbatches=k, bitwise=True
        )
        out = jax.device_get(step(params, data, key))
        if not first:
            first.append(out)
        return f"| microbatches={k} | {unsplit.testing.bits_equal(out, first[0])} |"

    for k in (1, 2, 4):
        attempt(lines, lambda k=k: bits_row(k), f"microbatches={k}")
    if time_left() < 30:
        lines += ["", "Default mode's time: skipped (time)."]
        return
    plain = jax.jit(jax.value_and_grad(cb.plain_loss))

    def jitted():
        return common.Candidate(call=lambda: plain(params, data, key))

    def ours(k: int):
        step = unsplit.value_and_grad(cb.features_fn, batch_loss=cb.batch_loss_fn, microbatches=k)
        return common.Candidate(call=lambda: step(params, data, key))

    rows = {common.PLAIN: jitted, **{f"default mode, k={k}": lambda k=k: ours(k) for k in (1, 8)}}
    lines += ["", *common.measure_rows(rows, baseline=common.PLAIN, repeats=7)]
