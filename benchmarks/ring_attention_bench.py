"""unsplit.ring_attention vs haoliuhl's ringattention at the same sequence degree.

Causal attention of one example (L positions, 4 heads of 64) split over S = 1, 2, 4, 8 of
the 8 simulated CPU devices (a ``seq`` mesh axis), each called inside ``jax.shard_map`` as
ringattention's README calls its ring (tiles of 128 queries x 128 keys on both sides, no
dropout): the forward and backward pass (``jax.value_and_grad`` of ``sum(out**2)``), timed
side by side, and XLA's compiled temp memory per device next to the size of one device's
``(L / S) x L`` score matrix (what a ring never forms). Also unsplit's ring with dropout
0.1 (what its masks cost). ringattention (PyPI, not a dependency) is loaded from its own
module when installed (its ``__init__`` calls ``jax.lib.xla_bridge``, gone in JAX 0.10);
without it, its rows say so. Writes docs/benchmarks.md (marker ``ring-attention``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib

import common  # first: it sets the 8 simulated CPU devices before JAX starts
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import unsplit

DOC, MARKER = "benchmarks.md", "ring-attention"
HEADS, DEPTH, RATE = 4, 64, 0.1


@dataclasses.dataclass(frozen=True)
class Setup:
    length: int
    block: int
    degrees: tuple[int, ...]
    repeats: int


FULL = Setup(length=2048, block=128, degrees=(1, 2, 4, 8), repeats=7)
QUICK = Setup(length=256, block=32, degrees=(1, 4), repeats=2)


def theirs():
    """ringattention's JAX ring (what ``ringattention.ringattention`` is on CPU), or None."""
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ringattention_jax.py"
    module_spec = importlib.util.spec_from_file_location("ringattention_jax", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.ring_attention


def rings(setup: Setup, degree: int) -> dict:
    """The attentions to compare, each a function of (q, k, v) on [1, L, heads, depth]."""
    mesh = jax.make_mesh(
        (degree,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:degree]
    )
    spec = P(None, "seq", None, None)

    def region(fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)

    ours = functools.partial(
        unsplit.ring_attention, axis_name="seq", is_causal=True, block_size=setup.block
    )
    out = {
        "unsplit": region(ours),
        "unsplit, dropout 0.1": region(
            lambda q, k, v: ours(q, k, v, dropout_rng=jax.random.key(1), dropout_rate=RATE)
        ),
    }
    ring = theirs()
    if ring is not None:
        options = dict(
            causal_block_size=1, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
            query_chunk_size=setup.block, key_chunk_size=setup.block,
            policy=jax.checkpoint_policies.nothing_saveable, dtype=jnp.float32,
            precision=None, prevent_cse=True,
        )  # fmt: skip
        out["ringattention"] = region(
            lambda q, k, v: ring(q, k, v, None, None, None, "seq", True, options)
        )
    return out


def fwd_bwd(attention):
    return jax.jit(
        jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v) ** 2), argnums=(0, 1, 2))
    )


def rows(setup: Setup) -> list[list[str]]:
    q, k, v = (
        jax.random.normal(jax.random.key(i), (1, setup.length, HEADS, DEPTH)) for i in range(3)
    )
    table = []
    for degree in setup.degrees:
        programs = {name: fwd_bwd(fn) for name, fn in rings(setup, degree).items()}
        temp = {
            name: p.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
            for name, p in programs.items()
        }
        baseline = "ringattention" if "ringattention" in programs else "unsplit"
        results = common.compare(
            {name: functools.partial(p, q, k, v) for name, p in programs.items()},
            baseline=baseline,
            repeats=setup.repeats,
        )
        scores = setup.length // degree * setup.length * HEADS * 4
        for r in results:
            table.append(
                [
                    str(degree),
                    r.name,
                    f"{r.median_s * 1e3:.0f} ms",
                    common.ratio_cell(r) if baseline == "ringattention" else "- (not installed)",
                    f"{r.cpu_ratio_median:.2f}x" if baseline == "ringattention" else "-",
                    f"{temp[r.name] / 2**20:.1f} MiB",
                    f"{scores / 2**20:.1f} MiB",
                ]
            )
    return table


HEADER = [
    "S (devices on seq)",
    "attention",
    "fwd+bwd median",
    "time / ringattention's: median (min-max)",
    "CPU time / ringattention's",
    "temp memory per device",
    "one (L/S) x L score matrix (float32)",
]


def render(table: list[list[str]], setup: Setup) -> str:
    return (
        "### Ring attention: unsplit.ring_attention vs ringattention\n\n"
        f"One example of L={setup.length} positions, {HEADS} heads of {DEPTH}, float32, "
        f"causal, split over S of the 8 simulated CPU devices (they share this machine's "
        f"cores: S shows the ring's overhead, not a speed-up); both rings in `jax.shard_map` "
        f"over `seq`, tiles of {setup.block} x {setup.block}, `jax.value_and_grad` of "
        f"`sum(out**2)` in one jitted program; {setup.repeats} alternating rounds, ratios "
        "per round to ringattention 0.1.2's (haoliuhl's, PyPI), dropout off on both (goal: "
        "<= 1.2x). unsplit's masks and bits are the same at every S: its partials wait in "
        "one slot per shard (`S * (L/S) * heads * depth` floats per device) and are merged "
        "in a fixed tree, where ringattention folds them as they arrive. Memory: XLA's "
        "compiled temp bytes per device, next to a `(L/S) x L` score matrix (neither ring "
        "forms one).\n\n"
        f"{common.markdown_table(HEADER, table)}\n"
    )


def main(argv: list[str] | None = None) -> None:
    args = common.bench_parser(__doc__).parse_args(argv)
    setup = QUICK if args.quick else FULL
    table = rows(setup)
    common.print_table("ring attention: fwd+bwd", HEADER, table, width=180)
    if common.should_write(args):
        print(f"wrote {common.write_table(DOC, MARKER, render(table, setup))}")


if __name__ == "__main__":
    main()
