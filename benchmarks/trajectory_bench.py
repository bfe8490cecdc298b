"""Default-mode trajectories across schedules vs a plain jitted step's, on an lm1b-like model.

An lm1b-like Flax model (shared embedding as the output layer, fixed sinusoidal
positions, pre-LayerNorm blocks, attention without biases, a ReLU MLP, dropout
on the residual branches and the attention weights, a token-weighted loss with
padding) is trained for ``--steps`` AdamW steps (lm1b's optimizer settings) on
three schedules of the same global batch: one device, ``data=8`` (FSDP) and
``(data=4, model=2)`` (FSDP + tensor parallel). For each dropout seed, the
table gives the largest per-array relative L2 distance ``|a - b| / |b|`` between
a schedule's final params and the one-device run's, for:

* ``unsplit``: ``unsplit.value_and_grad(loss, weighted=True, mesh=...)``, default mode;
* ``jit, same keys``: ``jax.jit(jax.value_and_grad(batched_loss))`` where
  ``batched_loss`` vmaps the same one-example loss with the same per-example
  keys (``unsplit.example_keys``): the same dropout masks, the same function;
* ``jit, Flax``: the original Flax step, the model on the whole batch with one
  key and Flax's ``nn.Dropout`` (other masks: compared only with itself).

Each step is given the same params and shardings in every column; the
optimizer update is the same jitted ``optax`` call. Run:
``python benchmarks/trajectory_bench.py`` (``--quick`` for a smoke run that does
not touch the docs).
"""

from __future__ import annotations

import common
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit import linen as ulinen

VOCAB, LENGTH, WIDTH, HEADS, LAYERS, MLP, BATCH = 256, 32, 64, 4, 2, 256, 16


def sinusoidal(length: int, width: int) -> np.ndarray:
    pos = np.arange(length)[:, None]
    div = np.exp(np.arange(0, width, 2) * -(np.log(10000.0) / width))
    table = np.zeros((length, width), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
    return table


class Block(nn.Module):
    dropout_cls: type
    attention_fn: object

    @nn.compact
    def __call__(self, x, *, train: bool):
        causal = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=HEADS,
            use_bias=False,  # as lm1b
            dropout_rate=0.1,
            deterministic=not train,
            attention_fn=self.attention_fn,
        )(h, h, mask=causal)
        x = x + self.dropout_cls(0.1, deterministic=not train)(h)
        h = nn.LayerNorm()(x)
        h = nn.relu(nn.Dense(MLP)(h))
        h = self.dropout_cls(0.1, deterministic=not train)(h)
        h = nn.Dense(WIDTH)(h)
        return x + self.dropout_cls(0.1, deterministic=not train)(h)


class LM(nn.Module):
    """lm1b's decoder in small: ``tokens int[L]`` (or ``int[B, L]``) -> logits."""

    dropout_cls: type = ulinen.Dropout
    attention_fn: object = ulinen.dot_product_attention

    @nn.compact
    def __call__(self, tokens, *, train: bool = True):
        embed = nn.Embed(VOCAB, WIDTH, embedding_init=nn.initializers.normal(1.0))
        x = embed(tokens) + sinusoidal(LENGTH, WIDTH)[: tokens.shape[-1]]
        x = self.dropout_cls(0.1, deterministic=not train)(x)
        for _ in range(LAYERS):
            x = Block(self.dropout_cls, self.attention_fn)(x, train=train)
        x = nn.LayerNorm()(x)
        return embed.attend(x) / np.sqrt(WIDTH).astype(np.float32)


def token_loss(model):
    """One example's ``(sum of token losses, number of tokens)``; padding (target 0) weighs 0."""

    def loss_fn(params, example, key):
        logits = model.apply({"params": params}, example["inputs"], rngs={"dropout": key})
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, example["targets"])
        weights = (example["targets"] > 0).astype(jnp.float32)
        return jnp.sum(nll * weights), jnp.sum(weights)

    return loss_fn


