"""What two chunks per group cost inside one program: where bitwise mode's (4, 2) time goes.

Bitwise mode at ``(data=4, model=2)`` runs two chunks of 8 rows per group where default
mode runs one pass over the group's 16 rows (docs/benchmarks.md, "What the cost follows:
chunks per group"). This script asks whether one program for both chunks could close that
gap: the MLP of ``degrees_bench`` (1024 -> 4096 -> 1024, batch 64, Megatron's layout over
8 devices) written by hand in ``jax.shard_map`` (no unsplit code, no canonical blocks: a
floor for any program unsplit could generate), each variant one jitted program:

* one pass at M = 16 rows (default mode's shape of the work);
* two chunks of 8, each with its own forward and backward pass and its own weight
  gradient, the two added (bitwise mode's arithmetic, in one program);
* the same with the weight gradients computed and added block by block (512 columns, the
  canonical blocks), so each block's two products could stay in cache;
* the same with both chunks' weight gradients as one batched dot;
* the forward and backward passes at M = 16 with per-chunk weight gradients, and the
  converse: which half of the work the second chunk costs.

A second table: whether a row of ``x @ w`` has the same bits when the dot has M = 1, 2, ..,
64 rows (the chunk is bitwise mode's fixed unit of work because XLA:CPU's dots are not
row-invariant; with ``--xla_cpu_enable_platform_dependent_math=false`` in ``XLA_FLAGS``
this shows that flag's effect). Tables into docs/benchmarks.md (marker ``chunk-split``).

    python benchmarks/chunk_split_bench.py           # full run, writes the tables
    python benchmarks/chunk_split_bench.py --quick   # a smoke run (small MLP), no write
"""

from __future__ import annotations

import common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH, CHUNK, BLOCKS = 64, 8, 8
MESH_SHAPE = (4, 2)  # (data, model): two chunks of 8 rows per group


def _passes(x, w1, w2):
    """The forward and backward passes of one device's rows (no weight gradient yet):
    the hidden activations, the output's gradient and the hidden pre-activations' gradient."""
    pre = x @ w1
    h = jax.nn.gelu(pre)
    y = jax.lax.psum(h @ w2, "model")
    dy = 2 * (y - x) / (BATCH * x.shape[1])
    dh = (dy @ w2.T) * jax.grad(lambda a: jnp.sum(jax.nn.gelu(a)))(pre)
    return h, dy, dh


def _weight_grads(x, h, dy, dh):
    return x.T @ dh, h.T @ dy


