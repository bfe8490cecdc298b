"""Attention with dropout: ``unsplit.linen.dot_product_attention`` vs Flax's.

One table, every figure a ratio measured side by side in one run
(``common.compare``: alternating rounds, median with min and max):

* **attention-dropout**: ``unsplit.linen.dot_product_attention`` vs
  ``flax.linen.dot_product_attention`` on ``q, k, v`` of shape
  ``(B=16, L=256, heads=8, d=64)`` float32, dropout rate 0.1, both with
  ``broadcast_dropout=False`` (one mask element per weight: the same work),
  then both with Flax's default ``broadcast_dropout=True`` (one ``L x L`` mask
  shared by batch and heads). *fwd* is the output, *fwd+bwd* the output and
  the three input gradients from ``jax.vjp`` with a given cotangent, each one
  jitted program; XLA's compiled temp memory of each. A third candidate,
  Flax's attention **without** dropout, shows what the two matmuls and the
  softmax cost on their own (in Flax's layout). For fwd+bwd, *the six matmuls
  alone* (``q k^T``, ``w v`` and the four of the backward pass, no softmax, no
  mask) are timed in two layouts: Flax's einsums, and head-major (``q, k, v``
  moved to ``[batch, heads, length, d]`` and the output back, as unsplit's
  value contraction does): the matmuls' own cost, which depends on the layout
  more than on anything else on this CPU. A fourth, *no dropout, head-major*,
  is Flax's attention without dropout with unsplit's value contraction: the
  attention unsplit's dropout is added to, so ``unsplit / it`` is what the
  dropout costs (printed and written under the table). Goals: fwd+bwd <= 0.5x
  Flax's time with dropout, the dropout adding at most 10% (<= 1.10x the
  head-major attention without dropout), and no more temp memory.

Run: ``python benchmarks/attention_bench.py`` (``--quick`` for a smoke run
that does not touch the docs).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import common
import flax.linen as nn
import jax
import jax.numpy as jnp

from unsplit import linen as ulinen

DOC = "benchmarks.md"
NO_DROPOUT_HEAD_MAJOR = "no dropout, head-major (unsplit's layout)"
MARKER = "attention-dropout"
RATE = 0.1


@dataclasses.dataclass(frozen=True)
class Setup:
    batch: int
    heads: int
    length: int
    depth: int
    repeats: int
    warmup: int


FULL = Setup(batch=16, heads=8, length=256, depth=64, repeats=15, warmup=2)
QUICK = Setup(batch=2, heads=2, length=32, depth=16, repeats=3, warmup=1)

CANDIDATES = {
    "flax": nn.dot_product_attention,
    "unsplit": ulinen.dot_product_attention,
}


def attend(fn, broadcast: bool, dropout: bool = True):
    def run(key, q, k, v):
        if not dropout:
            return nn.dot_product_attention(q, k, v, deterministic=True)
        return fn(q, k, v, dropout_rng=key, dropout_rate=RATE, broadcast_dropout=broadcast)

    return run


def head_major_value(subscripts, weights, value):
    """Flax's ``...hqk,...khd->...qhd`` contracted head-major, as unsplit's attention does."""
    assert subscripts == "...hqk,...khd->...qhd", subscripts
    head_major = jnp.einsum("...hqk,...hkd->...hqd", weights, jnp.swapaxes(value, -2, -3))
    return jnp.swapaxes(head_major, -2, -3)


def no_dropout_head_major(key, q, k, v):
    """Attention without dropout in unsplit's layout: what unsplit's dropout adds to."""
    del key
    return nn.dot_product_attention(
        q,
        k,
        v,
        deterministic=True,
        qk_attn_weights_einsum=jnp.einsum,
        attn_weights_value_einsum=head_major_value,
    )


def fwd_bwd(fn):
    def run(key, q, k, v, ct):
        y, vjp = jax.vjp(functools.partial(fn, key), q, k, v)
        return y, vjp(ct)

    return run


def six_matmuls(key, q, k, v, ct):
    """The matmuls of attention's forward and backward pass in Flax's layout, nothing else."""
    del key
    w = jnp.einsum("...qhd,...khd->...hqk", q, k)
    y = jnp.einsum("...hqk,...khd->...qhd", w, v)
    dw = jnp.einsum("...qhd,...khd->...hqk", ct, v)
    dv = jnp.einsum("...hqk,...qhd->...khd", w, ct)
    dq = jnp.einsum("...hqk,...khd->...qhd", dw, k)
    dk = jnp.einsum("...hqk,...qhd->...khd", dw, q)
    return y, (dq, dk, dv)


def six_matmuls_head_major(key, q, k, v, ct):
    """The same six matmuls on ``[batch, heads, length, d]`` operands (moved there and back)."""
    del key
    q, k, v, ct = (jnp.swapaxes(a, -2, -3) for a in (q, k, v, ct))
    w = jnp.einsum("...hqd,...hkd->...hqk", q, k)
    y = jnp.einsum("...hqk,...hkd->...hqd", w, v)
    dw = jnp.einsum("...hqd,...hkd->...hqk", ct, v)
    dv = jnp.einsum("...hqk,...hqd->...hkd", w, ct)
    dq = jnp.einsum("...hqk,...hkd->...hqd", dw, k)
    dk = jnp.einsum("...hqk,...hqd->...hkd", dw, q)
    return tuple(jnp.swapaxes(a, -2, -3) for a in (y, dq, dk, dv))


def cpu_ratios(candidates: dict, baseline: str, repeats: int) -> dict[str, float]:
    """Median per-round ratio of process CPU time (all threads) to the baseline's.

    On a machine shared with other jobs, wall time also counts waiting for a
    core; CPU time counts the work. Rounds alternate the order, as ``common.compare``.
    """
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.process_time()
            common.block(candidates[name]())
            times[name].append(time.process_time() - start)
    return {name: common.median_ratio(times[name], times[baseline]) for name in names}


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def rows(setup: Setup) -> tuple[list[list[str]], list[str]]:
    shape = (setup.batch, setup.length, setup.heads, setup.depth)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.random.normal(key, shape) for key in keys)
    key = jax.random.key(1)
    out, added = [], []
    for broadcast in (False, True):
        for mode, wrap, args in (
            ("fwd", lambda f: f, (key, q, k, v)),
            ("fwd+bwd", fwd_bwd, (key, q, k, v, ct)),
        ):
            fns = {name: wrap(attend(fn, broadcast)) for name, fn in CANDIDATES.items()}
            if not broadcast:
                fns["flax, no dropout"] = wrap(attend(None, broadcast, dropout=False))
                fns[NO_DROPOUT_HEAD_MAJOR] = wrap(no_dropout_head_major)
                if mode == "fwd+bwd":
                    fns["the six matmuls alone, Flax's layout"] = six_matmuls
                    fns["the six matmuls alone, head-major"] = six_matmuls_head_major
            progs = {name: jax.jit(fn) for name, fn in fns.items()}
            calls = {name: (lambda p=p, a=args: p(*a)) for name, p in progs.items()}
            results = common.compare(
                calls, baseline="flax", repeats=setup.repeats, inner=1, warmup=setup.warmup
            )
            # Process CPU time counts the work only where the work runs on the CPU.
            on_cpu = jax.default_backend() == "cpu"
            cpu = cpu_ratios(calls, "flax", setup.repeats) if on_cpu else {}
            temp = {name: common.compiled_temp_bytes(fn, *args) for name, fn in fns.items()}
            by_name = {r.name: r for r in results}
            if not broadcast:
                unsplit = by_name["unsplit"].median_s
                added.append(
                    f"{mode}: {unsplit / by_name[NO_DROPOUT_HEAD_MAJOR].median_s:.2f}x the same "
                    f"attention without dropout, {unsplit / by_name['flax, no dropout'].median_s:.2f}x "
                    "Flax's without dropout"
                )
            for r in results:
                if r.name == "flax":
                    continue
                out.append(
                    [
                        str(broadcast),
                        mode,
                        r.name,
                        common.ratio_cell(r),
                        common.times_cell(cpu[r.name]) if r.name in cpu else "- (accelerator)",
                        f"{mib(temp[r.name])} vs {mib(temp['flax'])}",
                        f"{r.median_s * 1e3:.1f} vs "
                        f"{next(x for x in results if x.name == 'flax').median_s * 1e3:.1f} ms",
                    ]
                )
    return out, added


HEADER = [
    "broadcast_dropout",
    "pass",
    "candidate",
    "time / flax's (with dropout): median (min-max)",
    "CPU time / flax's: median",
    "temp memory: candidate vs flax",
    "median times",
]


def render(table_rows: list[list[str]], added: list[str], setup: Setup) -> str:
    return (
        "### Attention dropout: unsplit.linen.dot_product_attention vs Flax's\n\n"
        f"`q, k, v` of shape (B={setup.batch}, L={setup.length}, heads={setup.heads}, "
        f"d={setup.depth}) float32, dropout rate {RATE}; {setup.repeats} alternating rounds. "
        "Each ratio is the candidate's time over `flax.linen.dot_product_attention`'s "
        "(with dropout, same `broadcast_dropout`) within each round. *fwd+bwd* is `jax.vjp` "
        "returning the output and the gradients of q, k and v for a given cotangent, in one "
        "jitted program. *flax, no dropout* is Flax's attention with `deterministic=True`: "
        "its matmuls and softmax alone. *the six matmuls alone* "
        "are the forward and backward matmuls with no softmax and no mask, in Flax's einsum "
        "layout and head-major (`[batch, heads, length, d]`, the layout of unsplit's value "
        "contraction; the operands moved there and back). *CPU time* is the process's "
        "CPU time (all threads) per call, ratio per round, median: on a machine shared with "
        "other jobs wall time also counts waiting for a core. Memory: XLA compiled temp "
        "bytes (goal: not more than Flax's).\n\n"
        f"{common.markdown_table(HEADER, table_rows)}\n\n"
        "**What the dropout adds** (`broadcast_dropout=False`, ratio of median times): "
        "unsplit's attention with dropout costs "
        + "; ".join(added)
        + ". *no dropout, head-major* is Flax's attention without dropout with the weights "
        "contracted with the values head-major, as unsplit's: the attention the dropout is "
        "added to (goal: <= 1.10x).\n"
    )


def main(argv: list[str] | None = None) -> None:
    args = common.bench_parser(__doc__).parse_args(argv)
    setup = QUICK if args.quick else FULL
    table_rows, added = rows(setup)
    common.print_table("attention dropout: candidate / flax", HEADER, table_rows, width=180)
    print("what the dropout adds:", "; ".join(added))
    if common.should_write(args):
        print(f"wrote {common.write_table(DOC, MARKER, render(table_rows, added, setup))}")


if __name__ == "__main__":
    main()
