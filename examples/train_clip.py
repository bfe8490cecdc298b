"""Train a small dual encoder with in-batch negatives: the loss curve does not depend on the schedule.

A CLIP-style model: two towers (an MLP per modality, dropout in both), the
symmetric InfoNCE loss over the global batch (every other example of the batch
is a negative) with a learnable temperature. The data, made here: pairs
``(a, b)`` where ``b`` is a fixed random projection of ``a`` plus noise, so the
towers can learn to match them.

The step is ``unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn)``:
``features_fn`` embeds ONE pair (its own dropout key); ``batch_loss_fn`` sees
every example's embeddings of the global batch. So the loss and gradients are
those of the whole global batch on one device, whatever ``--devices``,
``--microbatches`` or ``--processes`` say: the script trains the reference
schedule (1 device, 1 microbatch) and yours, and prints both curves.

    python examples/train_clip.py --devices 4 --microbatches 2 --steps 20
    python examples/train_clip.py --devices 2 --processes 2 --bitwise   # bit for bit

Only unsplit's public API is used (and optax): copy it, with _schedule.py beside it (the
flags and the two curves), as the start of your own run.
"""

from __future__ import annotations

import argparse
import os
import sys

import _schedule

DIM_A, DIM_B, HIDDEN, EMBED = 32, 24, 64, 16


def build_parser() -> argparse.ArgumentParser:
    return _schedule.parser("train_clip.py", __doc__, processes=True, dropout="in both towers")


def make_data(seed: int, batch: int, steps: int):
    """Every step's global batch of pairs (host arrays): b is a noisy projection of a."""
    import numpy as np

    rng = np.random.default_rng(seed)
    projection = rng.normal(size=(DIM_A, DIM_B)) / np.sqrt(DIM_A)
    a = rng.normal(size=(steps, batch, DIM_A)).astype(np.float32)
    b = (a @ projection + 0.1 * rng.normal(size=(steps, batch, DIM_B))).astype(np.float32)
    return {"a": a, "b": b}


def init_params(seed: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 4)

    def dense(key, n_in, n_out):
        return jax.random.normal(key, (n_in, n_out)) / jnp.sqrt(n_in)

    return {
        "a": {"w1": dense(keys[0], DIM_A, HIDDEN), "w2": dense(keys[1], HIDDEN, EMBED)},
        "b": {"w1": dense(keys[2], DIM_B, HIDDEN), "w2": dense(keys[3], HIDDEN, EMBED)},
        "log_temperature": jnp.log(jnp.float32(0.1)),  # used by batch_loss_fn only
    }


def make_step(args, mesh):
    import jax
    import jax.numpy as jnp

    import unsplit

    def tower(p, x, key):
        h = jax.nn.gelu(x @ p["w1"])
        h = unsplit.dropout(key, h, args.dropout)
        z = h @ p["w2"]
        return z / jnp.linalg.norm(z)

    def features_fn(params, example, key):  # ONE pair, its own key
        ka, kb = jax.random.split(key)
        return {
            "a": tower(params["a"], example["a"], ka),
            "b": tower(params["b"], example["b"], kb),
        }

    def batch_loss_fn(params, features):  # every example's features, global-batch order
        logits = features["a"] @ features["b"].T / jnp.exp(params["log_temperature"])
        labels = jnp.arange(logits.shape[0])
        log_a = jax.nn.log_softmax(logits, axis=1)[labels, labels]
        log_b = jax.nn.log_softmax(logits, axis=0)[labels, labels]
        return -(jnp.mean(log_a) + jnp.mean(log_b)) / 2

    return unsplit.value_and_grad(
        features_fn,
        batch_loss=batch_loss_fn,
        microbatches=args.microbatches,
        mesh=mesh,
        bitwise=args.bitwise,
    )


def train(args) -> list[str]:
    """The loss curve as exact hex strings (every process returns the same)."""
    import jax
    import optax

    import unsplit

    mesh = _schedule.data_mesh(args.devices * args.processes)
    step = make_step(args, mesh)
    optimizer = optax.adam(3e-3)
    params = init_params(args.seed)
    opt_state = optimizer.init(params)
    train_fn = unsplit.train_step(step, optimizer)
    data = make_data(args.seed, args.batch, args.steps)
    rows = args.batch // jax.process_count()
    curve = []
    for s in range(args.steps):
        batch = {k: v[s] for k, v in data.items()}
        ids = None
        if mesh is not None:
            mine = {k: v[jax.process_index() * rows :][:rows] for k, v in batch.items()}
            batch, ids = unsplit.global_batch(mine, mesh)
        key = jax.random.key(args.seed)  # the step key fold_in(key, s), made in the program
        loss, params, opt_state = train_fn(params, opt_state, batch, key, ids, step=s)
        curve.append(_schedule.exact(loss))
    return curve


def worker(**options) -> list[str]:
    """One process of a multi-process run (``unsplit.testing.run_local_processes``)."""
    return train(argparse.Namespace(**options))


def run(args) -> list[str]:
    if args.processes == 1:
        return train(args)
    import unsplit.testing

    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    results = unsplit.testing.run_local_processes(
        "train_clip:worker",
        num_processes=args.processes,
        devices_per_process=args.devices,
        kwargs=vars(args),
        timeout_s=600,
    )
    return results[0]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch % (args.devices * args.processes * args.microbatches):
        print(f"--batch {args.batch} must be a multiple of devices x processes x microbatches",
              file=sys.stderr)  # fmt: skip
        return 2
    return _schedule.compare(args, train, run)


if __name__ == "__main__":
    sys.exit(main())
