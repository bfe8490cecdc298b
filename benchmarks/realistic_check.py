"""One accelerator at a realistic size: a GPT-2-small-scale bitwise step, its cost and profile.

Part of ``device_check.py`` (``--parts realistic``); the model is built with the
public API: ``unsplit.models.Transformer(TransformerConfig(layers=12,
width=768, heads=12, length=512, vocab=50304))`` (124M params, GPT-2 small's
shape), global batch 32 (at least 8 per device). It reports, on every device
the check finds (one data axis):

* **time, first call and memory** of each step against the **user's own jitted
  step** (``jax.jit(jax.value_and_grad(...))`` of the batch's weighted token loss,
  each example's dropout from ``unsplit.example_keys``: the same work): default
  mode, bitwise at the default chunk size (8), at the largest chunk that fits
  (``unsplit.chunk_size_for(..., step=...)``) and at one chunk per device (the
  whole share); median of alternating rounds; the first call (trace and compile)
  apart, as a ratio to the user's; memory per device: a jitted program's compiled
  memory (arguments + outputs + temp), bitwise mode's peak
  (``unsplit.testing.bitwise_cost``). **Each row fails alone**: a step refused
  by the memory check, out of memory or not compiling is reported as failed,
  with the reason, and the others are measured;
* **where a bitwise step's time goes**: a ``jax.profiler`` trace of a few bitwise
  steps (at the default chunk size), summarized from the trace file
  (``plugins/profile/*/*.trace.json.gz``): the events with the most time, and the
  time per trace line (on GPU: the XLA modules, the XLA ops, the streams).

``tiny=True`` (``--tiny``, and always on CPU) runs a small model on one device
to check the script end to end; the real size runs only on a GPU or TPU.
"""

from __future__ import annotations

import collections
import gzip
import json
import math
import pathlib
import tempfile
from collections.abc import Callable

REAL = dict(vocab=50304, length=512, width=768, heads=12, layers=12)
TINY = dict(vocab=256, length=32, width=64, heads=4, layers=2)
TRACE_STEPS = 3


def realistic(
    lines: list[str],
    *,
    tiny: bool,
    trace_dir: pathlib.Path | None = None,
    time_left: Callable[[], float] = lambda: math.inf,
) -> None:
    """Appends the part's tables to ``lines``; skips what ``time_left()`` seconds cannot hold."""
    import common
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import unsplit
    from unsplit.models import (
        Transformer,
        TransformerConfig,
        init_params,
        on_mesh,
        synthetic_batch,
        token_loss,
    )

    tiny = tiny or jax.default_backend() == "cpu"
    sizes = TINY if tiny else REAL
    config = TransformerConfig(**sizes)
    model = Transformer(config)
    n = 1 if tiny else jax.device_count()
    size = 16 if tiny else max(32, 8 * n)
    host = jax.tree.map(np.asarray, init_params(model))
    key = jax.random.key(0)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = on_mesh(host, mesh)
    batch = jax.device_put(
        jax.tree.map(np.asarray, synthetic_batch(config, size, seed=1)),
        NamedSharding(mesh, P("data")),
    )
    loss = token_loss(model)
    count = sum(np.size(x) for x in jax.tree.leaves(host))
    default_chunk = min(8, size & -size)
    per_device = size // n

    def jitted(fn) -> common.Candidate:
        return common.Candidate(
            call=lambda: fn(params, batch, key),
            memory=lambda: common.compiled_bytes(fn.lower(params, batch, key).compile()),
        )

    def ours(chunk_size=None, bitwise=True) -> common.Candidate:
        step = unsplit.value_and_grad(
            loss, weighted=True, mesh=mesh, bitwise=bitwise, chunk_size=chunk_size
        )
        return common.Candidate(
            call=lambda: step(params, batch, key),
            memory=lambda: common.step_memory(step, params, batch, key),
        )

    def fitting() -> common.Candidate:
        probe = unsplit.value_and_grad(loss, weighted=True, mesh=mesh, bitwise=True)
        chunk = unsplit.chunk_size_for(size, n, step=probe, params=params, batch=batch, key=key)
        fitted.append(chunk)
        return ours(chunk)

    fitted: list[int] = []
    rows = {
        common.PLAIN: lambda: jitted(common.plain_step(loss, size)),
        "default mode": lambda: ours(bitwise=False),
        f"bitwise, chunk {default_chunk} (default)": lambda: ours(),
        "bitwise, the largest chunk that fits (`chunk_size_for(..., step=...)`)": fitting,
    }
    if per_device != default_chunk:
        rows[f"bitwise, chunk {per_device} (one per device)"] = lambda: ours(per_device)
    lines += ["", f"### Realistic size: {'TINY smoke run, ' if tiny else ''}{config}", "",
              f"{count / 1e6:.1f}M params, global batch {size} on {n} x "
              f"{jax.devices()[0].device_kind}; token loss, dropout 0.1 and attention dropout "
              "0.1.", ""]  # fmt: skip
    mark = len(lines)  # each row's first call as it ends, until the table replaces them
    table = common.measure_rows(
        rows, baseline=common.PLAIN, repeats=3 if tiny else 7, time_left=time_left, row_s=90,
        progress=lines.append,
    )  # fmt: skip
    del lines[mark:]
    lines += table
    if fitted:
        lines += ["", f"`chunk_size_for(..., step=...)` picked chunk {fitted[0]} (of the "
                  f"divisors of {per_device}) with the memory check's margin."]  # fmt: skip
    if time_left() < 60:
        lines += ["", "Profile: skipped (time)."]
        return
    bitwise = unsplit.value_and_grad(loss, weighted=True, mesh=mesh, bitwise=True)
    lines += profile(
        lambda: bitwise(params, batch, key), f"a bitwise step (chunk {default_chunk})", trace_dir
    )


