"""Train a small language model elastically: kill it anywhere, resume it on another topology.

Run from the repository root with unsplit installed (``./dev test`` or
``pip install -e .`` makes the venv), for example::

    # 8 steps done on 1 process x 4 devices x 2 microbatches, a checkpoint every 4 steps...
    python examples/train_lm.py --steps 20 --devices 4 --microbatches 2 --bitwise \\
        --ckpt-dir /tmp/run --save-every 4
    # ...killed (Ctrl-C, SIGKILL, a preemption); resumed on 2 processes x 2 devices:
    python examples/train_lm.py --steps 20 --devices 2 --processes 2 --microbatches 1 \\
        --bitwise --ckpt-dir /tmp/run --save-every 4 --resume --params-out params.npz

The model is the small causal transformer with dropout of ``unsplit.models``;
the data, the characters of Python's own standard library source
(:class:`TextWindows`, nothing to download). The data order comes from grain
(``unsplit.data.global_steps``: the records of global step ``s`` depend on
``(seed, epoch, s)`` only), every example's noise from its record id,
checkpoints from orbax (``unsplit.checkpoint``), the update from
``unsplit.train_step``. With ``--bitwise`` the resumed run ends with exactly
the parameters of an uninterrupted one; see docs/elastic.md.

Only unsplit's public API is used: copy this file as the start of your own run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

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
    _add_run_options(p.add_argument_group("run and schedule"))
    _add_checkpoint_options(p.add_argument_group("checkpoints"))
    _add_model_options(p.add_argument_group("model, data and optimizer (fixed for a run)"))
    _add_output_options(p.add_argument_group("output and testing"))
    _add_worker_options(
        p.add_argument_group("one process of a multi-process run (set by --processes)")
    )
    return p


def _add_run_options(run: argparse._ArgumentGroup) -> None:
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


def _add_checkpoint_options(ckpt: argparse._ArgumentGroup) -> None:
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


def _add_model_options(model: argparse._ArgumentGroup) -> None:
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


def _add_output_options(out: argparse._ArgumentGroup) -> None:
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


def _add_worker_options(multi: argparse._ArgumentGroup) -> None:
    multi.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    multi.add_argument("--coordinator", metavar="HOST:PORT", help=argparse.SUPPRESS)


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

    run = setup(args, unsplit.mesh_over(args.devices))
    lead = jax.process_index() == 0
    say = Reporter(args, lead)
    topology = {"processes": jax.process_count(), "devices": args.devices,
                "microbatches": args.microbatches}  # fmt: skip
    ckpt, start, (params, opt_state) = open_checkpoints(args, run, say, topology)
    say.line(
        f"training steps {start}..{args.steps} on {describe(topology)}, "
        f"{'bitwise' if args.bitwise else 'default'} mode, global batch {args.global_batch}"
    )
    tokens_per_step = args.global_batch * args.length
    say.start(start, args.steps)
    for s in range(start, args.steps):
        rows, ids = run.steps[s]  # this process's rows of global step s, their record ids
        batch, ids = unsplit.global_batch(rows, run.mesh, ids)
        key = jax.random.key(args.seed)  # the step key fold_in(key, s), made in the program
        loss, params, opt_state = run.train(params, opt_state, batch, key, ids=ids, step=s)
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
        write_params(args.params_out, params, say)
    if args.process_id is not None:
        jax.distributed.shutdown()
    return 0


def open_checkpoints(args: argparse.Namespace, run, say, topology: dict):
    """``(checkpointer or None, start step, (params, opt_state))``: resumed if asked and saved."""
    import unsplit

    state = (run.params, run.opt_state)
    if not args.ckpt_dir:
        return None, 0, state
    ckpt = unsplit.checkpoint.Checkpointer(args.ckpt_dir, settings=run.settings)
    newest = ckpt.latest_step()
    if newest is not None and not args.resume:
        raise FileExistsError(
            f"{args.ckpt_dir} already holds checkpoints (the newest after step {newest}). "
            "Fix: add --resume to continue that run, or pass an empty --ckpt-dir."
        )
    if newest is None:
        if args.resume:
            say.line(f"no checkpoint in {args.ckpt_dir} yet: starting at step 0")
        return ckpt, 0, state
    saved = ckpt.metadata(newest)["info"]
    start, state = ckpt.restore(like=state)
    say.line(
        f"resumed from the checkpoint after step {start} (saved on "
        f"{describe(saved)}), now on {describe(topology)}"
    )
    return ckpt, start, state


def write_params(path: str, params, say) -> None:
    """The final params as ``.npz``, one array per tree path, written atomically."""
    import numpy as np

    arrays = host_params(params)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    say.line(f"wrote {len(arrays)} parameters to {path}")


# The run: model, data, step and optimizer on a mesh --------------------------------------

#: Standard-library modules whose source is the text (present in every CPython 3.11+).
MODULES = ("argparse", "json.decoder", "json.encoder", "textwrap", "dataclasses", "functools",
           "string", "fractions")  # fmt: skip
#: The vocabulary: newline, then printable ASCII; any other character becomes "?".
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
#: Flags that fix the result: a resumed run must keep them (``--microbatches`` etc. may change).
FIXED = ("global_batch", "length", "width", "layers", "heads", "dropout", "learning_rate",
         "seed", "bitwise")  # fmt: skip


class TextWindows:
    """The records: windows of the standard library's source, each with its own length.

    Record ``r`` is the window of ``length + 1`` characters at ``r * length``,
    keeping its first ``n_r`` tokens (``n_r`` in ``[length // 4, length]``,
    fixed per record); the rest is padding with mask 0, so examples are ragged
    and the loss's token weighting matters. Every Python installation has the
    text, so there is nothing to download. ``__len__`` and ``__getitem__`` make
    it a random-access source for grain (``unsplit.data.global_steps``).
    """

    def __init__(self, length: int):
        import numpy as np

        symbols = {c: i for i, c in enumerate(ALPHABET)}
        text = stdlib_text().replace("\t", "    ")
        unknown = symbols["?"]
        self.tokens = np.array([symbols.get(c, unknown) for c in text], np.int32)
        self.length = length

    def __len__(self) -> int:
        return (self.tokens.size - 1) // self.length

    def __getitem__(self, record: int) -> dict:
        import numpy as np

        record, n = int(record), self.length
        if not 0 <= record < len(self):
            raise IndexError(f"record {record} is not in [0, {len(self)}).")
        keep = np.random.default_rng((1, record)).integers(n // 4, n + 1)
        window = self.tokens[record * n : record * n + n + 1]
        mask = np.arange(n) < keep
        return {
            "inputs": np.where(mask, window[:-1], 0).astype(np.int32),
            "targets": np.where(mask, window[1:], 0).astype(np.int32),
            "mask": mask.astype(np.float32),
        }


def stdlib_text() -> str:
    """The source of :data:`MODULES`, concatenated (the first 400,000 characters)."""
    import importlib.util
    import pathlib

    parts = []
    for name in MODULES:
        origin = importlib.util.find_spec(name).origin or ""
        if not origin.endswith(".py"):
            raise RuntimeError(
                f"the standard library module {name} has no source file here ({origin!r}). "
                "Fix: run with a standard CPython installation, which ships its .py files."
            )
        parts.append(pathlib.Path(origin).read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts)[:400_000]


@dataclasses.dataclass
class Run:
    """Everything the loop needs on one mesh (see :func:`setup`)."""

    mesh: Any  # jax.sharding.Mesh
    steps: Any  # unsplit.data.GlobalSteps: this process's rows of every global step
    train: Any  # unsplit.train_step: (params, opt_state, batch, key, ids) -> (loss, ...)
    params: Any
    opt_state: Any
    settings: dict  # what a resumed run must keep, checked by unsplit.checkpoint


def setup(args: argparse.Namespace, mesh) -> Run:
    """The model, data order, unsplit step, Adam and replicated initial state on ``mesh``."""
    import jax
    import optax

    import unsplit
    from unsplit import models

    source = TextWindows(args.length)
    steps = unsplit.data.global_steps(
        source, global_batch=args.global_batch, seed=args.seed, mesh=mesh
    )
    model = models.Transformer(
        models.TransformerConfig(
            vocab=len(ALPHABET), length=args.length, width=args.width, heads=args.heads,
            layers=args.layers, dropout=args.dropout, attention_dropout=args.dropout,
        )
    )  # fmt: skip
    step = unsplit.value_and_grad(
        models.token_loss(model),  # (sum of token losses, tokens): normalized globally
        weighted=True,
        microbatches=args.microbatches,
        mesh=mesh,
        bitwise=args.bitwise,
        chunk_size=chunk_size(args),
    )
    optimizer = optax.adam(args.learning_rate)
    params = jax.device_get(models.init_params(model, args.seed))
    opt_state = jax.device_get(optimizer.init(params))
    return Run(
        mesh=mesh,
        steps=steps,
        train=unsplit.train_step(step, optimizer),  # donates params and opt_state
        params=replicate(params, mesh),
        opt_state=replicate(opt_state, mesh),
        settings=settings(args, len(source)),
    )


def chunk_size(args: argparse.Namespace) -> int | None:
    """Bitwise mode's unit of work: ``--chunk-size``, by default 1 (resumes on any schedule)."""
    return (args.chunk_size or 1) if args.bitwise else None


def settings(args: argparse.Namespace, records: int) -> dict:
    """The values a resumed run must keep (checked by ``unsplit.checkpoint`` on resume).

    Seed, global batch and the dataset's size fix each step's records and
    noise; the model, optimizer and mode fix the function; in bitwise mode the
    chunk size and JAX's version fix the bits.
    """
    fixed = {name: getattr(args, name) for name in FIXED}
    fixed["chunk_size"] = chunk_size(args)
    fixed["records"] = records
    import unsplit.checkpoint

    return unsplit.checkpoint.run_settings(fixed, bitwise=args.bitwise)


def replicate(tree, mesh):
    """Host values as arrays replicated on every device of ``mesh`` (any process count)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P())

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    # Through a jit, so the arrays carry the mesh in their type exactly as the optimizer
    # update's outputs do; otherwise the step's programs compile again at the second step.
    return jax.jit(lambda t: t, out_shardings=sharding)(jax.tree.map(one, tree))


def host_params(params) -> dict:
    """Replicated params as host arrays keyed by their tree path (``jax.tree_util.keystr``)."""
    import jax
    import numpy as np

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(p): np.asarray(x.addressable_data(0)) for p, x in flat}


# Output and local processes ----------------------------------------------------------------


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
