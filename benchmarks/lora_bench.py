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
plain's. Goal: <= 1.1x each. Run: ``python benchmarks/lora_bench.py``
(``--quick``: smaller, docs untouched). The table goes to docs/benchmarks.md.
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


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    header = ["LoRA step (8 devices, base FSDP-frozen)", "time / plain (median, min-max)",
              "compiled memory per device", "memory / plain"]  # fmt: skip
    rows = []
    for config in QUICK if args.quick else CONFIGS:
        rows += measure(mesh, config, repeats=3 if args.quick else 7)
    common.print_table("frozen= vs a plain jitted LoRA step", header, rows)
    if common.should_write(args):
        print(f"wrote {common.write_table(DOC, MARKER, common.markdown_table(header, rows))}")


if __name__ == "__main__":
    main()
