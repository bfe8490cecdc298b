"""What the multi-process agreement check costs: on the first call, and per step after it.

Two local processes x 2 simulated CPU devices (``unsplit.testing.run_local_processes``,
``jax.distributed`` over gloo) build the test transformer's step on a mesh over
all 4 devices and measure, in process 0:

* **first call**: the host check a step runs once (``agreement.agree`` over its
  settings, the key, the batch's shapes and ``tree_items("params", ...)``, which
  fingerprints every parameter on device), cold (compiling the fingerprint and
  the gather) and warm, next to the step's own first call (trace + compile +
  run) and a warm step;
* **per step**: a warm host agreement on the key alone (what checking on every
  call would cost), and, side by side in alternating rounds, a jitted step
  with the on-device checks of traced values (``replicas_agree`` of the key,
  or of the key and every parameter, with ``poison_unless``) as a ratio to the
  same step without them.

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
    from unsplit._src.processes import agreement
    from unsplit._src.processes import fingerprint as fp
    from unsplit._src.test_util import replicated
    from unsplit.models import (
        Transformer,
        TransformerConfig,
        init_params,
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
    params = replicated(jax.tree.map(np.asarray, init_params(model, 0)), mesh)
    rows = 16 // jax.process_count()
    data = jax.tree.map(np.asarray, synthetic_batch(config, 16, seed=1))
    mine = jax.tree.map(lambda x: x[jax.process_index() * rows :][:rows], data)
    start = time.perf_counter()
    batch, ids = unsplit.global_batch(mine, mesh)  # its first call agrees on the rows
    global_batch_first = time.perf_counter() - start
    key = jax.random.key(0)
    settings = {"mode": "default", "microbatches": 1, "weighted": True, "mesh": mesh}

    def first_call_check():
        items = {**settings, "step key": key, **agreement.tree_items("params", params)}
        items.update(agreement.tree_items("batch", batch, values=False))
        agreement.agree(items, what="the benchmark's first call")

    cold = _timed(first_call_check)
    warm = statistics.median(_timed(first_call_check) for _ in range(repeats))
    fingerprint = statistics.median(
        _timed(lambda: agreement.tree_items("params", params)) for _ in range(repeats)
    )
    key_only = statistics.median(
        _timed(lambda: agreement.agree({"step key": key}, what="a step")) for _ in range(repeats)
    )

    step = unsplit.value_and_grad(token_loss(model), weighted=True, mesh=mesh)

    @jax.jit
    def plain(p, b, k, i):
        return step(p, b, k, i)

    @jax.jit
    def key_checked(p, b, k, i):
        ok = fp.replicas_agree(k, mesh)
        return fp.poison_unless(ok, step(p, b, k, i))

    @jax.jit
    def all_checked(p, b, k, i):
        ok = fp.replicas_agree((k, p), mesh)
        return fp.poison_unless(ok, step(p, b, k, i))

    first_step = _timed(lambda: plain(params, batch, key, ids))
    warm_step = statistics.median(
        _timed(lambda: plain(params, batch, key, ids)) for _ in range(repeats)
    )
    candidates = {
        name: (lambda f=f: f(params, batch, key, ids))
        for name, f in {"plain": plain, "key": key_checked, "key+params": all_checked}.items()
    }
    results = common.compare(
        candidates, baseline="plain", repeats=repeats, inner=2 if quick else 5, warmup=1
    )
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return {
        "param_mib": param_bytes / 2**20,
        "param_leaves": len(jax.tree.leaves(params)),
        "global_batch_first_s": global_batch_first,
        "check_cold_s": cold,
        "check_warm_s": warm,
        "fingerprint_s": fingerprint,
        "key_agree_s": key_only,
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
        ["first call: host check, cold (compiles fingerprint + gather)", ms(r["check_cold_s"]),
         f"{r['check_cold_s'] / r['first_step_s']:.1%} of the step's first call "
         f"({ms(r['first_step_s'])})"],
        ["first call: host check, warm", ms(r["check_warm_s"]),
         f"{r['check_warm_s'] / r['warm_step_s']:.1%} of a warm step ({ms(r['warm_step_s'])})"],
        [f"  of which: params fingerprint ({r['param_mib']:.1f} MiB, {r['param_leaves']} leaves)",
         ms(r["fingerprint_s"]), ""],
        ["global_batch, first call (agrees on rows; the first collective of the program)", ms(r["global_batch_first_s"]), ""],
        ["per step, host path after the first call", "0 (not run)", "nothing is exchanged"],
        ["per step if the key were agreed on the host every call", ms(r["key_agree_s"]),
         f"{r['key_agree_s'] / r['warm_step_s']:.1%} of a warm step, and a host sync"],
        ["per step, traced key checked on device (replicas_agree + poison)", ratio("key"),
         "step time vs the same jitted step without it"],
        ["per step, traced key and params checked on device", ratio("key+params"),
         "step time vs the same jitted step without it"],
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
