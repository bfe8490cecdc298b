"""Bitwise mode vs default mode: step-time ratio, side by side, and where the time goes.

Three tables, every figure a ratio measured side by side in one run
(``common.compare``: alternating rounds, median with min and max):

* **ratio**: ``unsplit.value_and_grad(..., bitwise=True, chunk_size=c)`` over
  the default mode (``bitwise=False``) with the same schedule, for the
  schedules 1 device x 1 microbatch, 1 device x 4 microbatches and 4 devices x
  1 (a ``jax.make_mesh`` over 4 of the 8 simulated CPU devices, which share the
  same cores), and chunk sizes 4, 8 (the default for this batch) and 16. Goal:
  <= 1.15x. Each bitwise cell is also checked to be bit-identical to the
  1 x 1 bitwise result with the same chunk size (the guarantee being timed).
* **breakdown**: one bitwise step (1 device, the default chunk size) cut into
  its phases, each run alone through the module's internals with one sync at
  its end: slicing the batch into chunks, the chunk programs, the
  binary-counter adds, the final gather-and-add program; the rest of the
  step's time is Python, threads and syncs. Beside them, the default mode
  with ``microbatches = number of chunks`` (the same unit of work as a chunk,
  but one program and a ``lax.scan``) separates the cost of small units of
  work from the cost of running them as separate programs. A tiny model
  (same layers, width 32, length 16) gives the fixed per-step overhead in
  milliseconds, where compute is negligible. Each row also counts the
  process's minor page faults per call (``getrusage``).
* **malloc**: bitwise vs default vs default with chunk-sized microbatches,
  as shipped and in a child process started with glibc's mmap disabled
  (``TUNED_MALLOC``): XLA:CPU allocates each execution's temp buffer anew, and
  glibc maps blocks above 32 MiB fresh each time, so every chunk program
  faults its temp memory in again. That is the CPU cost of separate programs.

Model size: the test transformer at width 256, 2 layers, length 64, global
batch 64 (4,096 tokens a step, ~0.5 s a step on 2 cores), so one chunk of 8 is
already 512 tokens of dense matmuls: compute dominates (the breakdown shows
the chunk programs are nearly all of the step). Batch 64 lets chunk 16 divide
every schedule's share (4 devices x 16, 4 microbatches x 16).

Run: ``python benchmarks/bitwise_bench.py`` (``--quick`` for a smoke run that
does not touch the docs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import subprocess
import sys

import common
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import unsplit
from unsplit._src import bitwise, reduce, testing
from unsplit.models import (
    Transformer,
    TransformerConfig,
    init_params,
    synthetic_batch,
    token_loss,
)

MARKER = "bitwise"
DOC = "benchmarks.md"
# glibc told never to hand big blocks to mmap (and never to trim the heap): process-wide.
TUNED_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**32)}


@dataclasses.dataclass(frozen=True)
class Setup:
    config: TransformerConfig
    batch: int
    schedules: tuple[tuple[int, int], ...]  # (devices, microbatches)
    chunks: tuple[int, ...]
    repeats: int
    inner: int
    warmup: int


FULL = Setup(
    config=TransformerConfig(vocab=256, length=64, width=256, heads=4, layers=2),
    batch=64,
    schedules=((1, 1), (1, 4), (4, 1)),
    chunks=(4, 8, 16),
    repeats=6,
    inner=1,
    warmup=1,
)
QUICK = Setup(
    config=TransformerConfig(vocab=32, length=16, width=32, heads=2, layers=1),
    batch=8,
    schedules=((1, 1), (2, 1)),
    chunks=(4, 8),
    repeats=2,
    inner=1,
    warmup=1,
)


def tiny(config: TransformerConfig) -> TransformerConfig:
    """The same layers at negligible compute: for the fixed per-step overhead."""
    return dataclasses.replace(config, width=32, length=16, heads=2, vocab=32)


def schedule_name(devices: int, microbatches: int) -> str:
    return f"{devices} device{'s' if devices > 1 else ''} x {microbatches} microbatch" + (
        "es" if microbatches > 1 else ""
    )


class Problem:
    """Model, params, batch and key, placed for one schedule as a data loader would."""

    def __init__(self, config: TransformerConfig, batch: int):
        self.model = Transformer(config)
        self.loss_fn = token_loss(self.model)  # one object: chunk programs compile once
        self.params = init_params(self.model)
        self.batch = jax.device_put(synthetic_batch(config, batch, seed=1))
        self.key = jax.random.key(0)
        self.size = batch

    def placed(self, devices: int):
        if devices == 1:
            return None, (self.params, self.batch, self.key)
        mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
        params = jax.device_put(self.params, NamedSharding(mesh, P()))
        batch = jax.device_put(self.batch, NamedSharding(mesh, P("data")))
        key = jax.device_put(self.key, NamedSharding(mesh, P()))
        return mesh, (params, batch, key)

    def step(self, mesh, microbatches: int, chunk: int | None):
        """``(loss, grads)`` step; ``chunk=None`` is the default mode."""
        return unsplit.value_and_grad(
            self.loss_fn,
            weighted=True,
            microbatches=microbatches,
            mesh=mesh,
            bitwise=chunk is not None,
            chunk_size=chunk,
        )


# ----------------------------------------------------------------------------- ratio table


def ratio_table(setup: Setup, problem: Problem):
    """Per schedule, one ``compare``: default mode vs bitwise mode at each chunk size."""
    reference: dict[int, object] = {}  # chunk -> the 1x1 bitwise result
    results: dict[tuple[int, int], dict[str, common.Result]] = {}
    identical: dict[tuple[int, int, int], bool] = {}
    for devices, microbatches in setup.schedules:
        mesh, args = problem.placed(devices)
        share = setup.batch // (devices * microbatches)
        default = problem.step(mesh, microbatches, None)
        candidates = {"default": lambda s=default, a=args: s(*a)}
        for c in setup.chunks:
            if share % c:
                continue  # not a whole number of chunks per microbatch
            s = problem.step(mesh, microbatches, c)
            out = common.block(s(*args))  # compiles (per device) and checks the bits
            host = jax.tree.map(np.asarray, out)
            reference.setdefault(c, host)
            identical[devices, microbatches, c] = testing.bits_equal(host, reference[c])
            candidates[f"bitwise c={c}"] = lambda s=s, a=args: s(*a)
        results[devices, microbatches] = {
            r.name: r
            for r in common.compare(
                candidates,
                baseline="default",
                repeats=setup.repeats,
                inner=setup.inner,
                warmup=setup.warmup,
            )
        }
    rows = []
    for (devices, microbatches), by_name in results.items():
        share = setup.batch // (devices * microbatches)
        row = [schedule_name(devices, microbatches), f"{by_name['default'].median_s * 1e3:.0f} ms"]
        for c in setup.chunks:
            r = by_name.get(f"bitwise c={c}")
            if r is None:
                row.append(f"n/a ({share} per microbatch)")
            else:
                ok = identical[devices, microbatches, c]
                row.append(common.ratio_cell(r) + ("" if ok else " NOT BIT-IDENTICAL"))
        rows.append(row)
    header = ["schedule (devices x microbatches)", "default step (scale only)"] + [
        f"bitwise / default, chunk {c}" + (" (default)" if c == default_chunk(setup) else "")
        for c in setup.chunks
    ]
    return header, rows, results, all(identical.values())


def default_chunk(setup: Setup) -> int:
    return bitwise.default_chunk_size(setup.batch)


# ------------------------------------------------------------------------- breakdown table


def phases(problem: Problem, chunk: int) -> dict:
    """Each phase of a 1-device bitwise step as a zero-argument callable, run alone.

    Mirrors ``BitwiseStep.__call__`` through the module's internals; every
    phase gets the outputs of the previous one precomputed.
    """
    step = problem.step(None, 1, chunk)
    impl = step._impl
    params, batch, key = problem.params, problem.batch, problem.key
    n = problem.size // chunk
    devices = bitwise._batch_devices(None)
    local = [(0, devices[0])]
    hi, lo = bitwise._id_words(None, problem.size, None)

    def slicing():
        shares = bitwise._local_shares((batch, hi, lo), None, devices, local, n)
        leaves, treedef = jax.tree.flatten(shares[0])
        parts = [bitwise._unstack(x, n) for x in leaves]
        return [jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(n)]

    chunks = common.block(slicing())

    def chunk_programs():
        return [impl.chunk_program(params, b, key, h, lo_) for b, h, lo_ in chunks]

    outs = common.block(chunk_programs())

    def adds():
        acc = reduce.Accumulator(bitwise._add)
        for i, out in enumerate(outs):
            acc.push(i, out)
        return acc.blocks

    blocks = common.block(adds())

    def finish():
        return impl._finish(params, {0: blocks}, devices, n, n)

    # The phases recompose the step's bits: the breakdown times the real thing.
    whole = jax.tree.map(np.asarray, step(params, batch, key))
    parts = jax.tree.map(np.asarray, finish()[:2])
    assert testing.bits_equal(whole, parts), "phases do not recompose the bitwise step"
    return {
        "step": lambda: step(params, batch, key),
        "slice": slicing,
        "chunks": chunk_programs,
        "adds": adds,
        "finish": finish,
    }


def breakdown_table(setup: Setup, problem: Problem, small: Problem):
    chunk = default_chunk(setup)
    n = setup.batch // chunk
    args = (problem.params, problem.batch, problem.key)
    default = problem.step(None, 1, None)
    scanned = problem.step(None, n, None)
    p = phases(problem, chunk)
    candidates = {
        "default": lambda: default(*args),
        "default-scan": lambda: scanned(*args),
        "bitwise": p["step"],
        "slice": p["slice"],
        "chunks": p["chunks"],
        "adds": p["adds"],
        "finish": p["finish"],
    }
    r = {
        x.name: x
        for x in common.compare(
            candidates,
            baseline="default",
            repeats=setup.repeats + 2,
            inner=setup.inner,
            warmup=setup.warmup,
        )
    }
    # Fixed overhead: the same step on a tiny model, where compute is negligible.
    s_args = (small.params, small.batch, small.key)
    s_default, s_bitwise = small.step(None, 1, None), small.step(None, 1, chunk)
    o = {
        x.name: x
        for x in common.compare(
            {"default": lambda: s_default(*s_args), "bitwise": lambda: s_bitwise(*s_args)},
            baseline="default",
            repeats=setup.repeats + 4,
            inner=5,
            warmup=2,
        )
    }
    faults = {name: minor_faults(fn) for name, fn in candidates.items()}
    temp = chunk_temp_bytes(problem, chunk)
    total = r["bitwise"].median_s
    rest = total - sum(r[k].median_s for k in PARTS)

    def share(seconds: float) -> str:
        return f"{100 * seconds / total:.1f}%"

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ms"

    def row(label: str, name: str, part: bool = True) -> list[str]:
        return [
            label,
            common.ratio_cell(r[name]),
            share(r[name].median_s) if part else "-",
            f"{faults[name]:,.0f}",
            ms(r[name].median_s),
        ]

    rows = [
        row("default mode, one program over the batch (baseline)", "default", part=False),
        row(
            f"default mode, microbatches={n}: units of {chunk} examples, one program (`lax.scan`)",
            "default-scan",
            part=False,
        ),
        row("**bitwise step, whole**", "bitwise"),
        row(f"&nbsp;&nbsp;{n} chunk programs (dispatch + compute)", "chunks"),
        row("&nbsp;&nbsp;slicing the batch into chunks (`_local_shares`, `_unstack`)", "slice"),
        row(f"&nbsp;&nbsp;{n - 1} binary-counter adds (`reduce.Accumulator`)", "adds"),
        row("&nbsp;&nbsp;final gather + canonical adds + normalize (`_finish`)", "finish"),
        ["&nbsp;&nbsp;rest: Python, syncs, noise (whole - parts)", "-", share(rest), "-", ms(rest)],
    ]
    return {
        "chunk": chunk,
        "n": n,
        "rows": rows,
        "r": r,
        "rest": rest,
        "tiny": o,
        "faults": faults,
        "temp": temp,
    }


def minor_faults(fn, calls: int = 3) -> float:
    """Minor page faults of this process per call of ``fn`` (fresh pages touched)."""
    common.block(fn())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        common.block(fn())
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def chunk_temp_bytes(problem: Problem, chunk: int) -> int:
    """XLA's compiled temp memory of one chunk program."""
    program = bitwise._chunk_program(problem.loss_fn, True)
    one = jax.tree.map(lambda x: x[:chunk], problem.batch)
    words = np.zeros(chunk, np.uint32)
    compiled = program.lower(problem.params, one, problem.key, words, words).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def unit_comparison(setup: Setup) -> dict:
    """Bitwise vs default vs default with chunk-sized microbatches, and their page faults."""
    problem = Problem(setup.config, setup.batch)
    chunk = default_chunk(setup)
    n = setup.batch // chunk
    args = (problem.params, problem.batch, problem.key)
    steps = {
        "default": problem.step(None, 1, None),
        "default-scan": problem.step(None, n, None),
        "bitwise": problem.step(None, 1, chunk),
    }
    candidates = {name: (lambda s=s: s(*args)) for name, s in steps.items()}
    r = {
        x.name: x
        for x in common.compare(
            candidates,
            baseline="default",
            repeats=setup.repeats + 2,
            inner=setup.inner,
            warmup=setup.warmup,
        )
    }
    return {
        "ratio": {name: r[name].ratio_median for name in r},
        "median_s": {name: r[name].median_s for name in r},
        "faults": {name: minor_faults(fn) for name, fn in candidates.items()},
    }


