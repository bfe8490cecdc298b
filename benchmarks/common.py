"""Shared benchmark helpers: side-by-side ratios and tables written into the docs.

Absolute times on shared machines are noise; ratios measured side by side in
one run are not. ``compare`` runs every candidate in alternating order
(A B C, B C A, ...) for ``repeats`` rounds and reports, per candidate, the
median time and the median/min/max of its ratio to the baseline *within each
round*. ``write_table`` replaces the block between two markers in a docs file,
so the docs always quote the script's latest run.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import dataclasses
import datetime
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    median_s: float
    ratio_median: float
    ratio_min: float
    ratio_max: float
    # The median per-round ratio of process CPU time (all threads) to the baseline's: on a
    # machine shared with other jobs wall time also counts waiting for a core.
    cpu_ratio_median: float = float("nan")


def block(x):
    """Waits for every array in ``x``."""
    return jax.block_until_ready(x)


def time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    block(fn())
    return time.perf_counter() - start


def compare(
    candidates: dict[str, Callable[[], object]],
    *,
    baseline: str,
    repeats: int = 7,
    inner: int = 3,
    warmup: int = 2,
) -> list[Result]:
    """Times each zero-argument callable side by side; ratios are to ``baseline``.

    Each measurement is the mean of ``inner`` back-to-back calls; each round
    measures every candidate once, in a rotated order, so slow drifts of the
    machine hit all candidates alike.
    """
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            time_once(candidates[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn = candidates[name]
            start = time.process_time()
            times[name].append(sum(time_once(fn) for _ in range(inner)) / inner)
            cpu[name].append(time.process_time() - start)
    results = []
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times[baseline], strict=True)]
        cpu_ratios = [t / b for t, b in zip(cpu[name], cpu[baseline], strict=True)]
        results.append(
            Result(
                name=name,
                median_s=statistics.median(times[name]),
                ratio_median=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                cpu_ratio_median=statistics.median(cpu_ratios),
            )
        )
    return results


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
    return (
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()} "
        f"({os.cpu_count()} cores), jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} devices."
    )


def write_table(doc: str, marker: str, body: str) -> pathlib.Path:
    """Replaces the text between ``<!-- marker:start -->`` and ``<!-- marker:end -->``.

    The markers are added at the end of the file the first time.
    """
    path = DOCS / doc
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.exists() else ""
    block_text = f"{start}\n{body.strip()}\n\n{environment_line()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block_text + tail
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