def profile(call: Callable[[], object], what: str, trace_dir: pathlib.Path | None = None):
    """Markdown lines: where ``call``'s time goes, from a ``jax.profiler`` trace of a few
    calls (its first call, the compile, comes before the trace)."""
    import common
    import jax

    trace_dir = trace_dir or pathlib.Path(tempfile.mkdtemp(prefix="unsplit_trace_"))
    try:
        common.block(call())
        with jax.profiler.trace(str(trace_dir)):
            for _ in range(TRACE_STEPS):
                common.block(call())
    except Exception as error:  # a profiler the machine lacks (CUPTI) is a finding, not a stop
        return ["", f"Profile of {what}: {common.failure(error)}"]
    return ["", f"**Where {what}'s time goes** (a `jax.profiler` trace of {TRACE_STEPS} calls "
            f"in `{trace_dir}`; times per call):", "",
            *trace_summary(trace_dir, TRACE_STEPS)]  # fmt: skip


def trace_summary(trace_dir: pathlib.Path, steps: int, top: int = 15) -> list[str]:
    """Markdown tables of a trace's busiest events and lines, from its ``.trace.json.gz``."""
    files = sorted(
        pathlib.Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime
    )
    if not files:
        return [f"(no .trace.json.gz under {trace_dir})"]
    with gzip.open(files[-1]) as f:
        events = json.load(f).get("traceEvents", [])
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    by_event, calls, by_line = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        # "$..." events are Python frames (the host's calls into JAX), not the work.
        if e.get("ph") != "X" or str(e.get("name", "")).startswith("$"):
            continue
        process = processes.get(e.get("pid"), e.get("pid"))
        line = f"{process} / {threads.get((e.get('pid'), e.get('tid')), e.get('tid'))}"
        # An op split over a CPU's threads counts once per thread: summed by process.
        by_event[(process, e["name"])] += e.get("dur", 0)
        calls[(process, e["name"])] += 1
        by_line[line] += e.get("dur", 0)
    out = ["| process | event | time per step (all its threads) | calls per step |",
           "|---|---|---|---|"]  # fmt: skip
    for (process, name), us in by_event.most_common(top):
        out.append(
            f"| {_cell(process)} | {_cell(name)} | {us / steps / 1e3:.2f} ms | "
            f"{calls[(process, name)] / steps:.3g} |"
        )
    out += ["", "| trace line | time per step (events nest: a line's total counts both) |",
            "|---|---|"]  # fmt: skip
    out += [
        f"| {_cell(line)} | {us / steps / 1e3:.2f} ms |" for line, us in by_line.most_common(10)
    ]
    return out


def _cell(text: str, width: int = 80) -> str:
    text = str(text).replace("|", "/").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."
