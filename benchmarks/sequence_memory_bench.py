"""Bitwise mode's activation memory per device at every sequence degree.

One attention layer over sequence-sharded examples (256 positions of width 16, dropout on,
keys and values gathered whole as the loss asks, every sum over the positions in canonical
blocks), `unsplit.value_and_grad(..., bitwise=True, chunk_size=4)` on a ``(data=1, seq=S)``
mesh of the 8 simulated CPU devices, S = 1, 2, 4, 8: the chunk program's peak per device
(``unsplit.testing.bitwise_cost``: the largest of its rows, key, ids and temp; compile only,
nothing is timed) and its ratio to S = 2's. S = 1 is computed at degree 2 on two devices
(its per-device bytes are S = 2's). The table goes into docs/benchmarks.md (marker
``sequence-memory``); docs/models.md's long-context section quotes it.

    python benchmarks/sequence_memory_bench.py           # writes the table
    python benchmarks/sequence_memory_bench.py --quick   # 64 positions, no write
"""

from __future__ import annotations

import common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import unsplit
import unsplit.testing

D = 16


def loss_fn(p, example, key):
    """Attention over one sequence-sharded example, dropout on."""
    x = jax.sharding.reshard(example["x"], P("seq", None))  # positions over "seq"
    q = x @ p["q"]
    k, v = (jax.sharding.reshard(x @ p[n], P()) for n in ("k", "v"))  # gathered whole
    attn = jax.nn.softmax(q @ k.T / np.sqrt(D).astype(np.float32), axis=-1)
    h = jax.sharding.reshard(attn @ v, P("seq", None))
    kept = unsplit.dropout(key, jnp.ones_like(h), 0.25)
    return jnp.mean(jnp.tanh(h * kept @ p["o"]) ** 2)


def peak(seq: int, length: int) -> int:
    mesh = jax.make_mesh((1, seq), ("data", "seq"), devices=jax.devices()[:seq])
    rng = np.random.default_rng(0)
    params = {k: (rng.normal(size=(D, D)) * 0.3).astype(np.float32) for k in "qkvo"}
    batch = {"x": np.ones((4, length, D), np.float32)}
    step = unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=True, chunk_size=4)
    with jax.set_mesh(mesh):
        cost = unsplit.testing.bitwise_cost(step, params, batch, jax.random.key(0))
    return cost.program_peak_bytes


def ideal(s: int) -> str:
    """The ratio 1/S predicts, to S = 2 (S = 1 runs at degree 2)."""
    return "- (computed at S = 2)" if s == 1 else common.times_cell(2 / s)


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    length = 64 if args.quick else 256
    peaks = {s: peak(s, length) for s in (1, 2, 4, 8)}
    header = ["S (devices on seq)", "chunk program peak per device", "/ S = 2's", "1/S would be"]
    rows = [
        [str(s), f"{b / 1e6:.2f} MB", common.times_cell(b / peaks[2]), ideal(s)]
        for s, b in peaks.items()
    ]
    common.print_table("bitwise activation memory per sequence degree", header, rows)
    if common.should_write(args):
        body = (
            f"One attention layer, {length} positions of width {D}, 4 examples per chunk, "
            "dropout on; `unsplit.testing.bitwise_cost`'s chunk program peak.\n\n"
            + common.markdown_table(header, rows)
        )
        print("wrote", common.write_table("benchmarks.md", "sequence-memory", body))


if __name__ == "__main__":
    main()
