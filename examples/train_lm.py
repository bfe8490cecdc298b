"""Train a small language model elastically: kill it anywhere, resume it on another topology.

Run from the repository root with unsplit installed (``./dev test`` or
``pip install -e .`` makes the venv), for example::

    # 8 steps done on 1 process x 4 devices x 2 microbatches, a checkpoint every 4 steps...
    python examples/train_lm.py --steps 20 --devices 4 --microbatches 2 --bitwise \\
        --ckpt-dir /tmp/run --save-every 4
    # ...killed (Ctrl-C, SIGKILL, a preemption); resumed on 2 processes x 2 devices:
    python examples/train_lm.py --steps 20 --devices 2 --processes 2 --microbatches 1 \\
        --bitwise --ckpt-dir /tmp/run --save-every 4 --resume --params-out params.npz

The model and data are unsplit's demo: a causal transformer with dropout on
the characters of Python's standard library source (``unsplit.demo.data.Windows``
records). The data order comes from grain (``unsplit.data.global_steps``: the
records of global step ``s`` depend on ``(seed, epoch, s)`` only), every
example's noise from its record id, checkpoints from orbax
(``unsplit.checkpoint``). With ``--bitwise`` the resumed run ends with exactly
the parameters of an uninterrupted one; see docs/elastic.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

EPILOG = """\
what may change between a save and --resume: --devices, --processes, --microbatches.
what may not (checked on resume, with an error naming it): --seed, --global-batch,
--chunk-size, --bitwise, the model and optimizer flags, and in bitwise mode the JAX version.
A walkthrough with the real output: docs/elastic.md.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python examples/train_lm.py",
        description=__doc__.split("\n\n")[0] + "\n\n"
        "Every process reads only its own rows of each global step (grain's order);\n"
        "checkpoints (orbax) hold params, optimizer state, the step and the run's settings.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run = p.add_argument_group("run and schedule")
    run.add_argument(
        "--steps",
        type=int,
        required=True,
        metavar="N",
        help="the run's total number of global steps (a resumed run ends at N too)",
    )
    run.add_argument(
        "--devices",
        type=int,
        default=1,
        metavar="D",
        help="devices per process (simulated CPU devices on a CPU); default 1",
    )
    run.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="P",
        help="start P local processes (jax.distributed over gloo on 127.0.0.1) "
        "with D devices each; default 1",
    )
    run.add_argument(
        "--microbatches",
        type=int,
        default=1,
        metavar="K",
        help="gradient-accumulation microbatches per device; default 1",
    )
    run.add_argument(
        "--bitwise",
        action="store_true",
        help="bit-identical results for every schedule (unsplit's bitwise mode)",
    )
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--ckpt-dir", metavar="DIR", help="where checkpoints go (none if omitted)")
    ckpt.add_argument(
        "--save-every",
        type=int,
        default=100,
        metavar="S",
        help="save after every S-th global step and after the last; default 100",
    )
    ckpt.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in DIR (a fresh start if there is none)",
    )
    ckpt.add_argument(
        "--params-out",
        metavar="FILE.npz",
        help="write the final params, one array per parameter keyed by its tree "
        "path (jax.tree_util.keystr)",
    )
    model = p.add_argument_group("model, data and optimizer (fixed for a run)")
    model.add_argument(
        "--global-batch",
        type=int,
        default=16,
        metavar="B",
        help="examples per global step; default 16",
    )
    model.add_argument(
        "--seed",
        type=int,
        default=0,
        help="data order, initial params and every step's noise; default 0",
    )
    model.add_argument(
        "--chunk-size",
        type=int,
        metavar="C",
        help="bitwise mode's unit of work in examples; default 1, so the run can "
        "resume on any schedule. A larger C is faster, but then every schedule's "
        "share per microbatch, B / (D x P x K), must be a multiple of C",
    )
    model.add_argument("--length", type=int, default=32, help="characters per example; default 32")
    model.add_argument("--width", type=int, default=64, help="model width; default 64")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks; default 2")
    model.add_argument("--heads", type=int, default=4, help="attention heads; default 4")
    model.add_argument("--dropout", type=float, default=0.1, help="dropout rate; default 0.1")
    model.add_argument("--learning-rate", type=float, default=3e-3, help="Adam; default 3e-3")
    out = p.add_argument_group("output and testing")
    out.add_argument(
        "--no-progress", action="store_true", help="plain log lines instead of a progress bar"
    )
    out.add_argument(
        "--kill-after-step",
        type=int,
        metavar="N",
        help="simulate a preemption: once global step N is done (and any save in "
        "flight has finished), process 0 sends itself SIGKILL",
    )
    multi = p.add_argument_group("one process of a multi-process run (set by --processes)")
    multi.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    multi.add_argument("--coordinator", metavar="HOST:PORT", help=argparse.SUPPRESS)
    return p  # fmt: skip


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("steps", "devices", "processes", "microbatches", "save_every", "global_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}.")
    shares = args.devices * args.processes * args.microbatches
    if args.global_batch % shares:
        parser.error(
            f"--global-batch {args.global_batch} must split into devices x processes x "
            f"microbatches = {shares} equal shares. Fix: a multiple of {shares}."
        )
    if args.chunk_size is not None and not args.bitwise:
        parser.error("--chunk-size only applies with --bitwise. Fix: add --bitwise or drop it.")
    if args.resume and not args.ckpt_dir:
        parser.error("--resume needs --ckpt-dir DIR, the directory the run saved to.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    check(parser, args)
    if args.processes > 1 and args.process_id is None:
        return launch_local(args, argv)
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={args.devices}"]
    )
    if args.process_id is not None:
        watch_parent()
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.processes,
            process_id=args.process_id,
            initialization_timeout=120,
        )
    try:
        return train(args)
    except KeyboardInterrupt:
        print("train_lm.py: interrupted; continue with the same command and --resume.",
              file=sys.stderr)  # fmt: skip
        return 130
    except Exception as e:  # the settings check and friends: their message is the point
        from unsplit.checkpoint import SettingsMismatch

        if isinstance(e, SettingsMismatch | FileExistsError):
            print(f"train_lm.py: error: {e}", file=sys.stderr)
            return 2
        raise


