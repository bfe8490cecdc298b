"""Shared benchmark helpers: side-by-side ratios and tables written into the docs.

Absolute times on shared machines are noise; ratios measured side by side in
one run are not. ``compare`` runs every candidate in alternating order
(A B C, B C A, ...) for ``repeats`` rounds and reports, per candidate, the
median time and the median/min/max of its ratio to the baseline *within each
round*. ``write_table`` replaces the block between two markers in a docs file,
so the docs always quote the script's latest run.

A ratio whose denominator is 0 is not a number: ``ratio`` gives ``nan`` and the
cells print it as ``n/a``. On an accelerator the host's CPU time of a call is
about 0 (the work runs on the device), and a program XLA fuses whole has no temp
memory: neither may stop a run.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import contextlib
import dataclasses
import datetime
import math
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import unsplit

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    median_s: float
    ratio_median: float
    ratio_min: float
    ratio_max: float
    # The median per-round ratio of process CPU time (all threads) to the baseline's: on a
    # machine shared with other jobs wall time also counts waiting for a core. On an
    # accelerator it is the host's share only (launches, transfers); nan where the baseline
    # took no measurable CPU time in any round.
    cpu_ratio_median: float = float("nan")


# unsplit's measuring switch (canonical_dots.BENCH_DEFAULT_LEVEL_ENV): bitwise CPU programs
# compiled while it is "1" are compiled as XLA fuses them (bits then not kept across model
# degrees).
CPU_DEFAULT_LEVEL_ENV = "UNSPLIT_BENCH_CPU_DEFAULT_LEVEL"


@contextlib.contextmanager
def cpu_default_level(on: bool = True):
    """Bitwise programs compiled inside (a step's first call) use XLA's default CPU level."""
    before = os.environ.get(CPU_DEFAULT_LEVEL_ENV)
    if on:
        os.environ[CPU_DEFAULT_LEVEL_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CPU_DEFAULT_LEVEL_ENV, None)
        else:
            os.environ[CPU_DEFAULT_LEVEL_ENV] = before


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; ``nan`` (a cell's ``n/a``) where the denominator is 0.

    >>> ratio(3.0, 2.0), ratio(1.0, 0.0)
    (1.5, nan)
    """
    return numerator / denominator if denominator else float("nan")


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-round ratios that are numbers (``nan`` if none is).

    >>> median_ratio([1.0, 2.0, 3.0], [1.0, 0.0, 1.0])
    2.0
    """
    ratios = [ratio(a, b) for a, b in zip(numerators, denominators, strict=True)]
    finite = [r for r in ratios if math.isfinite(r)]
    return statistics.median(finite) if finite else float("nan")


def times_cell(x: float, digits: int = 2) -> str:
    """A ratio as a cell: ``1.23x``, or ``n/a`` for ``nan``.

    >>> times_cell(1.234), times_cell(float("nan"))
    ('1.23x', 'n/a')
    """
    return f"{x:.{digits}f}x" if math.isfinite(x) else "n/a"


def block(x):
    """Waits for every array in ``x``."""
    return jax.block_until_ready(x)


def time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    block(fn())
    return time.perf_counter() - start


def failure(error: BaseException, width: int = 300) -> str:
    """A row that could not be measured, as its cell: ``failed: Type: message`` (one line).

    >>> failure(MemoryError("RESOURCE_EXHAUSTED: 15.25 GiB needed\\nmore"))
    'failed: MemoryError: RESOURCE_EXHAUSTED: 15.25 GiB needed'
    """
    lines = str(error).strip().splitlines()
    text = f"failed: {type(error).__name__}: {lines[0] if lines else ''}".strip()
    text = text.replace("|", "/")  # a markdown table's cell
    return text if len(text) <= width else text[: width - 3] + "..."


def compare(
    candidates: dict[str, Callable[[], object]],
    *,
    baseline: str,
    repeats: int = 7,
    inner: int = 3,
    warmup: int = 2,
    failed: dict[str, str] | None = None,
) -> list[Result]:
    """Times each zero-argument callable side by side; ratios are to ``baseline``.

    Each measurement is the mean of ``inner`` back-to-back calls; each round
    measures every candidate once, in a rotated order, so slow drifts of the
    machine hit all candidates alike.

    With ``failed`` (a dict), a candidate that raises is recorded there
    (``failure(error)``) and left out of the rounds that follow and of the
    results; the others are measured. Without it, the error propagates. Ratios
    to a baseline that failed are ``nan``.
    """
    names = list(candidates)
    alive = set(names)

    def timed(name: str, calls: int) -> tuple[float, float] | None:
        """(mean wall time, process CPU time) of ``calls`` calls; ``None``: it failed."""
        start = time.process_time()
        try:
            wall = sum(time_once(candidates[name]) for _ in range(calls)) / calls
        except Exception as error:
            if failed is None:
                raise
            failed[name] = failure(error)
            alive.discard(name)
            return None
        return wall, time.process_time() - start

    for _ in range(warmup):
        for name in names:
            if name in alive:
                timed(name, 1)
    times: dict[str, dict[int, float]] = {name: {} for name in names}
    cpu: dict[str, dict[int, float]] = {name: {} for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in alive and (measured := timed(name, inner)) is not None:
                times[name][r], cpu[name][r] = measured
    results = []
    for name in (n for n in names if n in alive):
        rounds = sorted(times[name])
        base_wall = [times[baseline].get(r, 0.0) for r in rounds]
        base_cpu = [cpu[baseline].get(r, 0.0) for r in rounds]
        ratios = [ratio(times[name][r], b) for r, b in zip(rounds, base_wall, strict=True)]
        finite = [x for x in ratios if math.isfinite(x)] or [float("nan")]
        results.append(
            Result(
                name=name,
                median_s=statistics.median(times[name].values()),
                ratio_median=statistics.median(finite),
                ratio_min=min(finite),
                ratio_max=max(finite),
                cpu_ratio_median=median_ratio([cpu[name][r] for r in rounds], base_cpu),
            )
        )
    return results


#: The baseline of the accelerator tables: what a user writes without unsplit.
PLAIN = "user's jitted step"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One row: a step's call (no arguments) and its memory per device in bytes (if read)."""

    call: Callable[[], object]
    memory: Callable[[], int] | None = None


def measure_rows(
    rows: dict[str, Callable[[], Candidate]],
    *,
    baseline: str,
    repeats: int,
    time_left: Callable[[], float] = lambda: math.inf,
    row_s: float = 0.0,
    progress: Callable[[str], None] = print,
) -> list[str]:
    """The rows' markdown table: each row built and called once (its first call, timed
    with the building: a step's trace and compile, ``chunk_size_for``'s probes), its
    memory read, then all timed side by side (:func:`compare`).

    A row that raises anywhere (built, first call, memory, timing) is reported failed with
    the reason and the others are measured; a row is skipped when ``time_left()`` is
    under ``row_s`` before it starts. Ratios are to ``baseline`` (``n/a`` if it failed).
    ``progress`` gets a line per row as its first call ends (what a run stopped before
    the table keeps).
    """
    built, first, memory, failed = {}, {}, {}, {}
    for name, build in rows.items():
        if time_left() < row_s:
            failed[name] = "skipped (time)"
            continue
        try:
            start = time.perf_counter()
            candidate = build()
            block(candidate.call())
            first[name] = time.perf_counter() - start
        except Exception as error:  # a row's failure is a finding: report it, go on
            failed[name] = failure(error)
            progress(f"- {name}: {failed[name]}")
            continue
        built[name] = candidate
        memory[name] = None
        try:
            memory[name] = candidate.memory() if candidate.memory else None
        except Exception as error:
            progress(f"- {name}: memory not read: {failure(error)}")
        shown = "" if memory[name] is None else f", {memory[name] / 2**20:.0f} MiB per device"
        progress(f"- {name}: first call {first[name]:.1f} s{shown}")
    results = {}
    if built:
        calls = {name: c.call for name, c in built.items()}
        for r in compare(
            calls, baseline=baseline, repeats=repeats, inner=1, warmup=1, failed=failed
        ):
            results[r.name] = r
    base_first = first.get(baseline, 0.0) if baseline in results else 0.0
    base_memory = memory.get(baseline) or 0
    lines = [f"| step | time / {baseline}: median (min-max) | median time | first call (trace "
             f"and compile) | first call / {baseline}'s | memory per device | memory / "
             f"{baseline}'s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in rows:
        if name in failed:
            lines.append(f"| {name} | {failed[name]} | | | | | |")
            continue
        r, mem = results[name], memory[name]
        mem_cells = ("n/a", "n/a") if mem is None else (
            f"{mem / 2**20:.0f} MiB", times_cell(ratio(mem, base_memory)))  # fmt: skip
        lines.append(
            f"| {name} | {ratio_cell(r)} | {r.median_s * 1e3:.1f} ms | "
            f"{first[name]:.1f} s | {times_cell(ratio(first[name], base_first))} | "
            f"{mem_cells[0]} | {mem_cells[1]} |"
        )
    return lines


def plain_step(loss, size: int):
    """The user's own step: ``jax.jit(jax.value_and_grad(...))`` of the batch's weighted
    loss, each example's key from ``unsplit.example_keys`` (the same work as unsplit's)."""

    def batched(params, batch, key):
        keys = unsplit.example_keys(key, jnp.arange(size))
        sums, weights = jax.vmap(loss, in_axes=(None, 0, 0))(params, batch, keys)
        return jnp.sum(sums) / jnp.sum(weights)

    return jax.jit(jax.value_and_grad(batched))


def compiled_temp_bytes(fn: Callable, *args) -> int:
    """XLA's compiled temp memory (``compiled.memory_analysis()``) for ``jit(fn)(*args)``."""
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes)


def compiled_bytes(compiled: Any) -> int:
    """A compiled program's memory per device: arguments + outputs + temp (XLA's analysis)."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def step_memory(step: Any, params: Any, batch: Any, key: jax.Array, *, frozen: Any = None) -> int:
    """An ``unsplit`` step's memory per device, in either mode: its lowered programs'
    (``compiled_bytes``); in bitwise mode the peak over all of them, each buffer once
    (``unsplit.testing.bitwise_cost`` has the breakdown)."""
    return compiled_bytes(step.lower(params, batch, key, frozen=frozen).compile())


def ratio_cell(r: Result) -> str:
    """``median (min-max)`` of a result's per-round time ratios, or ``n/a``."""
    if not math.isfinite(r.ratio_median):
        return "n/a"
    return f"{r.ratio_median:.2f}x ({r.ratio_min:.2f}-{r.ratio_max:.2f})"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, header: list[str], rows: list[list[str]], width: int | None = None):
    """The table on the terminal (rich), as the docs get it from :func:`markdown_table`."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in header:
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    Console(width=width).print(table)


def environment_line() -> str:
    device = jax.devices()[0]
    devices = (
        f"{jax.device_count()} devices"
        if device.platform == "cpu"
        else f"{jax.device_count()} x {device.device_kind}"
    )
    return (
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()} "
        f"({os.cpu_count()} cores), jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{devices}."
    )


def accelerator() -> str | None:
    """The platform of the devices measured on (``"gpu"``, ``"tpu"``), ``None`` on CPU."""
    platform_name = jax.devices()[0].platform
    return None if platform_name == "cpu" else platform_name


#: Where the tables measured on an accelerator go: the end of this section of the docs.
ACCELERATORS = "## Accelerators"


def write_table(doc: str, marker: str, body: str) -> pathlib.Path:
    """Replaces the text between ``<!-- marker:start -->`` and ``<!-- marker:end -->``.

    On an accelerator the marker is ``marker-<platform>`` (``dropout-layer-gpu``), so
    its tables stand beside the CPU ones instead of replacing them; the first time, it
    is added at the end of the doc's section :data:`ACCELERATORS` (if it has one).
    Other markers are added at the end of the file the first time.
    """
    platform_name = accelerator()
    if platform_name is not None:
        marker = f"{marker}-{platform_name}"
    path = DOCS / doc
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.exists() else ""
    block_text = f"{start}\n{body.strip()}\n\n{environment_line()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block_text + tail
    elif platform_name is not None and f"\n{ACCELERATORS}\n" in text:
        head, section = text.split(f"\n{ACCELERATORS}\n", 1)
        body_end = section.find("\n## ")
        body_end = len(section) if body_end < 0 else body_end
        section = section[:body_end].rstrip() + f"\n\n{block_text}\n" + section[body_end:]
        text = f"{head}\n{ACCELERATORS}\n{section}"
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block_text + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every benchmark script takes: ``--quick`` and ``--write/--no-write``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke run)")
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the tables into docs/benchmarks.md (default: yes, except with --quick)",
    )
    return parser


def should_write(args: argparse.Namespace) -> bool:
    """A full run writes the docs; a ``--quick`` smoke run only with ``--write``."""
    return (not args.quick) if args.write is None else args.write
