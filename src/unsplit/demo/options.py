"""``unsplit demo``'s command-line options: what the CLI adds to its ``demo`` command.

Importable without jax; the CLI imports it only for ``unsplit demo``.
"""

from __future__ import annotations

import argparse
import math
import os

from unsplit.demo import config as demo_config

DESCRIPTION = """\
Train a small causal transformer with dropout on the characters of Python's own
standard library source (no download), from one seed, under these schedules of
the same global batch:

  reference (1 device), 8 devices, 1 device x 8 microbatches,
  2 devices x 4 microbatches, 2 processes x 2 devices x 2 microbatches
  (real local jax.distributed processes over gloo)

each in default and in bitwise mode, then the same model and data trained the
usual way, for contrast: one dropout key per device (flax's shard_prng_key), one
key reused for every microbatch (T5X), optax.MultiSteps' mean of microbatch means.

Prints a table (final loss, largest |parameter difference| against the
reference, bit-identical or not, time per step). Bitwise rows differ by exactly
0; default rows by float rounding; contrast rows by far more. The devices are
simulated on the CPU (XLA_FLAGS=--xla_force_host_platform_device_count=8), so
the demo runs on any machine. The default run (a one-layer model, 30 steps) takes
about 2 minutes on an idle 2-core CPU, most of it compiling; --long trains a bigger
model for 200 steps (about 8 minutes); --quick is the default for 16 steps. It
prints an estimate after the first steps, and a progress bar.
"""

EPILOG = """\
examples:
  unsplit demo --plot demo.png               the default run, with the picture
  unsplit demo --quick --json out.json       a short run, results as JSON
  unsplit demo --long --plot demo.png        the bigger model, 200 steps
  unsplit demo --steps 400 --width 128       longer, bigger
"""


def add_options(demo: argparse.ArgumentParser) -> None:
    """The demo's options, in three groups."""
    _add_demo_training_options(demo.add_argument_group("training"))
    _add_demo_model_options(demo.add_argument_group("model and data"))
    _add_demo_output_options(demo.add_argument_group("output"))


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (``parser.error``) output paths the run could not write, before it starts."""
    if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
        parser.error(
            f"--json and --plot name the same file ({args.json}); the plot would overwrite "
            "the JSON. Fix: pass two paths, e.g. --json demo.json --plot demo.png."
        )
    _check_plot_format(parser, args.plot)
    _check_output(parser, "--json", args.json)
    _check_output(parser, "--plot", args.plot)


def _preset_text(preset: dict) -> str:
    return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in preset.items())


def _add_demo_training_options(run: argparse._ArgumentGroup) -> None:
    d, quick, long = demo_config.DemoConfig(), demo_config.QUICK, demo_config.LONG
    run.add_argument(
        "--steps",
        type=_integer("steps", 2),
        help=f"Adam steps per schedule (default {d.steps}; quick {quick['steps']}; "
        f"long {long['steps']})",
    )
    size = run.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model and few steps, for a check of the installation: " + _preset_text(quick),
    )
    size.add_argument(
        "--long",
        action="store_true",
        help="the bigger model, trained longer, compiled with XLA's backend optimizations on "
        "(several minutes on 2 cores): " + _preset_text(long),
    )
    run.add_argument(
        "--seed",
        type=_integer("seed", 0, 2**63 - 1),
        help=f"the one seed of every run (default {d.seed})",
    )
    run.add_argument(
        "--learning-rate",
        type=_number("learning_rate", 0.0, None),
        help=f"Adam's learning rate (default {d.learning_rate})",
    )
    run.add_argument(
        "--no-processes",
        action="store_true",
        help="skip the 2-process rows (they start 2 local processes talking over 127.0.0.1)",
    )


def _add_demo_model_options(model: argparse._ArgumentGroup) -> None:
    d = demo_config.DemoConfig()
    model.add_argument(
        "--batch-size",
        type=_integer("batch_size", 8),
        help=f"global batch, a multiple of 8 (default {d.batch_size})",
    )
    model.add_argument(
        "--length", type=_integer("length", 4), help=f"characters per example (default {d.length})"
    )
    model.add_argument(
        "--width", type=_integer("width", 1), help=f"model width (default {d.width})"
    )
    model.add_argument(
        "--layers", type=_integer("layers", 1), help=f"transformer blocks (default {d.layers})"
    )
    model.add_argument(
        "--heads",
        type=_integer("heads", 1),
        help=f"attention heads, dividing width (default {d.heads})",
    )
    model.add_argument(
        "--dropout",
        type=_number("dropout", 0.0, 1.0),
        help=f"dropout rate, residual and attention (default {d.dropout})",
    )


def _add_demo_output_options(out: argparse._ArgumentGroup) -> None:
    out.add_argument("--json", metavar="PATH", help="write every row and curve as JSON to PATH")
    out.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG to PATH: loss curves, and divergence on a log scale",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")


def _integer(name: str, low: int, high: int | None = None):
    """An argparse type: an int in ``[low, high]``, refused argparse-style otherwise."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError reads "invalid int value: 'TEXT'"
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, 2**63 - 1]"
            raise argparse.ArgumentTypeError(f"{name} must be {bounds} (an integer); got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _number(name: str, low: float, high: float | None):
    """An argparse type: a finite float in ``(low, high)``; nan and inf are refused."""

    def parse(text: str) -> float:
        value = float(text)  # a ValueError reads "invalid float value: 'TEXT'"
        if high is None and not (math.isfinite(value) and value > low):
            raise argparse.ArgumentTypeError(f"{name} must be > {low:g} and finite; got {text}")
        if high is not None and not low < value < high:
            raise argparse.ArgumentTypeError(f"{name} must be in ({low:g}, {high:g}); got {text}")
        return value

    parse.__name__ = "float"
    return parse


def config_from_args(args: argparse.Namespace):
    """The demo's settings from parsed options; ``--quick`` or ``--long`` fills what is not given."""

    names = ("steps", "batch_size", "length", "width", "layers", "heads", "dropout")
    given = {k: getattr(args, k) for k in (*names, "learning_rate", "seed")}
    preset = "quick" if args.quick else "long" if getattr(args, "long", False) else "default"
    return demo_config.make(preset, **given)


def _check_output(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(
            f"{option} {path}: the folder {folder} does not exist. Fix: create it first, or "
            "write to an existing folder."
        )
    if os.path.isdir(path):
        parser.error(f"{option} {path} is a folder; expected a file path, e.g. {path}/demo.png.")
    existed = os.path.exists(path)
    try:  # the run takes minutes: find out now that the file cannot be written
        with open(path, "a"):
            pass
    except OSError as e:
        parser.error(
            f"{option} {path}: cannot write there ({e.strerror}). Fix: pass a path in a folder "
            "you can write to."
        )
    if not existed:
        os.remove(path)


def _check_plot_format(parser: argparse.ArgumentParser, path: str | None) -> None:
    extension = os.path.splitext(path or "")[1].lstrip(".").lower()
    if not extension:
        return  # matplotlib writes a PNG
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if extension not in formats:
        parser.error(
            f"--plot {path}: matplotlib cannot write '.{extension}' files; it writes "
            f"{', '.join(formats)}. Fix: e.g. --plot demo.png."
        )
