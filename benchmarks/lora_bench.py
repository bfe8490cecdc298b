"""LoRA with a frozen FSDP base: unsplit's step and train step next to a plain ``jax.jit`` one.

Eight devices, mesh ``("data",)``. A small LoRA model: a residual MLP of
``layers`` blocks over ``tokens``-token examples whose weights (the base) are
frozen and sharded FSDP over ``data`` (each matrix's first dimension), and
rank-8 adapters on every matrix (replicated), the only trained params.
Dropout on the hidden units. Side by side in alternating rounds, with the
same shardings (batch over ``data``, base FSDP, adapters replicated):

* ``plain``: ``jax.jit(jax.value_and_grad(batched_loss))`` of the mean loss
  over the global batch, the base an argument that is not differentiated
  (``argnums=0``): the baseline;
* ``unsplit``: ``unsplit.value_and_grad(loss_fn)(adapters, batch, key,
  frozen=base)`` (default mode);
* the train steps: ``plain`` above plus an AdamW update of the adapters in one
  donated ``jax.jit``, against ``unsplit.train_step(step, adamw)(adapters,
  opt_state, batch, key, frozen=base)``.

Reported: time / plain (median of the rounds' ratios, min-max) and XLA's
compiled memory per device (arguments + outputs + temp, ``memory_analysis()``
of ``step.lower(...).compile()`` and of ``jax.jit(train).lower(...)``) /
plain's. Goal: <= 1.1x each.

A second table, where the frozen base dominates (``FROZEN_DOMINATED``): an NNX model of
``nnx.LoRALinear`` layers (a 1024 x 1024 base each, replicated, rank 8, dropout) split
with ``nnx.split(model, nnx.LoRAParam, ...)``, batch 64 over 8 devices, Adam, the
recommended loop (``train(lora, opt_state, batch, key, step=i, frozen=base)``). Its
train steps side by side: the original trainer (``nnx.jit`` of the tutorial's step with
an ``nnx.Optimizer`` on ``nnx.LoRAParam``), the user's own ``jax.jit`` train step (per-example
keys, the base an argument) and unsplit's in default and bitwise mode (goal: bitwise <= 1.3x
both); memory per device of each mode's step (``benchmarks/common.step_memory``: XLA's
analysis; bitwise mode's is its peak over all its programs) next to the plain step's (goal:
bitwise <= default + the adapters' sums). A last row, for comparison: bitwise mode with its
CPU programs compiled as XLA fuses them (the library's measuring switch
``UNSPLIT_BENCH_CPU_DEFAULT_LEVEL=1``: no product rounded on its own, XLA's own ``exp``;
bits then held across data degrees, not across model-parallel degrees), so the table shows
what exact elementwise code costs on CPU.

Run: ``python benchmarks/lora_bench.py`` (``--quick``: smaller, docs untouched). The tables
go to docs/benchmarks.md.
"""

from __future__ import annotations

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit

MARKER = "lora"
DOC = "benchmarks.md"
RANK = 8


def problem(mesh, batch: int, tokens: int, width: int, hidden: int, layers: int):
    rng = np.random.default_rng(0)

    def matrix(a, b, scale=1.0):
        return (scale * rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)

    fsdp = NamedSharding(mesh, P("data", None))
    replicated = NamedSharding(mesh, P())
    base, adapters = [], []
    for _ in range(layers):
        base.append({"up": matrix(width, hidden), "down": matrix(hidden, width)})
        adapters.append(
            {
                "up_a": matrix(width, RANK),
                "up_b": matrix(RANK, hidden, 0.01),
                "down_a": matrix(hidden, RANK),
                "down_b": matrix(RANK, width, 0.01),
            }
        )
    base = jax.device_put(base, fsdp)
    adapters = jax.device_put(adapters, replicated)
    data = {
        "x": rng.normal(size=(batch, tokens, width)).astype(np.float32),
        "y": rng.normal(size=(batch, tokens, width)).astype(np.float32),
    }
    data = jax.device_put(data, NamedSharding(mesh, P("data")))
    return adapters, base, data


def loss_fn(adapters, example, key, base):
    """ONE example: residual MLP blocks, each matrix its frozen base plus a low-rank adapter."""
    h = example["x"]
    for i, (w, a) in enumerate(zip(base, adapters, strict=True)):
        up = h @ w["up"] + (h @ a["up_a"]) @ a["up_b"]
        up = unsplit.dropout(jax.random.fold_in(key, i), jax.nn.gelu(up), 0.1)
        h = h + up @ w["down"] + (up @ a["down_a"]) @ a["down_b"]
    return jnp.mean((h - example["y"]) ** 2)


def batched_loss(adapters, batch, key, base):
    keys = unsplit.example_keys(key, jnp.arange(batch["x"].shape[0]))
    losses = jax.vmap(loss_fn, in_axes=(None, 0, 0, None))(adapters, batch, keys, base)
    return jnp.mean(losses)