def batches(seed: int, steps: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(1, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
        lengths = rng.integers(LENGTH // 4, LENGTH + 1, BATCH)
        tokens[np.arange(LENGTH + 1)[None, :] > lengths[:, None]] = 0  # padding
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def specs(params, tp: bool):
    """FSDP over ``data`` (each matrix's largest free dim), Megatron TP over ``model``."""

    def spec(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        entries = [None] * x.ndim
        if tp and any(n.startswith("MultiHead") for n in names):
            entries[-2 if names[-2] in ("query", "key", "value") else 0] = "model"
        elif tp and names[-2] == "Dense_0":  # column-parallel up projection
            entries[-1] = "model"
        elif tp and names[-2:] == ["Dense_1", "kernel"]:  # row-parallel down projection
            entries[0] = "model"
        if x.ndim >= 2:
            free = [i for i in range(x.ndim) if entries[i] is None and x.shape[i] % 8 == 0]
            if free:
                entries[max(free, key=lambda i: x.shape[i])] = "data"
        return P(*entries)

    return jax.tree_util.tree_map_with_path(spec, params)


SCHEDULES = {
    "data=8 FSDP": ((8,), ("data",)),
    "data=4 x model=2 FSDP+TP": ((4, 2), ("data", "model")),
}


def make_run(kind: str, schedule: str | None, params0):
    """``run(seed, steps)``: final params (and every step's grads) after ``steps`` AdamW steps
    of ``kind`` on ``schedule`` (None: one device). Compiled once, for every seed."""
    model = LM()
    loss_fn = token_loss(model)
    if schedule is None:
        mesh, device = None, jax.devices()[0]
        params_in = jax.device_put(params0, device)

        def put_batch(b):
            return jax.device_put(b, device)
    else:
        shape, names = SCHEDULES[schedule]
        mesh = jax.make_mesh(
            shape,
            names,
            axis_types=(jax.sharding.AxisType.Auto,) * len(names),
            devices=jax.devices()[: int(np.prod(shape))],
        )
        param_specs = specs(params0, tp="model" in names)
        params_in = jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params0, param_specs
        )

        def put_batch(b):
            return jax.device_put(b, NamedSharding(mesh, P("data")))

    if kind == "unsplit":
        axes = None if mesh is None else "data"
        step = unsplit.value_and_grad(loss_fn, weighted=True, mesh=mesh, batch_axes=axes)
    else:
        if kind == "jit, same keys":

            def batched_loss(p, batch, key):
                keys = unsplit.example_keys(key, jnp.arange(BATCH))
                sums, weights = jax.vmap(loss_fn, in_axes=(None, 0, 0))(p, batch, keys)
                return jnp.sum(sums) / jnp.sum(weights)
        else:
            flax_model = LM(nn.Dropout, nn.dot_product_attention)

            def batched_loss(p, batch, key):
                logits = flax_model.apply({"params": p}, batch["inputs"], rngs={"dropout": key})
                nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
                weights = (batch["targets"] > 0).astype(jnp.float32)
                return jnp.sum(nll * weights) / jnp.sum(weights)

        out = None
        if mesh is not None:
            out = (NamedSharding(mesh, P()), jax.tree.map(lambda x: x.sharding, params_in))
        step = jax.jit(jax.value_and_grad(batched_loss), out_shardings=out)
    tx = optax.adamw(1e-3, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)  # lm1b's

    @jax.jit
    def update(params, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run(seed: int, steps: int) -> dict:
        params, opt_state = params_in, tx.init(params_in)
        grads_seen = []
        for i, batch in enumerate(batches(seed, steps)):
            key = jax.random.fold_in(jax.random.key(seed), i)
            _, grads = step(params, put_batch(batch), key)
            grads_seen.append(jax.tree.map(np.asarray, grads))
            params, opt_state = update(params, grads, opt_state)
        return {"params": jax.tree.map(np.asarray, params), "grads": grads_seen}

    return run


def rel_l2(a, b) -> float:
    """Largest per-array relative L2 distance between two pytrees."""
    dists = jax.tree.map(
        lambda x, y: float(np.linalg.norm((x - y).ravel()) / max(np.linalg.norm(y.ravel()), 1e-30)),
        a,
        b,
    )
    return max(jax.tree.leaves(dists))


KINDS = ("unsplit", "jit, same keys", "jit, Flax")


def measure(seeds, steps: int) -> list[dict]:
    params0 = LM().init(jax.random.key(0), jnp.zeros((LENGTH,), jnp.int32), train=False)["params"]
    results = {}
    for kind in KINDS:
        for schedule in (None, *SCHEDULES):
            run = make_run(kind, schedule, params0)
            results[(kind, schedule)] = [run(seed, steps) for seed in seeds]
            print(f"ran {kind} on {schedule or '1 device'}", flush=True)
    rows = []
    for kind in KINDS:
        for schedule in SCHEDULES:
            for i, seed in enumerate(seeds):
                ref, got = results[(kind, None)][i], results[(kind, schedule)][i]
                same = results[("jit, same keys", schedule)][i]
                rows.append(
                    {
                        "seed": seed,
                        "kind": kind,
                        "schedule": schedule,
                        "params": rel_l2(got["params"], ref["params"]),
                        "grads0": rel_l2(got["grads"][0], ref["grads"][0]),
                        "zeros0": zero_mismatch(got["grads"][0], ref["grads"][0]),
                        "worst": worst(got["params"], ref["params"]),
                        "as_control": identical(got["params"], same["params"]),
                    }
                )
                print(rows[-1], flush=True)
    return rows


def worst(a, b) -> str:
    flat = jax.tree_util.tree_flatten_with_path(a)[0]
    dists = [rel_l2(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return jax.tree_util.keystr(flat[int(np.argmax(dists))][0])


def zero_mismatch(a, b) -> int:
    """Elements whose gradient is exactly 0 in one run and not in the other."""
    return sum(
        int(np.sum((x == 0) != (y == 0)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def identical(a, b) -> bool:
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per schedule and seed, the three kinds side by side."""
    header = [
        "schedule",
        "seed",
        "unsplit",
        "jit, same keys",
        "unsplit == jit, same keys (bits)",
        "jit, Flax",
        "step 1 grads (unsplit)",
        "step 1 grads exactly 0 in one run only",
        "worst array (unsplit)",
    ]
    by = {(r["kind"], r["schedule"], r["seed"]): r for r in rows}
    lines = []
    for schedule in SCHEDULES:
        for seed in sorted({r["seed"] for r in rows}):
            u, j, f = (by[(k, schedule, seed)] for k in KINDS)
            lines.append(
                [
                    schedule,
                    str(seed),
                    f"{u['params']:.1e}",
                    f"{j['params']:.1e}",
                    "yes" if u["as_control"] else "no",
                    f"{f['params']:.1e}",
                    f"{u['grads0']:.1e}",
                    str(u["zeros0"]),
                    f"`{u['worst']}`",
                ]
            )
    return header, lines


def main() -> None:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    seeds = range(2 if args.quick else args.seeds)
    header, lines = table(measure(seeds, 2 if args.quick else args.steps))
    title = "max per-array relative L2 of the final params vs the same kind on one device"
    common.print_table(title, header, lines, width=200)
    if common.should_write(args):
        common.write_table("rule.md", "trajectory", common.markdown_table(header, lines))


if __name__ == "__main__":
    main()
