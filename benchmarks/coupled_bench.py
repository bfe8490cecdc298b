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
  features recomputed with grad: 8 full-loss computations);
* ``8 microbatches of plain``: 8 sequential fwd+bwd of 32 rows, each with its own
  in-batch loss (another loss: timed only to show what 8 smaller programs cost by
  themselves on this machine);
* the batch loss's own pass: ``value_and_grad`` of ``batch_loss`` on the global
  features (the B x B logits and their softmaxes), a floor no schedule goes under.

Two tower kinds: on vectors (one hidden layer of 512; activations about the size of the
params) and on 16-token sequences (the same layers per token, mean-pooled; activations
dominate, as in real dual encoders).

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


def problem(batch: int, width: int, tokens: int = 1):
    keys = jax.random.split(jax.random.key(0), 4)

    def dense(key, a, b):
        return jax.random.normal(key, (a, b)) / np.sqrt(a)

    params = {
        "a": {"w1": dense(keys[0], 64, width), "w2": dense(keys[1], width, 32)},
        "b": {"w1": dense(keys[2], 48, width), "w2": dense(keys[3], width, 32)},
        "log_t": jnp.log(jnp.float32(0.07)),
    }
    rng = np.random.default_rng(1)
    data = {  # each example: `tokens` vectors (a sequence the tower pools), or one vector
        "a": rng.normal(size=(batch, tokens, 64))
        .astype(np.float32)
        .squeeze(1 if tokens == 1 else ()),
        "b": rng.normal(size=(batch, tokens, 48))
        .astype(np.float32)
        .squeeze(1 if tokens == 1 else ()),
    }
    return params, data


def tower(p, x, key):
    h = unsplit.dropout(key, jax.nn.gelu(x @ p["w1"]), 0.1)
    z = h @ p["w2"]
    if z.ndim == 2:  # a sequence: mean-pooled
        z = z.mean(axis=0)
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


def plain_features(params, batch, key):
    keys = unsplit.example_keys(key, jnp.arange(batch["a"].shape[0]))
    return jax.vmap(features_fn, (None, 0, 0))(params, batch, keys)


def plain_loss(params, batch, key):
    return batch_loss_fn(params, plain_features(params, batch, key))


def microbatched_plain_step(k: int):
    """k sequential fwd+bwd passes of B/k rows, each its own in-batch loss: not the same
    loss (its negatives are one microbatch's), timed only to show what running k smaller
    programs costs by itself on this machine."""

    def step(params, batch, key):
        chunks = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)

        def one(grads, chunk):
            loss, g = jax.value_and_grad(plain_loss)(params, chunk, key)
            return jax.tree.map(jnp.add, grads, g), loss

        grads, losses = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, params), chunks)
        return losses.mean(), grads

    return jax.jit(step)


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


# (name, batch, hidden width, tokens per example): vector towers, whose activations are
# about the size of their params, and towers over 16-token sequences (mean-pooled), whose
# activations dominate as in real dual encoders.
CONFIGS = [("vectors", 256, 512, 1), ("16-token sequences", 256, 512, 16)]
QUICK = [("vectors", 64, 64, 1)]


def measure(name: str, batch: int, width: int, tokens: int, repeats: int) -> list[list[str]]:
    params, data = problem(batch, width, tokens)
    key = jax.random.key(3)
    steps = {
        "plain": jax.jit(jax.value_and_grad(plain_loss)),
        "unsplit k=1": unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn),
        "unsplit k=8": unsplit.value_and_grad(
            features_fn, batch_loss=batch_loss_fn, microbatches=8
        ),
        "open_clip k=8": open_clip_step(8),
        "8 microbatches of plain (another loss)": microbatched_plain_step(8),
    }
    candidates = {n: (lambda s=s: s(params, data, key)) for n, s in steps.items()}
    results = {r.name: r for r in common.compare(candidates, baseline="plain", repeats=repeats)}
    memory = {n: common.compiled_temp_bytes(s, params, data, key) for n, s in steps.items()}
    features = jax.eval_shape(plain_features, params, data, key)
    loss_pass = jax.value_and_grad(batch_loss_fn, argnums=(0, 1))
    floor = common.compiled_temp_bytes(loss_pass, params, features)
    base = memory["unsplit k=1"]
    rows = [
        [f"{name}: {n}", common.ratio_cell(results[n]), f"{memory[n] / 2**20:.1f} MiB",
         common.times_cell(common.ratio(memory[n], base))]
        for n in steps
    ]  # fmt: skip
    rows.append([f"{name}: the batch loss's own pass (floor)", "-", f"{floor / 2**20:.1f} MiB",
                 common.times_cell(common.ratio(floor, base))])  # fmt: skip
    return rows


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    header = ["step (batch 256, one device)", "time / plain (median, min-max)",
              "compiled temp memory", "memory / unsplit k=1"]  # fmt: skip
    rows = []
    for config in QUICK if args.quick else CONFIGS:
        rows += measure(*config, repeats=3 if args.quick else 11)
    common.print_table("batch_loss vs plain jit and open_clip's accumulation", header, rows)
    if common.should_write(args):
        print(f"wrote {common.write_table(DOC, MARKER, common.markdown_table(header, rows))}")


if __name__ == "__main__":
    main()