def tuned_malloc_run(quick: bool) -> dict | None:
    """:func:`unit_comparison` in a child process started with :data:`TUNED_MALLOC`."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child-malloc"]
    cmd += ["--quick"] if quick else []
    env = {**os.environ, **TUNED_MALLOC}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        print(done.stdout, done.stderr, file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


PARTS = ("slice", "chunks", "adds", "finish")
BREAKDOWN_HEADER = [
    "what runs (1 device, batch {batch}, chunk {chunk})",
    "time / default step: median (min-max)",
    "share of the bitwise step",
    "minor page faults per call",
    "median time (scale only)",
]


# ---------------------------------------------------------------------------------- output


def run(setup: Setup, quick: bool = False):
    problem = Problem(setup.config, setup.batch)
    same = tiny(setup.config) == setup.config
    small = problem if same else Problem(tiny(setup.config), setup.batch)
    header, rows, results, identical = ratio_table(setup, problem)
    b = breakdown_table(setup, problem, small)
    c, t = setup.config, tiny(setup.config)
    chunk, n, r, o = b["chunk"], b["n"], b["r"], b["tiny"]
    n_params = sum(x.size for x in jax.tree.leaves(problem.params))
    model = (
        f"Model: the test transformer (`TransformerConfig(vocab={c.vocab}, length={c.length}, "
        f"width={c.width}, heads={c.heads}, layers={c.layers})`, {n_params:,} parameters, "
        f"dropout 0.1, attention dropout 0.1), `unsplit.value_and_grad(token_loss, "
        f"weighted=True, ...)` on ragged sequences, global batch {setup.batch} "
        f"({setup.batch * c.length:,} tokens a step), no optimizer, inputs already on the "
        f"devices. Timing: {setup.repeats} alternating rounds per schedule, each the mean of "
        f"{setup.inner} step(s); the breakdown {setup.repeats + 2} rounds. The machine was "
        "shared with other jobs while measuring: trust the medians, not single rounds."
    )
    at_default = [
        by[f"bitwise c={chunk}"].ratio_median
        for by in results.values()
        if f"bitwise c={chunk}" in by
    ]
    every = [x.ratio_median for by in results.values() for k, x in by.items() if k != "default"]
    verdict = (
        f"**Goal <= 1.15x:** at the default chunk size ({chunk}) the median ratio is "
        f"{min(at_default):.2f}x-{max(at_default):.2f}x over the schedules "
        f"({'met' if max(at_default) <= 1.15 else 'not met'} everywhere); over every "
        f"schedule and chunk size, {min(every):.2f}x-{max(every):.2f}x."
    )
    ratio_text = (
        "Each cell is the bitwise step's time over the default-mode step's with the same "
        "schedule, measured side by side. The chunk size fixes the bits, so a column is one "
        f"chunk size for every schedule; the default for batch {setup.batch} is {chunk} "
        "(`min(8, largest power of two dividing B)`). Every bitwise cell was checked "
        "bit-identical to the 1 x 1 bitwise result of its column"
        + (" (all were)." if identical else " (SOME WERE NOT).")
        + " *n/a*: a microbatch would not hold a whole number of chunks. In bitwise mode "
        "`microbatches` changes nothing but that check (every device runs its share chunk by "
        "chunk), so its one-device rows run the same work whatever `microbatches`, while the "
        "default mode's microbatches are a `lax.scan`. Rows with several devices run on "
        f"simulated CPU devices sharing the same {os.cpu_count()} cores (one dispatching "
        "thread per device for bitwise, one SPMD program for default): they show what "
        f"per-device dispatch and the final gather cost, not a speed-up.\n\n{verdict}"
    )
    scan, chunks = r["default-scan"].median_s, r["chunks"].median_s
    small_parts = sum(r[k].median_s for k in ("slice", "adds", "finish"))
    total = r["bitwise"].median_s
    fixed = (o["bitwise"].median_s - o["default"].median_s) / r["default"].median_s
    faults = b["faults"]
    tuned = tuned_malloc_run(quick)
    env = " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items())
    if faults["bitwise"] > 2 * faults["default-scan"]:
        why = (
            " The page-fault column says why: XLA:CPU allocates each execution's temp buffer "
            f"anew ({b['temp'] / 2**20:.0f} MiB for one chunk program here) and glibc serves "
            "blocks above its mmap threshold (at most 32 MiB) with fresh pages from `mmap`, "
            f"unmapped again on free, so each of the {n} chunk programs faults its temp memory "
            f"in again: {faults['bitwise']:,.0f} minor faults per bitwise step against "
            f"{faults['default-scan']:,.0f} for the scan, which allocates once for all its "
            "microbatches."
        )
        if tuned is not None:
            t_ratio = tuned["median_s"]["bitwise"] / tuned["median_s"]["default-scan"]
            why += (
                f" Rerun in a process started with `{env}` (glibc never unmaps, so pages are "
                f"reused; process-wide, and the process keeps its peak heap), bitwise mode "
                f"costs {t_ratio:.2f}x the same-unit default (table below)."
            )
    else:
        why = (
            f" Page faults do not explain it here ({faults['bitwise']:,.0f} per bitwise step, "
            f"{faults['default-scan']:,.0f} for the scan)."
        )
    where = (
        f"**Where the time goes** (1 device, chunk {chunk}, {n} chunks). The {n} chunk "
        f"programs are {100 * chunks / total:.0f}% of the bitwise step; slicing, the {n - 1} "
        f"binary-counter adds and the final gather-and-add program together "
        f"{100 * small_parts / total:.1f}%; the remainder ({100 * b['rest'] / total:.0f}%) is "
        "Python, syncs and measurement noise. So the bitwise step costs what its chunk "
        f"programs cost: {n} programs of {chunk} examples instead of one program of "
        f"{setup.batch}. "
        + unit_effect(r["default-scan"].ratio_median, n, chunk, setup.batch)
        + f" Against the default mode with the same unit of work (microbatches={n}) bitwise "
        f"mode costs {total / scan:.2f}x (ratio of medians): the price of separate one-device "
        "programs." + why + " The fixed cost per step, measured on the same layers at width "
        f"{t.width}, length {t.length} (compute negligible): "
        f"{o['default'].median_s * 1e3:.1f} ms default vs {o['bitwise'].median_s * 1e3:.1f} "
        f"ms bitwise ({n} chunk programs, {n - 1} adds, the final program); the difference is "
        f"{100 * fixed:.1f}% of the default step at the size above"
        + (", so Python dispatch matters only at tiny sizes." if fixed < 0.05 else ".")
        + " Not measured here: accelerators (XLA's GPU and TPU allocators pool memory, so the "
        "page faults are a CPU cost, but a chunk of a few examples may leave an accelerator "
        "under-used). Pass the largest `chunk_size` that divides every schedule's microbatch "
        "(the bits depend on the chunk size, so use the same one for every schedule you "
        "compare)."
    )
    b_header = [BREAKDOWN_HEADER[0].format(batch=setup.batch, chunk=chunk), *BREAKDOWN_HEADER[1:]]
    m_header = [
        "glibc malloc",
        "minor page faults per bitwise step",
        f"per default step, microbatches={n}",
        f"default microbatches={n} / default",
        "bitwise / default",
        f"bitwise / default microbatches={n} (ratio of medians)",
    ]
    m_rows = [
        [
            "as shipped (the tables above)",
            f"{faults['bitwise']:,.0f}",
            f"{faults['default-scan']:,.0f}",
            f"{r['default-scan'].ratio_median:.2f}x",
            f"{r['bitwise'].ratio_median:.2f}x",
            f"{total / scan:.2f}x",
        ]
    ]
    if tuned is None:
        m_rows.append([f"`{env}`", "run failed", "", "", "", ""])
    else:
        m_rows.append(
            [
                f"`{env}` (own process)",
                f"{tuned['faults']['bitwise']:,.0f}",
                f"{tuned['faults']['default-scan']:,.0f}",
                f"{tuned['ratio']['default-scan']:.2f}x",
                f"{tuned['ratio']['bitwise']:.2f}x",
                f"{tuned['median_s']['bitwise'] / tuned['median_s']['default-scan']:.2f}x",
            ]
        )
    m_text = (
        f"The same three steps (1 device, batch {setup.batch}) timed side by side, "
        f"{setup.repeats + 2} rounds, as shipped and in a child process whose glibc never "
        "returns big blocks to the OS. This is a process-wide allocator setting for CPU "
        "runs (it also changes the default mode's cost), not something the library sets."
    )
    return {
        "model": model,
        "ratio": (header, rows, ratio_text),
        "breakdown": (b_header, b["rows"], where),
        "malloc": (m_header, m_rows, m_text),
    }


def unit_effect(scan_ratio: float, n: int, chunk: int, batch: int) -> str:
    """What the default mode's own scan over chunk-sized microbatches says about unit size."""
    measured = (
        f"the default mode's own scan over {n} microbatches of {chunk} is {scan_ratio:.2f}x "
        "its one-program step"
    )
    if scan_ratio < 0.95:
        return (
            f"On this CPU small units are *faster*: {measured} (the activations of a whole "
            f"batch of {batch} do not stay in cache), which is why bitwise mode can beat the "
            "one-program default step."
        )
    if scan_ratio > 1.05:
        return f"Small units are slower here: {measured}."
    return f"Small units cost about the same here: {measured}."


