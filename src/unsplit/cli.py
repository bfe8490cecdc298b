"""The ``unsplit`` command line (``unsplit ...`` or ``python -m unsplit ...``).

A thin layer: it parses options, sets up JAX's environment (8 simulated CPU
devices) before JAX starts its backend, and hands over to
:mod:`unsplit.demo.run`. Nothing here imports jax at the top level; XLA_FLAGS
is read when the first device is created, not when jax is imported.
"""

from __future__ import annotations

import argparse
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
  replay  record a bitwise step, or replay a recorded one on another layout and
          compare its bits leaf by leaf (`unsplit replay --help`)

Library: import unsplit; step = unsplit.value_and_grad(loss_fn, ...). See README.md.
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
    _add_replay_parser(sub)
    return parser


def _add_demo_parser(sub, with_options: bool) -> None:
    demo = sub.add_parser(
        "demo",
        help="train one model under many schedules and compare (see `unsplit demo --help`)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if not with_options:
        return
    from unsplit.demo import options as demo_options

    demo.description, demo.epilog = demo_options.DESCRIPTION, demo_options.EPILOG
    demo_options.add_options(demo)


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


_REPLAY_HELP = """\
Record a bitwise step on one layout, or replay it on another and compare the bits.

MODULE:FACTORY names a function (in a module or a .py file) that takes a mesh
(None without --mesh) and returns dict(step=..., params=..., batch=..., key=...),
optionally with ids=, frozen= and step_number= (the step N of a run whose key
is fold_in(key, N)): the step built with unsplit.value_and_grad(..., mesh=mesh,
bitwise=...) and the recorded step's inputs (e.g. restored from its checkpoint).
The record holds a SHA-256 digest of every input and output leaf. Replaying
compares the inputs first (other params are another step), then loss and grads;
exit status 0 when every leaf is bit-identical, 1 when one differs (the first is
named), 2 when the factory cannot be run. A model-parallel step replays on one
host with its mesh axes kept at size 1 (--mesh data=1,model=1: the params keep
naming their model axes). Runs on 8 simulated CPU devices unless XLA_FLAGS sets
another count. Guide:
https://unsplit.readthedocs.io/en/latest/bitwise/#replaying-a-step-on-another-layout

examples:
  unsplit replay train.py:make_step --mesh data=4,model=2 --save step100.json
  unsplit replay train.py:make_step --mesh data=1,model=1 --against step100.json
"""


def _add_replay_parser(sub) -> None:
    replay = sub.add_parser(
        "replay",
        help="record a bitwise step or replay it on another layout (`unsplit replay --help`)",
        description=_REPLAY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument("target", metavar="MODULE:FACTORY", help="the factory (see above)")
    replay.add_argument("--mesh", metavar="AXIS=SIZE,...", help="e.g. data=4,model=2")
    what = replay.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", metavar="FILE", help="record the step's digests to FILE")
    what.add_argument("--against", metavar="FILE", help="replay and compare with FILE")


def _replay(args: argparse.Namespace) -> int:
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""))
    from unsplit._src.audit import report as audit_report
    from unsplit._src.front import replay

    try:
        factory = audit_report.load_factory(args.target)
        text, match = replay.run_factory(factory, args.mesh, save=args.save, against=args.against)
    except (audit_report.FactoryError, ValueError, OSError) as e:
        print(f"unsplit replay: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if match else 1


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
    if args.command == "replay":
        return _replay(args)
    return 0


def _version() -> str:
    from unsplit import __version__

    return __version__


def _command(argv: list[str]) -> str | None:
    """The command word of ``argv`` (its first argument that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


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


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from unsplit.demo import options as demo_options

    try:
        config = demo_options.config_from_args(args)
        config.check()
    except (TypeError, ValueError) as e:
        parser.error(f"demo: {e}")
    demo_options.check_outputs(parser, args)
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