def train(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    import unsplit
    from unsplit.demo import elastic

    config = elastic.ElasticConfig(
        global_batch=args.global_batch, length=args.length, width=args.width,
        layers=args.layers, heads=args.heads, dropout=args.dropout,
        learning_rate=args.learning_rate, seed=args.seed, bitwise=args.bitwise,
        chunk_size=args.chunk_size, microbatches=args.microbatches,
    )  # fmt: skip
    mesh = elastic.mesh_over(args.devices)
    run = elastic.setup(config, mesh)
    lead = jax.process_index() == 0
    say = Reporter(args, lead)
    topology = {"processes": jax.process_count(), "devices": args.devices,
                "microbatches": args.microbatches}  # fmt: skip
    ckpt = None
    params, opt_state, start = run.params, run.opt_state, 0
    if args.ckpt_dir:
        ckpt = unsplit.checkpoint.Checkpointer(args.ckpt_dir, settings=run.settings)
        newest = ckpt.latest_step()
        if newest is not None and not args.resume:
            raise FileExistsError(
                f"{args.ckpt_dir} already holds checkpoints (the newest after step {newest}). "
                "Fix: add --resume to continue that run, or pass an empty --ckpt-dir."
            )
        if newest is not None:
            saved = ckpt.metadata(newest)["info"]
            start, (params, opt_state) = ckpt.restore(like=(params, opt_state))
            say.line(
                f"resumed from the checkpoint after step {start} (saved on "
                f"{describe(saved)}), now on {describe(topology)}"
            )
        elif args.resume:
            say.line(f"no checkpoint in {args.ckpt_dir} yet: starting at step 0")
    say.line(
        f"training steps {start}..{args.steps} on {describe(topology)}, "
        f"{'bitwise' if args.bitwise else 'default'} mode, global batch {args.global_batch}"
    )
    update = elastic.train_step(run.step, run.optimizer)
    tokens_per_step = args.global_batch * args.length
    say.start(start, args.steps)
    for s in range(start, args.steps):
        batch, ids, key = elastic.global_step(run, s)
        loss, params, opt_state = update(params, opt_state, batch, key, ids)
        done = s + 1
        if ckpt is not None and (done % args.save_every == 0 or done == args.steps):
            ckpt.save(done, (params, opt_state), info=topology)
        say.step(done, float(np.asarray(loss.addressable_data(0))), tokens_per_step)
        if done == args.kill_after_step and lead:
            if ckpt is not None:
                ckpt.wait()
            say.line(f"simulated preemption: SIGKILL after step {done}")
            say.stop()
            os.kill(os.getpid(), signal.SIGKILL)
    say.stop()
    if ckpt is not None:
        ckpt.close()
    if args.params_out and lead:
        arrays = elastic.host_params(params)
        tmp = args.params_out + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, args.params_out)
        say.line(f"wrote {len(arrays)} parameters to {args.params_out}")
    if args.process_id is not None:
        jax.distributed.shutdown()
    return 0


