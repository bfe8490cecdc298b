"""The demo's output: a rich table, the JSON file and the PNG.

All three are made from the dict :func:`unsplit.demo.run.run` returns, so a
saved JSON can be re-plotted: ``demo_report.plot(json.load(f), "demo.png")``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from unsplit.demo import config as demo_config

BASELINE_NAME = "flax baseline"  # demo.BASELINE (this module does not import jax)
_KEYS = (
    "name",
    "devices",
    "processes",
    "microbatches",
    "bitwise",
    "final_loss",
    "max_abs_param_diff",
    "step_time_s",
)


def format_diff(x: float) -> str:
    """``0 (exact)`` for an exact zero, else 2 significant digits.

    Example:
        >>> from unsplit.demo.report import format_diff
        >>> format_diff(0.0), format_diff(3.14159e-6)
        ('0 (exact)', '3.1e-06')
    """
    return "0 (exact)" if x == 0.0 else f"{x:.1e}"


def table(result: dict[str, Any]) -> Table:
    """The comparison table: one section per mode, then the contrast rows."""
    ways = len(result["schedules"])
    t = Table(
        title=f"One seed, one dataset, one model: the same training run, scheduled {ways} ways"
    )
    t.add_column("schedule (processes x devices x microbatches)")
    t.add_column("final loss", justify="right")
    t.add_column("max |param diff|*", justify="right")
    t.add_column("bit-identical", justify="center")
    t.add_column("step time", justify="right")
    default = [r for r in result["schedules"] if not r["bitwise"]]
    bitwise = [r for r in result["schedules"] if r["bitwise"]]
    for title, group in (
        ("default mode, vs the reference", default),
        ("bitwise=True, vs the bitwise reference", bitwise),
    ):
        if not group:
            continue
        t.add_row(f"[bold]{title}[/]")
        for r in group:
            _add(t, r, r["name"].removesuffix(", bitwise"))
        t.add_section()
    t.add_row("[bold]the usual way (contrast), vs flax baseline[/]")
    for b in result["baselines"]:
        t.add_row(
            "flax baseline: flax dropout, 1 device",
            f"{b['final_loss']:.4f}",
            "[dim]—[/]",
            "[dim]—[/]",
            f"{1000 * b['step_time_s']:.0f} ms",
        )
    for r in result["contrast"]:
        dagger = " †" if r["compared_with"] != BASELINE_NAME else ""
        _add(t, r, r["name"] + dagger, contrast=True)
    return t


def _add(t: Table, r: dict[str, Any], label: str, contrast: bool = False) -> None:
    if r["name"] == r["compared_with"]:
        diff = ident = "[dim]—[/]"
    else:
        diff = format_diff(r["max_abs_param_diff"])
        if contrast:
            diff, ident = f"[bold red]{diff}[/]", "[red]no[/]"
        elif r["bit_identical"]:
            diff, ident = f"[bold green]{diff}[/]", "[bold green]yes[/]"
        else:
            ident = "[red]no[/]" if r.get("bitwise") else "[yellow]no[/]"
    t.add_row(label, f"{r['final_loss']:.4f}", diff, ident, f"{1000 * r['step_time_s']:.0f} ms")


def summary(result: dict[str, Any]) -> list[str]:
    """Short lines under the table: what the numbers show."""
    default = [
        r["max_abs_param_diff"]
        for r in result["schedules"]
        if not r["bitwise"] and r["name"] != r["compared_with"]
    ]
    bitwise = [
        r["max_abs_param_diff"]
        for r in result["schedules"]
        if r["bitwise"] and r["name"] != r["compared_with"]
    ]
    contrast = [r["max_abs_param_diff"] for r in result["contrast"]]
    lines = []
    if default:
        lines.append(
            f"default mode: every schedule trains the same function; after "
            f"{result['config']['steps']} Adam steps the parameters differ by at most "
            f"{max(default):.1e}: float rounding of different reduction orders."
        )
    if bitwise:
        ok = all(x == 0.0 for x in bitwise)
        lines.append(
            "bitwise mode: "
            + (
                "every schedule ends with bit-identical parameters."
                if ok
                else f"NOT bit-identical (max diff {max(bitwise):.1e}): please report this."
            )
        )
    if contrast and default:
        lines.append(
            f"the usual way: the schedule changes the computation itself; differences of "
            f"{min(contrast):.1e} to {max(contrast):.1e}, {min(contrast) / max(max(default), 1e-30):,.0f}x "
            "and more above default mode's rounding."
        )
    for r in result["schedules"]:
        if "resumed_from" in r:
            lines.append(
                f"elastic: SIGKILLed after step {r['killed_after']}, resumed from the checkpoint "
                f"of step {r['resumed_from']} on {r['processes']} processes x "
                f"{r['devices'] // r['processes']} devices: "
                + ("bit-identical to the uninterrupted run." if r["bit_identical"] else
                   f"NOT bit-identical (max diff {r['max_abs_param_diff']:.1e}).")
            )  # fmt: skip
    for s in result["skipped"]:
        lines.append(f"skipped: {s['name']} ({s['reason'].splitlines()[0][:200]})")
    return lines


def print_report(result: dict[str, Any], console: Console) -> None:
    console.print(table(result))
    inert = ", ".join(p.replace("']['", ".").strip("[']") for p in result["inert_params"])
    console.print(
        f"[dim]* over the parameters that can change the model's output; left out: {inert} "
        "(softmax ignores a key bias, so its gradient is 0 up to rounding, which Adam "
        "scales up in every run alike). bit-identical covers every parameter.[/]"
    )
    against = {r["compared_with"] for r in result["contrast"]} - {BASELINE_NAME}
    if against:
        console.print(
            f"[dim]† vs the {', '.join(sorted(against))}: the same per-example noise, only "
            "the loss weighting differs.[/]"
        )
    for line in summary(result):
        console.print(line)


def json_view(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: the issue's keys first in every row, then the details."""

    def order(row):
        return {**{k: row[k] for k in _KEYS if k in row}, **row}

    out = dict(result)
    out["schedules"] = [order(r) for r in result["schedules"]]
    out["contrast"] = [order(r) for r in result["contrast"]]
    return out


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(json_view(result), f, indent=1)
        f.write("\n")


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _label(row: dict[str, Any]) -> str:
    """A row's legend entry: its name, the elastic row's in short."""
    if "resumed_from" in row:
        return f"elastic: killed at {row['killed_after']}, resumed, bitwise"
    return row["name"]


