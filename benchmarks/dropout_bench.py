"""Dropout: unsplit's layers vs Flax's, as the layer alone and inside a transformer train step.

Two tables, every figure a ratio measured side by side in one run
(``common.compare``: alternating rounds, median with min and max):

* **dropout-layer**: ``unsplit.linen.Dropout`` vs ``flax.linen.Dropout`` and
  ``unsplit.nnx.Dropout`` vs ``flax.nnx.Dropout`` (rate 0.1) on a
  ``(64, 128, 512)`` float32 input, each pair timed against each other:
  *forward* (``y``) and *forward+backward* (``y`` and ``dx`` from ``jax.vjp``
  with a given cotangent), each jitted, plus XLA's compiled temp memory
  (``compiled.memory_analysis()``). Goal: fwd+bwd <= 0.5x, memory <= Flax.
* **transformer-block**: a train step (gradient of a loss w.r.t. the
  parameters) of the test transformer's ``Block`` and of the whole
  ``Transformer`` with both dropouts unsplit's (``dropout_cls=unsplit.linen.Dropout``,
  ``attention_fn=unsplit.linen.dot_product_attention``) vs both Flax's
  (``nn.Dropout``, ``nn.dot_product_attention``): the model on a whole batch
  with one key (the usual Flax call), and ``unsplit.value_and_grad``
  (per-example vmap, one key per example). Goal: <= 0.8x.

Run: ``python benchmarks/dropout_bench.py`` (``--quick`` for a smoke run that
does not touch the docs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import common
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import unsplit
from unsplit import linen as ulinen
from unsplit import nnx as unnx
from unsplit.models import (
    Block,
    Transformer,
    TransformerConfig,
    init_params,
    synthetic_batch,
    token_loss,
)

DOC = "benchmarks.md"
RATE = 0.1
FLAX = {"dropout_cls": nn.Dropout, "attention_fn": nn.dot_product_attention}
UNSPLIT = {"dropout_cls": ulinen.Dropout, "attention_fn": ulinen.dot_product_attention}


@dataclasses.dataclass(frozen=True)
class Setup:
    shape: tuple[int, ...]
    config: TransformerConfig
    batch: int
    repeats: int
    inner: int
    warmup: int


FULL = Setup(
    shape=(64, 128, 512),
    config=TransformerConfig(vocab=256, length=64, width=128, heads=4, layers=2),
    batch=16,
    repeats=31,
    inner=3,
    warmup=2,
)
QUICK = Setup(
    shape=(8, 16, 64),
    config=TransformerConfig(),
    batch=4,
    repeats=3,
    inner=1,
    warmup=1,
)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def layer_fns() -> dict[str, Callable]:
    """``fn(key, x) -> y`` for each layer, the key given at call time."""
    flax_linen, our_linen = (
        nn.Dropout(RATE, deterministic=False),
        ulinen.Dropout(RATE, deterministic=False),
    )
    flax_nnx, our_nnx = nnx.Dropout(RATE), unnx.Dropout(RATE)
    return {
        "flax.linen.Dropout": lambda key, x: flax_linen.apply({}, x, rngs={"dropout": key}),
        "unsplit.linen.Dropout": lambda key, x: our_linen.apply({}, x, rngs={"dropout": key}),
        "flax.nnx.Dropout": lambda key, x: flax_nnx(x, rngs=key),
        "unsplit.nnx.Dropout": lambda key, x: our_nnx(x, rngs=key),
    }


def fwd_bwd(fn: Callable) -> Callable:
    def run(key, x, ct):
        y, vjp = jax.vjp(lambda x: fn(key, x), x)
        return y, vjp(ct)[0]

    return run


def layer_rows(setup: Setup) -> list[list[str]]:
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), setup.shape)
    ct = jax.random.normal(jax.random.key(2), setup.shape)
    fns = layer_fns()
    rows = []
    for api in ("linen", "nnx"):
        theirs, ours = f"flax.{api}.Dropout", f"unsplit.{api}.Dropout"
        for mode, wrap, args in (
            ("fwd", lambda f: f, (key, x)),
            ("fwd+bwd", fwd_bwd, (key, x, ct)),
        ):
            progs = {name: jax.jit(wrap(fns[name])) for name in (theirs, ours)}
            results = common.compare(
                {name: (lambda p=p, a=args: p(*a)) for name, p in progs.items()},
                baseline=theirs,
                repeats=setup.repeats,
                inner=setup.inner,
                warmup=setup.warmup,
            )
            mem = {name: common.compiled_temp_bytes(wrap(fns[name]), *args) for name in progs}
            ratio = next(r for r in results if r.name == ours)
            base = next(r for r in results if r.name == theirs)
            rows.append(
                [
                    f"{ours} vs {theirs}",
                    mode,
                    common.ratio_cell(ratio),
                    f"{mib(mem[ours])} vs {mib(mem[theirs])}",
                    f"{ratio.median_s * 1e3:.1f} vs {base.median_s * 1e3:.1f} ms",
                ]
            )
    return rows


def block_step(config: TransformerConfig, dropouts: dict, batch: int):
    """grad w.r.t. the params of mean(Block(x)**2), the block on a whole batch, one key."""
    block = Block(config, **dropouts)
    x = jax.random.normal(jax.random.key(3), (batch, config.length, config.width))
    params = jax.jit(lambda: block.init(jax.random.key(0), x, train=False))()

    def loss(params, x, key):
        return jnp.mean(block.apply(params, x, train=True, rngs={"dropout": key}) ** 2)

    return jax.value_and_grad(loss), (params, x, jax.random.key(1))


def batch_step(config: TransformerConfig, dropouts: dict, batch: int):
    """value_and_grad of the mean token loss, the model on a whole batch, one key (usual Flax)."""
    model = Transformer(config, **dropouts)
    params = init_params(model)
    data = synthetic_batch(config, batch, seed=1)

    def loss(params, data, key):
        logits = model.apply({"params": params}, data["inputs"], rngs={"dropout": key})
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, data["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * data["mask"]) / jnp.sum(data["mask"])

    return jax.value_and_grad(loss), (params, data, jax.random.key(1))


def unsplit_step(config: TransformerConfig, dropouts: dict, batch: int):
    """unsplit.value_and_grad of the weighted token loss: one key per example, vmapped."""
    model = Transformer(config, **dropouts)
    step = unsplit.value_and_grad(token_loss(model), weighted=True)
    return step, (init_params(model), synthetic_batch(config, batch, seed=1), jax.random.key(1))


def transformer_rows(setup: Setup) -> list[list[str]]:
    c, b = setup.config, setup.batch
    steps = {
        f"Block train step, batch ({b}, {c.length}, {c.width}), one key": block_step,
        f"Transformer train step, batch {b}, one key": batch_step,
        f"Transformer, unsplit.value_and_grad, batch {b}, a key per example": unsplit_step,
    }
    rows = []
    for label, make in steps.items():
        flax_fn, flax_args = make(c, FLAX, b)
        our_fn, our_args = make(c, UNSPLIT, b)
        progs = {"flax": (jax.jit(flax_fn), flax_args), "unsplit": (jax.jit(our_fn), our_args)}
        results = common.compare(
            {name: (lambda p=p, a=a: p(*a)) for name, (p, a) in progs.items()},
            baseline="flax",
            repeats=setup.repeats,
            inner=setup.inner,
            warmup=setup.warmup,
        )
        mem_flax = common.compiled_temp_bytes(flax_fn, *flax_args)
        mem_ours = common.compiled_temp_bytes(our_fn, *our_args)
        ours, base = results[1], results[0]
        rows.append(
            [
                label,
                common.ratio_cell(ours),
                f"{mib(mem_ours)} vs {mib(mem_flax)}",
                f"{ours.median_s * 1e3:.0f} vs {base.median_s * 1e3:.0f} ms",
            ]
        )
    return rows


LAYER_HEADER = ["layers", "pass", "time ratio: median (min-max)", "temp memory", "median times"]
BLOCK_HEADER = [
    "train step",
    "time: unsplit / flax",
    "temp memory: unsplit vs flax",
    "median times",
]


def render_layer(rows, setup: Setup) -> str:
    return (
        f"### Dropout layer: unsplit vs Flax (rate {RATE}, input {setup.shape} float32)\n\n"
        "Each pair timed side by side; ratio = unsplit's time / Flax's within each round "
        "(goal: fwd+bwd <= 0.50x). *fwd+bwd* is `jax.vjp` returning `y` and `dx` for a given "
        "cotangent, in one jitted program. Memory: XLA compiled temp bytes, unsplit vs Flax "
        "(goal: not more). Absolute times are for scale only.\n\n"
        f"{common.markdown_table(LAYER_HEADER, rows)}\n"
    )


def render_block(rows, setup: Setup) -> str:
    c = setup.config
    return (
        "### Transformer train step: unsplit's dropouts vs Flax's\n\n"
        f"The test transformer (`TransformerConfig(vocab={c.vocab}, length={c.length}, "
        f"width={c.width}, heads={c.heads}, layers={c.layers})`, dropout {c.dropout}, attention "
        f"dropout {c.attention_dropout}) with both dropouts swapped: `dropout_cls=` "
        "`unsplit.linen.Dropout` vs `nn.Dropout` (residual and MLP dropout) and `attention_fn=` "
        "`unsplit.linen.dot_product_attention` vs `nn.dot_product_attention` (attention-weight "
        "dropout, `broadcast_dropout=True` as `nn.MultiHeadDotProductAttention` defaults). "
        "Ratio = unsplit's step time / Flax's within each round (goal: <= 0.8x).\n\n"
        f"{common.markdown_table(BLOCK_HEADER, rows)}\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(__doc__)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    write = common.should_write(args)
    rows = layer_rows(setup)
    common.print_table("dropout layer: unsplit vs flax", LAYER_HEADER, rows, width=160)
    if write:
        print(f"wrote {common.write_table(DOC, 'dropout-layer', render_layer(rows, setup))}")
    rows = transformer_rows(setup)
    common.print_table(
        "transformer train step: unsplit vs flax dropouts", BLOCK_HEADER, rows, width=160
    )
    if write:
        print(f"wrote {common.write_table(DOC, 'transformer-block', render_block(rows, setup))}")


if __name__ == "__main__":
    main()