def measure(mesh, config, repeats: int) -> list[list[str]]:
    name, batch, tokens, width, hidden, layers = config
    adapters, base, data = problem(mesh, batch, tokens, width, hidden, layers)
    key = jax.random.key(3)
    optimizer = optax.adamw(1e-3)

    plain = jax.jit(jax.value_and_grad(batched_loss))
    step = unsplit.value_and_grad(loss_fn, mesh=mesh)

    def plain_train_fn(params, opt_state, batch, key, frozen):
        loss, grads = jax.value_and_grad(batched_loss)(params, batch, key, frozen)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    plain_train = jax.jit(plain_train_fn, donate_argnums=(0, 1))
    train = unsplit.train_step(step, optimizer)

    def threaded(fn):
        """A train function called with its own last outputs (they are donated)."""
        copy = jax.tree.map(jnp.copy, adapters)
        state = [copy, optimizer.init(copy)]

        def run():
            loss, state[0], state[1] = fn(state[0], state[1], data, key, frozen=base)
            return loss

        return run

    candidates = {
        "plain": lambda: plain(adapters, data, key, base),
        "unsplit": lambda: step(adapters, data, key, frozen=base),
        "plain train": threaded(plain_train),
        "unsplit train": threaded(train),
    }
    steps = common.compare(
        {n: candidates[n] for n in ("plain", "unsplit")}, baseline="plain", repeats=repeats
    )
    trains = common.compare(
        {n: candidates[n] for n in ("plain train", "unsplit train")},
        baseline="plain train",
        repeats=repeats,
    )
    opt_state = optimizer.init(adapters)
    memory = {
        "plain": plain.lower(adapters, data, key, base).compile(),
        "unsplit": step.lower(adapters, data, key, frozen=base).compile(),
        "plain train": plain_train.lower(adapters, opt_state, data, key, base).compile(),
        "unsplit train": jax.jit(lambda p, o, b, k, f: train(p, o, b, k, frozen=f))
        .lower(adapters, opt_state, data, key, base)
        .compile(),
    }
    memory = {n: common.compiled_bytes(c) for n, c in memory.items()}
    ratios = {"unsplit": steps[1], "unsplit train": trains[1]}
    baselines = {"unsplit": "plain", "unsplit train": "plain train"}
    rows = []
    for n in ("unsplit", "unsplit train"):
        b = baselines[n]
        rows.append(
            [
                f"{name}: {n} vs {b}",
                common.ratio_cell(ratios[n]),
                f"{memory[n] / 2**20:.1f} MiB vs {memory[b] / 2**20:.1f} MiB",
                common.times_cell(common.ratio(memory[n], memory[b])),
            ]
        )
    return rows


# (name, global batch, tokens, width, hidden, layers)
CONFIGS = [("4 blocks, 128 wide", 64, 16, 128, 512, 4)]
QUICK = [("2 blocks, 64 wide", 16, 4, 64, 128, 2)]
# The frozen-dominated model: (width, layers, batch); --quick: smaller.
FROZEN_DOMINATED, FROZEN_QUICK = (1024, 2, 64), (256, 2, 64)
DOMINATED_MARKER = "lora-frozen-dominated"
LEVEL_ROW = "bitwise train step, CPU programs as XLA fuses them"