def plot(result: dict[str, Any], path: str) -> None:
    """Writes the PNG: loss curves overlaid; parameter divergence on a log scale.

    Exact zeros cannot sit on a log axis, so they are drawn on a floor line
    labelled "0 (exact)", below every nonzero difference.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=110)
    rows = _styled_rows(result, plt)
    _plot_losses(left, result, rows)
    _plot_divergence(right, result, rows)
    cfg = result["config"]
    fig.suptitle(
        f"unsplit demo: {cfg['layers']}-layer transformer (width {cfg['width']}, dropout "
        f"{cfg['dropout']}), batch {cfg['batch_size']} x {cfg['length']} characters of "
        f"Python's standard library, {cfg['steps']} Adam steps, seed {cfg['seed']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _styled_rows(result: dict[str, Any], plt) -> list[tuple[dict, Any, str]]:
    """``(row, color, line style)``: default mode in blues, bitwise in greens, contrast dashed."""
    blues, greens = plt.get_cmap("Blues"), plt.get_cmap("Greens")
    reds = ["#d62728", "#ff7f0e", "#9467bd"]
    default = [r for r in result["schedules"] if not r["bitwise"]]
    bitwise = [r for r in result["schedules"] if r["bitwise"]]
    rows = [
        (r, blues(0.45 + 0.55 * i / max(1, len(default) - 1)), "-") for i, r in enumerate(default)
    ]
    rows += [
        (r, greens(0.45 + 0.55 * i / max(1, len(bitwise) - 1)), "-") for i, r in enumerate(bitwise)
    ]
    rows += [(r, reds[i % len(reds)], "--") for i, r in enumerate(result["contrast"])]
    return rows


def _plot_losses(ax, result: dict[str, Any], rows: list) -> None:
    window = max(1, result["config"]["steps"] // 20)
    for r, color, style in rows:
        x = range(1, len(r["losses"]) + 1)
        ax.plot(x, _smooth(r["losses"], window), style, color=color, lw=1.2, label=_label(r))
    for b in result["baselines"]:
        x = range(1, len(b["losses"]) + 1)
        ax.plot(x, _smooth(b["losses"], window), ":", color="gray", lw=1.2, label=b["name"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (nats per token, mean of {window} steps)")
    ax.set_title("Loss: every run looks the same here")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper right")


def _plot_divergence(ax, result: dict[str, Any], rows: list) -> None:
    nonzero = [d for r, _, _ in rows for _, d in r["divergence"] if d > 0.0]
    floor = 10 ** (math.floor(math.log10(min(nonzero))) - 2) if nonzero else 1e-9
    for r, color, style in rows:
        if r["name"] == r["compared_with"]:
            continue
        xs = [s for s, _ in r["divergence"]]
        ys = [d if d > 0.0 else floor for _, d in r["divergence"]]
        ax.plot(xs, ys, style, color=color, lw=1.4, marker=".", ms=4, label=_label(r))
    ax.axhline(floor, color="green", lw=0.8, ls=":")
    ax.set_yscale("log")
    top = max([*nonzero, floor * 10])
    ax.set_ylim(floor / 3, top * 5)
    ticks = [t for t in ax.get_yticks() if floor < t <= top * 5]
    ax.set_yticks([floor, *ticks], ["0 (exact)", *[f"1e{round(math.log10(t))}" for t in ticks]])
    steps = result["config"]["steps"]
    ax.text(steps * 0.02, floor * 1.6, "exactly 0: bit-identical to the reference",
            color="green", fontsize=8)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("max |parameter difference| vs its reference")
    ax.set_title("Divergence from the one-device reference (log scale)")
    ax.grid(alpha=0.3, which="major")
    # Between the contrast rows (top) and the default rows (about 1e-6): an empty band.
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(0.02, 0.56), ncol=2)


def header(config: demo_config.DemoConfig, processes: bool) -> str:
    """What is about to happen and how long it takes."""
    runs = (11 if processes else 8) + 4  # with processes: 2 two-process rows and the elastic row
    if config in (demo_config.DemoConfig(), demo_config.make("quick")):
        typical = "about 2 minutes on an idle 2-core CPU (most of it compiling), more on a busy one"
    elif config == demo_config.make("long"):
        typical = "about 8 minutes on an idle 2-core CPU"
    else:
        typical = "it depends on the settings"
    return (
        f"[bold]unsplit demo[/]: {runs} training runs of {config.steps} Adam steps each: a "
        f"{config.layers}-layer transformer (width {config.width}, dropout {config.dropout}) on "
        f"batches of {config.batch_size} x {config.length} characters of Python's own source, "
        f"seed {config.seed}.\nTypical time: {typical}; an estimate measured on this machine "
        "follows after the first steps."
    )


def run_and_report(
    config: demo_config.DemoConfig,
    *,
    json_path: str | None = None,
    plot_path: str | None = None,
    processes: bool = True,
    progress: bool = True,
    console: Console | None = None,
) -> int:
    """Runs the demo with a progress bar, prints the table, writes the files.

    Returns:
        The exit status: 0, or 1 when a bitwise row is not bit-identical.
    """
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from unsplit.demo import run as demo

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: wide enough for the table
            console = Console(width=110)
    console.print(header(config, processes))
    if progress:
        columns = (
            TextColumn("{task.description:<52}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console) as bar:
            result = demo.run(config, processes=processes, bar=bar, say=bar.console.print)
    else:
        result = demo.run(config, processes=processes, say=console.print)
    print_report(result, console)
    if json_path:
        write_json(result, json_path)
        console.print(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
        console.print(f"wrote {plot_path}")
    console.print(f"total time {result['elapsed_s']:.0f} s")
    broken = [r for r in result["schedules"] if r["bitwise"] and not r["bit_identical"]]
    return 1 if broken else 0
