"""What the multi-process agreement check costs: on the first call, and per step after it.

Two local processes x 2 simulated CPU devices (``unsplit.testing.run_local_processes``,
``jax.distributed`` over gloo) build the test transformer's step on a mesh over
all 4 devices and measure, in process 0, through the public API only:

* **first call**: the step's first call (trace, compile, the processes' agreement
  on settings, key, batch shapes and a fingerprint of every parameter, and the
  run) next to a warm step; ``unsplit.global_batch``'s first call (it agrees on
  the rows) next to its warm calls with ``check="always"`` (agreeing again) and
  ``check="never"``;
* **per step**: side by side in alternating rounds, the step called inside the
  user's ``jax.jit`` (where the key is traced, so the step checks on device that
  every process holds the same key and params, and poisons the result if not)
  as a ratio to the same step called directly (the host path, which checks only
  on the first call).

Run: ``python benchmarks/agreement_bench.py`` (``--quick`` for a smoke run that
does not touch the docs). The table goes to ``docs/checks.md``.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time

import common

HERE = pathlib.Path(__file__).resolve().parent
MARKER = "agreement"
DOC = "checks.md"


def _timed(fn) -> float:
    start = time.perf_counter()
    common.block(fn())
    return time.perf_counter() - start


def worker(quick: bool) -> dict:
    """Runs in each process; every process makes the same collective calls in the same order."""
    import jax
    import numpy as np

    import unsplit
    from unsplit.models import (
        Transformer,
        TransformerConfig,
        init_params,
        on_mesh,
        synthetic_batch,
        token_loss,
    )

    if quick:
        config = TransformerConfig(vocab=32, length=16, width=32, heads=2, layers=1)
    else:
        config = TransformerConfig(vocab=96, length=64, width=256, heads=4, layers=4)
    repeats = 3 if quick else 7
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    model = Transformer(config)
    params = on_mesh(jax.tree.map(np.asarray, init_params(model, 0)), mesh)
    rows = 16 // jax.process_count()
    data = jax.tree.map(np.asarray, synthetic_batch(config, 16, seed=1))
    mine = jax.tree.map(lambda x: x[jax.process_index() * rows :][:rows], data)
    start = time.perf_counter()
    batch, ids = unsplit.global_batch(mine, mesh)  # its first call agrees on the rows
    global_batch_first = time.perf_counter() - start
    global_batch_always = statistics.median(
        _timed(lambda: unsplit.global_batch(mine, mesh, check="always")[0]) for _ in range(repeats)
    )
    global_batch_never = statistics.median(
        _timed(lambda: unsplit.global_batch(mine, mesh, check="never")[0]) for _ in range(repeats)
    )
    key = jax.random.key(0)
    step = unsplit.value_and_grad(token_loss(model), weighted=True, mesh=mesh)
    first_step = _timed(lambda: step(params, batch, key, ids))
    warm_step = statistics.median(
        _timed(lambda: step(params, batch, key, ids)) for _ in range(repeats)
    )
    in_jit = jax.jit(step)  # the key is traced: the step checks on device, every call
    candidates = {
        "direct": lambda: step(params, batch, key, ids),
        "in_jit": lambda: in_jit(params, batch, key, ids),
    }
    results = common.compare(
        candidates, baseline="direct", repeats=repeats, inner=2 if quick else 5, warmup=1
    )
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return {
        "param_mib": param_bytes / 2**20,
        "param_leaves": len(jax.tree.leaves(params)),
        "global_batch_first_s": global_batch_first,
        "global_batch_always_s": global_batch_always,
        "global_batch_never_s": global_batch_never,
        "first_step_s": first_step,
        "warm_step_s": warm_step,
        "ratios": {r.name: [r.ratio_median, r.ratio_min, r.ratio_max] for r in results},
    }


def main(argv: list[str] | None = None) -> None:
    args = common.bench_parser(__doc__).parse_args(argv)

    import unsplit.testing

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    r = unsplit.testing.run_local_processes(
        "agreement_bench:worker", kwargs={"quick": args.quick}, timeout_s=600
    )[0]

    def ms(s: float) -> str:
        return f"{1e3 * s:.1f} ms"

    def ratio(name: str) -> str:
        med, lo, hi = r["ratios"][name]
        return f"{med:.2f}x ({lo:.2f}-{hi:.2f})"

    rows = [
        [f"the step's first call (trace, compile, agreement incl. a fingerprint of "
         f"{r['param_mib']:.1f} MiB of params in {r['param_leaves']} leaves, run)",
         ms(r["first_step_s"]), f"{r['first_step_s'] / r['warm_step_s']:.0f}x a warm step "
         f"({ms(r['warm_step_s'])})"],
        ["per step after the first call, step called directly", "0 (nothing is exchanged)", ""],
        ["per step, step inside your jax.jit (traced key and params checked on device)",
         ratio("in_jit"), "step time vs the same step called directly"],
        ["global_batch, first call (agrees on rows; the first collective of the program)",
         ms(r["global_batch_first_s"]), ""],
        ["global_batch, check='always' (agrees on every call)", ms(r["global_batch_always_s"]),
         f"vs {ms(r['global_batch_never_s'])} with check='never'"],
    ]  # fmt: skip
    header = ["check (2 processes x 2 CPU devices, gloo)", "cost", "relative"]
    load = os.getloadavg()[0]
    body = common.markdown_table(header, rows) + (
        f"\n\nLoad average at the end of the run: {load:.1f} on {os.cpu_count()} cores (the "
        "machine is shared; cold costs are mostly XLA compile time and grow with the load). "
        "Ratios below 1 are noise: the checked and plain steps take the same time."
    )
    print(body)
    if common.should_write(args):
        print(f"wrote {common.write_table(DOC, MARKER, body)}")


if __name__ == "__main__":
    sys.exit(main())