def nnx_problem(mesh, width: int, layers: int, batch: int):
    """The NNX LoRA model, split into adapters and the frozen base (replicated), and a batch."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.LoRALinear(width, width, lora_rank=RANK, rngs=rngs) for _ in range(layers)]
            )
            self.dropout = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            for layer in self.layers:
                x = self.dropout(jax.nn.gelu(layer(x)))
            return x

    model = Model(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(batch, width)).astype(np.float32),
        "y": rng.normal(size=(batch, width)).astype(np.float32),
    }
    data = jax.device_put(data, NamedSharding(mesh, P("data")))
    return model, data


def measure_frozen_dominated(mesh, config, repeats: int) -> list[list[str]]:
    from flax import nnx

    width, layers, batch = config
    replicated = NamedSharding(mesh, P())
    model, data = nnx_problem(mesh, width, layers, batch)
    optimizer = optax.adam(1e-3)

    # The original trainer, as the LoRA tutorial writes it (its dropout from the module).
    original = nnx.Optimizer(model, optimizer, wrt=nnx.LoRAParam)

    @nnx.jit
    def original_step(model, opt, batch):
        def loss(model):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return value

    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    lora, base = jax.device_put((lora, base), replicated)

    def loss_fn(lora, example, key, base):  # ONE example; the base is frozen
        m = nnx.merge(graphdef, lora, base)
        nnx.reseed(m, default=key)  # nnx.Rngs(0): its one stream is 'default'
        return jnp.mean((m(example["x"]) - example["y"]) ** 2)

    def user_train(lora, opt_state, batch, key, step, base):  # the user's own jitted step
        key = jax.random.fold_in(key, step)

        def mean(lora):
            keys = unsplit.example_keys(key, jnp.arange(batch["x"].shape[0]))
            return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0, 0, None))(lora, batch, keys, base))

        value, grads = jax.value_and_grad(mean)(lora)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return value, optax.apply_updates(lora, updates), opt_state

    user = jax.jit(user_train, donate_argnums=(0, 1))
    steps = {
        "default": unsplit.value_and_grad(loss_fn, mesh=mesh),
        "bitwise": unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=True),
    }
    key, counter = jax.random.key(0), iter(range(10**6))

    def threaded(fn):
        state = [jax.tree.map(jnp.copy, lora)]
        state.append(jax.device_put(optimizer.init(state[0]), replicated))

        def run():
            value, state[0], state[1] = fn(state[0], state[1], data, key, next(counter))
            return value

        return run

    trains = {name: unsplit.train_step(step, optimizer) for name, step in steps.items()}
    # For comparison only: bitwise mode with its CPU programs as XLA fuses them (the
    # library's measuring switch, read when the programs compile on the first call): its
    # bits hold across data degrees and microbatches, not across model-parallel degrees.
    trains[LEVEL_ROW] = unsplit.train_step(
        unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=True), optimizer
    )
    candidates = {
        "original": lambda: original_step(model, original, data),
        "user": threaded(lambda p, o, b, k, i: user(p, o, b, k, i, base)),
        **{
            name: threaded(lambda p, o, b, k, i, t=train: t(p, o, b, k, step=i, frozen=base))
            for name, train in trains.items()
        },
    }
    with common.cpu_default_level():
        jax.block_until_ready(candidates[LEVEL_ROW]())  # compiled without the rounded products
    by_original = common.compare(candidates, baseline="original", repeats=repeats)
    by_user = common.compare(
        {n: candidates[n] for n in ("user", "default", "bitwise", LEVEL_ROW)},
        baseline="user", repeats=repeats,
    )  # fmt: skip
    ratio = {("original", r.name): r for r in by_original} | {("user", r.name): r for r in by_user}
    plain = jax.jit(jax.value_and_grad(lambda p, b, k, f: jnp.mean(
        jax.vmap(loss_fn, in_axes=(None, 0, 0, None))(
            p, b, unsplit.example_keys(k, jnp.arange(b["x"].shape[0])), f))))  # fmt: skip
    memory = {
        "plain": common.compiled_bytes(plain.lower(lora, data, key, base).compile()),
        **{n: common.step_memory(s, lora, data, key, frozen=base) for n, s in steps.items()},
    }
    base_mib = sum(x.nbytes for x in jax.tree.leaves(base)) / 2**20
    rows = []
    for name in ("default", "bitwise"):
        rows.append(
            [
                f"{name} train step (frozen base {base_mib:.0f} MiB)",
                common.ratio_cell(ratio[("original", name)]),
                common.ratio_cell(ratio[("user", name)]),
                f"{memory[name] / 2**20:.2f} MiB vs {memory['plain'] / 2**20:.2f} MiB",
            ]
        )
    rows.append(
        [
            f"{LEVEL_ROW} (for comparison: bits not kept across model-parallel degrees)",
            common.ratio_cell(ratio[("original", LEVEL_ROW)]),
            common.ratio_cell(ratio[("user", LEVEL_ROW)]),
            "-",
        ]
    )
    return rows


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    header = ["LoRA step (8 devices, base FSDP-frozen)", "time / plain (median, min-max)",
              "compiled memory per device", "memory / plain"]  # fmt: skip
    rows = []
    for config in QUICK if args.quick else CONFIGS:
        rows += measure(mesh, config, repeats=3 if args.quick else 7)
    common.print_table("frozen= vs a plain jitted LoRA step", header, rows)
    width, layers, batch = FROZEN_QUICK if args.quick else FROZEN_DOMINATED
    dominated_header = [
        f"NNX LoRA, {layers} x {width}x{width} frozen, rank {RANK}, batch {batch}, 8 devices",
        "time / original trainer (nnx.jit)", "time / the user's jax.jit step",
        "step memory per device vs plain step",
    ]  # fmt: skip
    dominated = measure_frozen_dominated(
        mesh, (width, layers, batch), repeats=3 if args.quick else 31
    )
    common.print_table("a frozen-dominated LoRA train step", dominated_header, dominated)
    if common.should_write(args):
        print(f"wrote {common.write_table(DOC, MARKER, common.markdown_table(header, rows))}")
        table = common.markdown_table(dominated_header, dominated)
        print(f"wrote {common.write_table(DOC, DOMINATED_MARKER, table)}")


if __name__ == "__main__":
    main()
