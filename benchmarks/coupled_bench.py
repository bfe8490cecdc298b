"""A contrastive step with ``batch_loss``: time and memory next to what users run today.

One device, a CLIP-style dual encoder (two MLP towers with dropout, symmetric InfoNCE over
the global batch, a learnable temperature), global batch 256. Side by side in alternating
rounds:

* ``plain``: ``jax.jit(jax.value_and_grad(...))`` of the same loss over the whole batch
  (every example's activations at once): the baseline;
* ``unsplit k=1`` and ``unsplit k=8``: ``unsplit.value_and_grad(features_fn,
  batch_loss=...)`` with 1 and 8 microbatches (the features pass, the batch loss once, each
  microbatch pulled back: one extra forward);
* ``open_clip k=8``: open_clip's ``--accum-freq 8`` recipe (features of every microbatch
  without grad, then for each microbatch the whole loss again with that microbatch's
  features recomputed with grad: 8 full-loss computations).

Reported: step time / plain (goal: unsplit k=1 <= 1.4x), and XLA's compiled temp memory
(goal: unsplit k=8 <= 0.3x of unsplit k=1). Run: ``python benchmarks/coupled_bench.py``
(``--quick``: smaller, docs untouched). The table goes to docs/benchmarks.md.
"""

from __future__ import annotations

import common
import jax
import jax.numpy as jnp
import numpy as np

import unsplit

MARKER = "coupled"
DOC = "benchmarks.md"


def problem(batch: int, width: int):
    keys = jax.random.split(jax.random.key(0), 4)

    def dense(key, a, b):
        return jax.random.normal(key, (a, b)) / np.sqrt(a)

    params = {
        "a": {"w1": dense(keys[0], 64, width), "w2": dense(keys[1], width, 32)},
        "b": {"w1": dense(keys[2], 48, width), "w2": dense(keys[3], width, 32)},
        "log_t": jnp.log(jnp.float32(0.07)),
    }
    rng = np.random.default_rng(1)
    data = {
        "a": rng.normal(size=(batch, 64)).astype(np.float32),
        "b": rng.normal(size=(batch, 48)).astype(np.float32),
    }
    return params, data


def tower(p, x, key):
    h = unsplit.dropout(key, jax.nn.gelu(x @ p["w1"]), 0.1)
    z = h @ p["w2"]
    return z / jnp.linalg.norm(z)


def features_fn(params, example, key):
    ka, kb = jax.random.split(key)
    return {"a": tower(params["a"], example["a"], ka), "b": tower(params["b"], example["b"], kb)}


def batch_loss_fn(params, f):
    logits = f["a"] @ f["b"].T / jnp.exp(params["log_t"])
    labels = jnp.arange(logits.shape[0])
    return (
        -(
            jnp.mean(jax.nn.log_softmax(logits, axis=1)[labels, labels])
            + jnp.mean(jax.nn.log_softmax(logits, axis=0)[labels, labels])
        )
        / 2
    )


def plain_loss(params, batch, key):
    keys = unsplit.example_keys(key, jnp.arange(batch["a"].shape[0]))
    return batch_loss_fn(params, jax.vmap(features_fn, (None, 0, 0))(params, batch, keys))


def open_clip_step(k: int):
    """open_clip's --accum-freq k: cached features, then k full-loss recomputations."""

    def step(params, batch, key):
        keys = unsplit.example_keys(key, jnp.arange(batch["a"].shape[0]))
        chunks = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), (batch, keys))
        cached = jax.lax.stop_gradient(
            jax.lax.map(lambda c: jax.vmap(features_fn, (None, 0, 0))(params, *c), chunks)
        )

        def one(grads, j):
            def loss_j(p):
                mine = jax.vmap(features_fn, (None, 0, 0))(p, *jax.tree.map(lambda x: x[j], chunks))
                feats = jax.tree.map(lambda c, m: c.at[j].set(m), cached, mine)
                return batch_loss_fn(p, jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), feats))

            loss, g = jax.value_and_grad(loss_j)(params)
            return jax.tree.map(jnp.add, grads, g), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(one, zeros, jnp.arange(k))
        return losses[-1], jax.tree.map(lambda g: g / k, grads)

    return jax.jit(step)


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    batch, width = (64, 64) if args.quick else (256, 512)
    params, data = problem(batch, width)
    key = jax.random.key(3)
    plain = jax.jit(jax.value_and_grad(plain_loss))
    steps = {
        "plain": plain,
        "unsplit k=1": unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn),
        "unsplit k=8": unsplit.value_and_grad(
            features_fn, batch_loss=batch_loss_fn, microbatches=8
        ),
        "open_clip k=8": open_clip_step(8),
    }
    candidates = {name: (lambda s=s: s(params, data, key)) for name, s in steps.items()}
    results = {
        r.name: r
        for r in common.compare(candidates, baseline="plain", repeats=3 if args.quick else 11)
    }
    memory = {name: common.compiled_temp_bytes(s, params, data, key) for name, s in steps.items()}
    header = [f"step (batch {batch}, one device)", "time / plain (median, min-max)",
              "compiled temp memory", "memory / unsplit k=1"]  # fmt: skip
    rows = [
        [name, common.ratio_cell(results[name]), f"{memory[name] / 2**20:.1f} MiB",
         f"{memory[name] / memory['unsplit k=1']:.2f}x"]
        for name in steps
    ]  # fmt: skip
    common.print_table("batch_loss vs plain jit and open_clip's accumulation", header, rows)
    if common.should_write(args):
        body = common.markdown_table(header, rows) + "\n\n" + common.environment_line()
        print(f"wrote {common.write_table(DOC, MARKER, body)}")


if __name__ == "__main__":
    main()