def describe(t: dict) -> str:
    """E.g. ``2 processes x 2 devices x 1 microbatch`` (devices per process)."""
    parts = [(t["processes"], "process", "processes"), (t["devices"], "device", "devices"),
             (t["microbatches"], "microbatch", "microbatches")]  # fmt: skip
    return " x ".join(f"{n} {one if n == 1 else many}" for n, one, many in parts)


class Reporter:
    """Process 0's output: a rich progress bar (loss, tokens/s) or plain log lines."""

    def __init__(self, args: argparse.Namespace, lead: bool):
        self.lead, self.bar, self.task = lead, None, None
        self.plain = args.no_progress or not sys.stdout.isatty()
        self.last, self.first = time.perf_counter(), None

    def line(self, text: str) -> None:
        if not self.lead:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, flush=True)

    def start(self, first: int, total: int) -> None:
        if not self.lead or self.plain:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("training"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tokens/s"),
            TimeElapsedColumn(), TimeRemainingColumn(),
        )  # fmt: skip
        self.task = self.bar.add_task("train", total=total, completed=first, loss="-", tps="-")
        self.bar.start()

    def step(self, done: int, loss: float, tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:  # the first step compiles: measure from its end
            self.first = (done, now)
            rate = tokens / max(now - self.last, 1e-9)
        else:
            rate = tokens * (done - self.first[0]) / max(now - self.first[1], 1e-9)
        if not self.lead:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=done, loss=f"{loss:.4f}", tps=f"{rate:,.0f}")
        else:
            print(f"step {done} loss {loss:.6f} tokens/s {rate:,.0f}", flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this script as ``--processes`` local processes; process 0 prints, the rest log."""
    from unsplit.testing import free_port

    address = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    try:
        for i in range(args.processes):
            log = None if i == 0 else tempfile.TemporaryFile("w+")  # noqa: SIM115
            cmd = [sys.executable, os.path.abspath(__file__), *argv,
                   "--process-id", str(i), "--coordinator", address]  # fmt: skip
            procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
            )
            logs.append(log)
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[0].wait(timeout=5)  # process 0 prints its own error: a moment for it
                if procs[0].returncode in (None, 0):
                    print(f"train_lm.py: process {i} exited with code {codes[i]}; stopping the "
                          "others. Its output:", file=sys.stderr)  # fmt: skip
                    logs[i].seek(0)
                    print(logs[i].read()[-3000:], file=sys.stderr)
                else:
                    i = 0
                code = procs[i].returncode
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            if log is not None:
                log.close()


def watch_parent() -> None:
    """A worker started by launch_local ends when its launcher does (even after a SIGKILL)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
