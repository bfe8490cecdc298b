"""The accelerator check: bitwise bits and costs on the devices this machine has (<= 8 min).

Run on a machine with GPUs (or TPUs)::

    python benchmarks/device_check.py --out device_check.md

It sets the flags bitwise mode needs on GPU (``--xla_gpu_deterministic_ops=true
--xla_gpu_autotune_level=0``) before importing jax, then, on the devices it finds:

1. **the bitwise grid**: the test transformer's bitwise step on 1, 2, 4 and 8 devices
   (those present) with 1 or 2 microbatches; loss and grads compared bit for bit with the
   one-device result; then 3 AdamW steps through ``unsplit.train_step`` with FSDP
   params on every device count, params and optimizer state compared bit for bit;
2. **bitwise vs default time**: the same step, side by side in alternating rounds, with
   replicated params, FSDP params and, with 2+ devices, tensor parallel (data, model=2);
3. **a contrastive step** (``batch_loss``): bitwise bits across microbatches, and
   default mode's time vs a plain jit at 1 and 8 microbatches;
4. **the dropout and attention benches** (``dropout_bench.py`` and
   ``attention_bench.py`` with ``--quick``), their tables as printed; they run first, each
   in a process of its own, before the check opens the accelerator (a TPU chip is held by
   one process at a time);
5. **a realistic size** (``realistic_check.py``): a GPT-2-small-scale transformer (12
   layers, width 768, sequence 512, batch 32), bitwise / default time and memory at the
   default chunk size and at one chunk per device, and a ``jax.profiler`` trace summary
   of where a bitwise step's time goes.

``--parts`` picks parts (default: all, the realistic one last, if time is left);
``--parts realistic --budget 540`` is the one prepared call for the realistic size.
``--tiny`` (and any CPU run) makes the realistic part small, to check the script end
to end. ``--trace-dir`` keeps the trace (default: ``$OUT/trace`` when ``$OUT`` is set).

Everything goes to stdout and, with ``--out``, to a markdown file headed by the device's
name, ready for docs/benchmarks.md. Each part checks the time left and says what it
skipped. On CPU (no accelerator) it runs on 8 simulated devices, as a smoke run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time
import traceback

GPU_FLAGS = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
HERE = pathlib.Path(__file__).resolve().parent
BUDGET_S = 8 * 60
BENCHES_S = 150  # of BUDGET_S, for the dropout and attention benches
START = time.monotonic()


def left() -> float:
    return BUDGET_S - (time.monotonic() - START)


def setup_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        flags += " " + GPU_FLAGS
    if "xla_force_host_platform_device_count" not in flags:
        flags += " --xla_force_host_platform_device_count=8"  # used only on CPU
    os.environ["XLA_FLAGS"] = flags.strip()


def device_counts(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8) if d <= n]


def grid(lines: list[str]) -> None:
    import jax
    import numpy as np
    import optax

    import unsplit
    from unsplit.models import (
        Transformer,
        TransformerConfig,
        fsdp_specs,
        init_params,
        on_mesh,
        synthetic_batch,
        token_loss,
    )

    config = TransformerConfig(vocab=96, length=64, width=128, heads=4, layers=2)
    model = Transformer(config)
    host = jax.tree.map(np.asarray, init_params(model))
    batch = jax.tree.map(np.asarray, synthetic_batch(config, 64, seed=1))
    key = jax.random.key(0)
    loss = token_loss(model)
    counts = device_counts(jax.device_count())
    reference = None
    lines += ["", "### Bitwise grid (loss and grads vs 1 device)", "",
              "| devices | microbatches | bit-identical |", "|---|---|---|"]  # fmt: skip
    for n in counts:
        for microbatches in (1, 2, 4):
            if left() < 60:
                lines.append(f"| {n} | {microbatches} | skipped (time) |")
                continue
            mesh = jax.make_mesh((n,), ("data",))
            step = unsplit.value_and_grad(
                loss, weighted=True, mesh=mesh, microbatches=microbatches, bitwise=True
            )
            out = jax.device_get(step(on_mesh(host, mesh), batch, key))
            reference = out if reference is None else reference
            lines.append(f"| {n} | {microbatches} | {unsplit.testing.bits_equal(out, reference)} |")
    lines += ["", "### 3 AdamW steps, FSDP params (params and optimizer state vs 1 device)", "",
              "| devices | bit-identical |", "|---|---|"]  # fmt: skip
    first = None
    for n in counts:
        if left() < 60:
            lines.append(f"| {n} | skipped (time) |")
            continue
        mesh = jax.make_mesh((n,), ("data",))
        params = on_mesh(host, mesh, fsdp_specs(host, "data", n))
        optimizer = optax.adamw(1e-3)
        with jax.set_mesh(mesh):
            opt_state = optimizer.init(params)
        train = unsplit.train_step(
            unsplit.value_and_grad(loss, weighted=True, mesh=mesh, bitwise=True), optimizer
        )
        for i in range(3):
            _, params, opt_state = train(params, opt_state, batch, jax.random.fold_in(key, i))
        out = jax.device_get((params, opt_state))
        first = out if first is None else first
        lines.append(f"| {n} | {unsplit.testing.bits_equal(out, first)} |")


def timing(lines: list[str]) -> None:
    import common
    import jax
    import numpy as np

    from unsplit.models import (
        Transformer,
        TransformerConfig,
        fsdp_specs,
        init_params,
        megatron_specs,
        on_mesh,
        synthetic_batch,
    )

    config = TransformerConfig(vocab=96, length=64, width=256, heads=4, layers=4)
    model = Transformer(config)
    host = jax.tree.map(np.asarray, init_params(model))
    batch = jax.tree.map(np.asarray, synthetic_batch(config, 64, seed=1))
    key = jax.random.key(0)
    n = max(device_counts(jax.device_count()))
    auto = (jax.sharding.AxisType.Auto,) * 2
    layouts = [("replicated", (n, 1), None, None), ("FSDP", (n, 1), "fsdp", None)]
    # A bigger chunk: fewer, larger chunk programs per step (64 // n rows: one per device).
    layouts.append((f"replicated, chunk_size={64 // n}", (n, 1), None, 64 // n))
    if n >= 2:
        layouts.append(("tensor parallel, Megatron", (n // 2, 2), "megatron", None))
    lines += ["", f"### Step time, bitwise / default ({n} devices, batch 64)", "",
              "| layout | bitwise / default (median, min-max) | first call: bitwise / default |",
              "|---|---|---|"]  # fmt: skip
    for name, shape, specs, chunk_size in layouts:
        if left() < 90:
            lines.append(f"| {name} | skipped (time) | |")
            continue
        mesh = jax.make_mesh(shape, ("data", "model"), axis_types=auto)
        spec_tree = None
        if specs == "fsdp":
            spec_tree = fsdp_specs(host, "data", shape[0])
        elif specs == "megatron":
            spec_tree = megatron_specs(host)
        params = on_mesh(host, mesh, spec_tree)
        ratio, first = time_layout(model, params, batch, key, mesh, chunk_size)
        lines.append(f"| {name} | {common.ratio_cell(ratio)} | {first:.1f}x |")


def time_layout(model, params, batch, key, mesh, chunk_size=None):
    """(bitwise / default step time, bitwise / default first call) for one layout."""
    import common

    import unsplit
    from unsplit.models import token_loss

    default = unsplit.value_and_grad(token_loss(model), weighted=True, mesh=mesh)
    bitwise = unsplit.value_and_grad(
        token_loss(model), weighted=True, mesh=mesh, bitwise=True, chunk_size=chunk_size
    )
    first = common.time_once(lambda: bitwise(params, batch, key)) / common.time_once(
        lambda: default(params, batch, key)
    )
    candidates = {
        "default": lambda: default(params, batch, key),
        "bitwise": lambda: bitwise(params, batch, key),
    }
    results = common.compare(candidates, baseline="default", repeats=7, inner=3, warmup=1)
    return next(r for r in results if r.name == "bitwise"), first


def coupled(lines: list[str]) -> None:
    """A contrastive step (``batch_loss``): bits across microbatches, time vs plain jit."""
    import common
    import coupled_bench as cb
    import jax

    import unsplit

    params, data = cb.problem(256, 512, tokens=16)
    key = jax.random.key(3)
    lines += ["", "### Contrastive step (batch_loss), batch 256, 16-token towers", "",
              "| step | bits vs microbatches=1 (bitwise) | time / plain jit (default mode) |",
              "|---|---|---|"]  # fmt: skip
    first = None
    for k in (1, 2, 4):
        step = unsplit.value_and_grad(
            cb.features_fn, batch_loss=cb.batch_loss_fn, microbatches=k, bitwise=True
        )
        out = jax.device_get(step(params, data, key))
        first = out if first is None else first
        lines.append(f"| bitwise, microbatches={k} | {unsplit.testing.bits_equal(out, first)} | |")
    plain = jax.jit(jax.value_and_grad(cb.plain_loss))
    candidates = {"plain": lambda: plain(params, data, key)}
    for k in (1, 8):
        step = unsplit.value_and_grad(cb.features_fn, batch_loss=cb.batch_loss_fn, microbatches=k)
        candidates[f"unsplit k={k}"] = lambda s=step: s(params, data, key)
    for r in common.compare(candidates, baseline="plain", repeats=7, inner=3, warmup=1):
        if r.name != "plain":
            lines.append(f"| default, {r.name} | | {common.ratio_cell(r)} |")


def benches(lines: list[str], budget_s: float = BENCHES_S) -> None:
    """The dropout and attention benches, each in a process of its own.

    Run before this process opens the accelerator: a TPU chip is held by one process at a
    time, so a bench started while the check holds it could not open it.
    """
    end = time.monotonic() + budget_s
    for script in ("dropout_bench.py", "attention_bench.py"):
        if end - time.monotonic() < 20:
            lines += ["", f"{script}: skipped (time)"]
            continue
        try:
            done = subprocess.run(
                [sys.executable, str(HERE / script), "--quick"],
                capture_output=True,
                text=True,
                timeout=end - time.monotonic(),
                env=os.environ,
            )
        except subprocess.TimeoutExpired:
            lines += ["", f"{script}: stopped after its share of the time"]
            continue
        shown = done.stdout.strip()[-4000:]
        if done.returncode:  # a failure is a finding: show why
            shown += "\n" + done.stderr.strip()[-3000:]
        lines += ["", f"### {script} --quick (exit {done.returncode})", "", "```",
                  shown.strip(), "```"]  # fmt: skip


PARTS = ("benches", "grid", "timing", "coupled", "realistic")


def main() -> int:
    global BUDGET_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, help="also write the report here (markdown)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}"
    )
    parser.add_argument("--tiny", action="store_true", help="a small realistic part (smoke run)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds in all")
    parser.add_argument("--trace-dir", type=pathlib.Path, help="where the profiler trace goes")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: expected some of {PARTS}, got {unknown}")
    BUDGET_S = args.budget
    setup_flags()
    sys.path.insert(0, str(HERE))
    bench_lines: list[str] = []
    if "benches" in parts:
        benches(bench_lines)  # first: see benches()
    import jax

    device = jax.devices()[0]
    lines = [
        f"## Device check: {jax.device_count()} x {device.device_kind} ({device.platform})",
        "",
        f"jax {jax.__version__}; XLA_FLAGS={os.environ['XLA_FLAGS']}",
    ]
    trace_dir = args.trace_dir
    if trace_dir is None and os.environ.get("OUT"):
        trace_dir = pathlib.Path(os.environ["OUT"]) / "trace"
    import realistic_check

    runs = {
        "grid": grid,
        "timing": timing,
        "coupled": coupled,
        "realistic": lambda lines: realistic_check.realistic(
            lines, tiny=args.tiny, trace_dir=trace_dir, time_left=left
        ),
    }
    for name, part in runs.items():
        if name not in parts:
            continue
        if name == "realistic" and "grid" in parts and left() < 150:
            lines += ["", "realistic: skipped (time; run it alone with --parts realistic)"]
            continue
        try:
            part(lines)
        except Exception as error:  # report it and go on: one part's failure is a finding
            trace = traceback.format_exc(limit=-6)
            lines += ["", f"{name} failed: {type(error).__name__}: {error}", "",
                      "```", trace.strip()[-3000:], "```"]  # fmt: skip
    lines += [*bench_lines, "", f"Total {time.monotonic() - START:.0f} s."]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