def render(out) -> str:
    header, rows, ratio_text = out["ratio"]
    b_header, b_rows, where = out["breakdown"]
    m_header, m_rows, m_text = out["malloc"]
    return (
        "### Bitwise mode: step time over default mode\n\n"
        f"{out['model']}\n\n{ratio_text}\n\n{common.markdown_table(header, rows)}\n\n"
        "**Breakdown of one bitwise step.** Each phase is run alone through the module's "
        "internals (its inputs precomputed, one sync at its end; recomposed, they give the "
        "step's exact bits), timed side by side with the whole step and the default mode.\n\n"
        f"{common.markdown_table(b_header, b_rows)}\n\n{where}\n\n"
        f"**Page faults and glibc malloc.** {m_text}\n\n{common.markdown_table(m_header, m_rows)}\n"
    )


def print_tables(out) -> None:
    console = Console(width=160)
    console.print(out["model"])
    titles = (
        ("ratio", "bitwise / default step time"),
        ("breakdown", "bitwise step"),
        ("malloc", "page faults and glibc malloc"),
    )
    for key, title in titles:
        header, rows, text = out[key]
        table = Table(title=title)
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*(cell.replace("&nbsp;", " ") for cell in row))
        console.print(table)
        console.print(text)


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--child-malloc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    if args.child_malloc:  # the tuned-malloc measurement, in its own process
        print(json.dumps(unit_comparison(setup)))
        return
    out = run(setup, quick=args.quick)
    print_tables(out)
    write = common.should_write(args)
    if write:
        print(f"wrote {common.write_table(DOC, MARKER, render(out))}")


if __name__ == "__main__":
    main()