def _chunks(x):
    return [x[c * CHUNK : (c + 1) * CHUNK] for c in range(x.shape[0] // CHUNK)]


def one_pass(x, w1, w2):
    return _weight_grads(x, *_passes(x, w1, w2))


def per_chunk(x, w1, w2):
    first, second = (_weight_grads(xc, *_passes(xc, w1, w2)) for xc in _chunks(x))
    return first[0] + second[0], first[1] + second[1]


def per_chunk_by_block(x, w1, w2):
    acts = [(xc, *_passes(xc, w1, w2)) for xc in _chunks(x)]
    hidden = w1.shape[1]  # this device's columns
    block = hidden // max(1, BLOCKS // MESH_SHAPE[1])
    g1, g2 = [], []
    for start in range(0, hidden, block):
        cols = slice(start, start + block)
        (a1, a2), (b1, b2) = ((xc.T @ dh[:, cols], h[:, cols].T @ dy) for xc, h, dy, dh in acts)
        g1.append(a1 + b1)
        g2.append(a2 + b2)
    return jnp.concatenate(g1, 1), jnp.concatenate(g2, 0)


def per_chunk_batched(x, w1, w2):
    parts = [_passes(xc, w1, w2) for xc in _chunks(x)]
    h, dy, dh = (jnp.stack(p) for p in zip(*parts, strict=True))
    xs = jnp.stack(_chunks(x))
    g1 = jnp.einsum("cbi,cbj->cij", xs, dh)
    g2 = jnp.einsum("cbi,cbj->cij", h, dy)
    return g1[0] + g1[1], g2[0] + g2[1]


def passes_once_grads_per_chunk(x, w1, w2):
    h, dy, dh = _passes(x, w1, w2)
    rows = [slice(c * CHUNK, (c + 1) * CHUNK) for c in range(x.shape[0] // CHUNK)]
    first, second = (_weight_grads(x[r], h[r], dy[r], dh[r]) for r in rows)
    return first[0] + second[0], first[1] + second[1]


def passes_per_chunk_grads_once(x, w1, w2):
    parts = [_passes(xc, w1, w2) for xc in _chunks(x)]
    h, dy, dh = (jnp.concatenate(p) for p in zip(*parts, strict=True))
    return _weight_grads(x, h, dy, dh)


VARIANTS = {
    "one pass, M = 16": one_pass,
    "2 chunks: passes and weight grads per chunk": per_chunk,
    "2 chunks, weight grads block by block": per_chunk_by_block,
    "2 chunks, weight grads as one batched dot": per_chunk_batched,
    "passes at M = 16, weight grads per chunk": passes_once_grads_per_chunk,
    "passes per chunk, weight grads at M = 16": passes_per_chunk_grads_once,
}


def split_table(width: int, hidden: int, repeats: int) -> list[list[str]]:
    mesh = jax.make_mesh(MESH_SHAPE, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    w1 = jax.device_put(
        rng.normal(size=(width, hidden)).astype(np.float32) / np.sqrt(width),
        NamedSharding(mesh, P(None, "model")),
    )
    w2 = jax.device_put(
        rng.normal(size=(hidden, width)).astype(np.float32) / np.sqrt(hidden),
        NamedSharding(mesh, P("model", None)),
    )
    x = jax.device_put(
        rng.normal(size=(BATCH, width)).astype(np.float32), NamedSharding(mesh, P("data"))
    )
    specs = dict(
        mesh=mesh,
        in_specs=(P("data"), P(None, "model"), P("model", None)),
        out_specs=(P(None, "model"), P("model", None)),
        check_vma=False,
    )
    programs = {name: jax.jit(jax.shard_map(f, **specs)) for name, f in VARIANTS.items()}
    results = common.compare(
        {name: (lambda p=p: p(x, w1, w2)) for name, p in programs.items()},
        baseline="one pass, M = 16", repeats=repeats, inner=1,
    )  # fmt: skip
    return [[r.name, f"{r.median_s * 1e3:.0f} ms", common.ratio_cell(r)] for r in results]


def rows_table(width: int, hidden: int) -> list[list[str]]:
    """Per dot shape: the row counts M whose dot gives the first 8 rows the bits of M = 8."""
    rng = np.random.default_rng(1)
    dot = jax.jit(jnp.matmul)
    out = []
    for k, n in [(width, hidden // 2), (hidden // 2, width)]:
        x = rng.normal(size=(BATCH, k)).astype(np.float32)
        w = rng.normal(size=(k, n)).astype(np.float32)
        at = {m: np.asarray(dot(x[:m], w)) for m in (1, 2, 4, 8, 16, 32, 64)}
        same = [m for m in at if np.array_equal(at[m][:1], at[8][:1])]
        full = [m for m in at if m >= CHUNK and np.array_equal(at[m][:CHUNK], at[8])]
        out.append([f"({k} x {n})", ", ".join(map(str, same)), ", ".join(map(str, full))])
    return out


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    width, hidden, repeats = (64, 256, 2) if args.quick else (1024, 4096, 21)
    split = split_table(width, hidden, repeats)
    split_header = ["one program per group", "median", "time / one pass's (rounds)"]
    common.print_table("two chunks of 8 rows in one program", split_header, split)
    rows = rows_table(width, hidden)
    rows_header = [
        "weight (k x n)", "M whose row 0 has M = 8's bits", "M whose first 8 rows have M = 8's bits",
    ]  # fmt: skip
    common.print_table("are XLA:CPU's dots row-invariant?", rows_header, rows)
    if common.should_write(args):
        body = (
            f"MLP {width} -> {hidden} -> {width}, batch {BATCH}, (data, model) = {MESH_SHAPE}: "
            f"each group's 16 rows as one pass or as two chunks of {CHUNK}, by hand in "
            f"`jax.shard_map`, one jitted program each; median of {repeats} alternating "
            "rounds.\n\n"
            + common.markdown_table(split_header, split)
            + "\n\nA row of `x @ w` at M rows against the same row at M = 8 (bitwise mode's "
            "chunk here):\n\n" + common.markdown_table(rows_header, rows)
        )
        print("wrote", common.write_table("benchmarks.md", "chunk-split", body))


if __name__ == "__main__":
    main()
