"""The ``unsplit`` command line (``unsplit ...`` or ``python -m unsplit ...``).

A thin layer: it parses options, sets up JAX's environment (8 simulated CPU
devices) before JAX starts its backend, and hands over to
:mod:`unsplit.demo.run`. Nothing here imports jax at the top level; XLA_FLAGS
is read when the first device is created, not when jax is imported.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

_DESCRIPTION = """\
unsplit: schedule-invariant randomness and gradients for JAX.

A training step with dropout computes the same loss and gradients on 1 device,
on N devices or as k gradient-accumulation microbatches: up to float rounding
by default, bit for bit with bitwise=True.
"""

_EPILOG = """\
commands:
  demo    train a small transformer with dropout under 10 schedules, plus the
          usual-way contrast rows, and compare the results (`unsplit demo --help`)
  audit   trace a training step and report what makes it depend on its schedule
          (`unsplit audit --help`)

Library: import unsplit; step = unsplit.value_and_grad(loss_fn, ...). See README.md.
"""

_DEMO_DESCRIPTION = """\
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

_DEMO_EPILOG = """\
examples:
  unsplit demo --plot demo.png               the default run, with the picture
  unsplit demo --quick --json out.json       a short run, results as JSON
  unsplit demo --long --plot demo.png        the bigger model, 200 steps
  unsplit demo --steps 400 --width 128       longer, bigger
"""

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
_FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def build_parser(command: str | None = "demo") -> argparse.ArgumentParser:
    """The ``unsplit`` parser: one subparser per command (``demo``, ``audit``).

    The demo's options (and so the demo's settings module) are added only when
    ``command`` is ``"demo"``: other commands never import the demo.
    """
    parser = argparse.ArgumentParser(
        prog="unsplit",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"unsplit {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo_parser(sub, with_options=command == "demo")
    _add_audit_parser(sub)
    return parser


def _add_demo_parser(sub, with_options: bool) -> None:
    demo = sub.add_parser(
        "demo",
        help="train one model under many schedules and compare (see `unsplit demo --help`)",
        description=_DEMO_DESCRIPTION,
        epilog=_DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if not with_options:
        return
    _add_demo_training_options(demo.add_argument_group("training"))
    _add_demo_model_options(demo.add_argument_group("model and data"))
    _add_demo_output_options(demo.add_argument_group("output"))


def _preset_text(preset: dict) -> str:
    return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in preset.items())


def _add_demo_training_options(run: argparse._ArgumentGroup) -> None:
    from unsplit.demo import config as demo_config

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
    from unsplit.demo import config as demo_config

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


_AUDIT_DESCRIPTION = """\
Trace a training step (nothing runs) and report what makes it depend on its
schedule (devices, microbatches, padding), one panel per finding with the
source line. FACTORY is a function of no arguments in MODULE (a module name
importable from here, or a path/to/file.py) that returns either

  (fn, args)                    an ordinary batched step: unsplit.audit_step(fn, *args)
                                (for an unsplit.value_and_grad step: its per-example
                                loss, as the step calls it)
  (loss_fn, args, options)      a per-example loss: unsplit.audit(loss_fn, *args,
                                **options), e.g. options = {"weighted": True}

Kinds: foreign_key, cross_example, dropped_state, unsafe_key, padding_unstable,
device_key, batch_draw, mean_of_means (https://unsplit.readthedocs.io/en/latest/audit/). Tracing uses 8 simulated
CPU devices, as the demo does.
"""

_AUDIT_EPILOG = """\
exit status: 0 (findings are printed), 1 with --strict when anything is found,
2 when the factory cannot be loaded, called or audited.

examples:
  unsplit audit train.py:make_step
  unsplit audit unsplit.audit_corpus.batched:same_key_microbatches
  unsplit audit mypkg.train:make_loss --strict --json
  unsplit audit train.py:make_step --batch-args 1,2
"""


def _add_audit_parser(sub) -> None:
    audit = sub.add_parser(
        "audit",
        help="report what makes a training step depend on its schedule (`unsplit audit --help`)",
        description=_AUDIT_DESCRIPTION,
        epilog=_AUDIT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument("target", metavar="MODULE:FACTORY", help="the factory (see above)")
    audit.add_argument(
        "--strict", action="store_true", help="exit with status 1 if anything is found (for CI)"
    )
    audit.add_argument(
        "--json",
        action="store_true",
        help="print the findings as a JSON list of {kind, message, fix, file, line}",
    )
    audit.add_argument(
        "--batch-args",
        metavar="I,J",
        type=_argnums,
        default=None,
        help="for a (fn, args) step: which of fn's positional arguments hold the batch "
        "(0-based, e.g. 1,2; default: those whose arrays share one leading size); "
        "unsplit.audit_step's batch_argnums",
    )


def _argnums(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected argument positions separated by commas; got {text!r}. Fix: e.g. "
            "--batch-args 1,2 for fn(params, batch, labels, key)."
        ) from None


def _audit(args: argparse.Namespace) -> int:
    setup_jax_environment()
    from unsplit._src.audit import (
        report as audit_report,
    )  # imports jax's backend: after the setup above

    try:
        factory = audit_report.load_factory(args.target)
        findings = audit_report.audit_factory(factory, args.target, batch_argnums=args.batch_args)
    except audit_report.FactoryError as e:
        print(f"unsplit audit: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(audit_report.to_json(findings))
    else:
        audit_report.render(findings, args.target)
    return 1 if args.strict and findings else 0


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command(given))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        return _demo(parser, args)
    if args.command == "audit":
        return _audit(args)
    return 0


def _version() -> str:
    from unsplit import __version__

    return __version__


def _command(argv: list[str]) -> str | None:
    """The command word of ``argv`` (its first argument that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def config_from_args(args: argparse.Namespace):
    """The demo's settings from parsed options; ``--quick`` or ``--long`` fills what is not given."""
    from unsplit.demo import config as demo_config

    names = ("steps", "batch_size", "length", "width", "layers", "heads", "dropout")
    given = {k: getattr(args, k) for k in (*names, "learning_rate", "seed")}
    preset = "quick" if args.quick else "long" if getattr(args, "long", False) else "default"
    return demo_config.make(preset, **given)


def xla_flags(existing: str, fast_compile: bool = False) -> str:
    """``existing`` XLA flags plus 8 simulated devices (and, with ``fast_compile``, -O0).

    Flags already present win: a device count or optimization level the user
    set is kept.

    Example:
        >>> from unsplit.cli import xla_flags
        >>> xla_flags("--xla_dump_to=/tmp/x")
        '--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8'
    """
    flags = existing.split()
    if not any(f.startswith("--xla_force_host_platform_device_count") for f in flags):
        flags.append(_DEVICES_FLAG)
    if fast_compile and not any(f.startswith("--xla_backend_optimization_level") for f in flags):
        flags.append(_FAST_COMPILE_FLAG)
    return " ".join(flags)


def setup_jax_environment(fast_compile: bool = False) -> None:
    """8 simulated CPU devices: must run before JAX creates its first device.

    ``fast_compile`` (every preset but ``--long``) turns XLA's backend
    optimizations off: a program compiles several times faster, and runs about
    as fast at the demo's size. Every run of the demo (its processes too) uses the same
    flags, so the comparisons hold either way.
    """
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), fast_compile)
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported (by the unsplit package), but no backend yet
        import jax

        jax.config.update("jax_platforms", "cpu")


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


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        config.check()
    except (TypeError, ValueError) as e:
        parser.error(f"demo: {e}")
    if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
        parser.error(
            f"--json and --plot name the same file ({args.json}); the plot would overwrite "
            "the JSON. Fix: pass two paths, e.g. --json demo.json --plot demo.png."
        )
    _check_plot_format(parser, args.plot)
    _check_output(parser, "--json", args.json)
    _check_output(parser, "--plot", args.plot)
    setup_jax_environment(fast_compile=config.fast_compile)
    from unsplit.demo import report as demo_report  # starts jax's backend: after the setup above

    try:
        return demo_report.run_and_report(
            config,
            json_path=args.json,
            plot_path=args.plot,
            processes=not args.no_processes,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt:
        print("unsplit demo: interrupted (any worker processes were stopped).", file=sys.stderr)
        return 130
