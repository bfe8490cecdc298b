"""Fine-tune low-rank adapters on a frozen base model: the loss curve does not depend on the schedule.

A LoRA run: the base model (a two-layer MLP classifier) is frozen and sharded
FSDP over the mesh; only the low-rank adapters added to its two layers are
trained. The base is passed as ``frozen=``: every example's loss gets it as
its last argument, it is never differentiated (no backward pass through it,
no optimizer state for it) and it is an argument of the compiled programs
with its shardings kept, not a constant compiled into them. The data, made
here: inputs labelled by a fixed random teacher that the base model, a
perturbed copy of it, gets partly wrong.

The script trains the reference schedule (1 device, 1 microbatch) and yours,
and prints both curves.

    python examples/train_lora.py --devices 4 --microbatches 2 --steps 20
    python examples/train_lora.py --devices 4 --bitwise   # bit for bit

Only unsplit's public API is used (and optax): copy it, with _schedule.py beside it (the
flags and the two curves), as the start of your own run.
With Flax NNX, ``graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)``
gives the two trees: train ``lora``, pass ``base`` as ``frozen=`` and
``nnx.merge(graphdef, lora, base)`` inside the loss.
"""

from __future__ import annotations

import argparse
import sys

import _schedule

DIM, HIDDEN, CLASSES, RANK = 32, 64, 8, 4


def build_parser() -> argparse.ArgumentParser:
    return _schedule.parser(
        "train_lora.py", __doc__, processes=False, dropout="on the hidden layer"
    )


def make_data(seed: int, batch: int, steps: int):
    """Every step's global batch (host arrays), labelled by a random teacher MLP."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(DIM, HIDDEN)) / np.sqrt(DIM)
    w2 = rng.normal(size=(HIDDEN, CLASSES)) / np.sqrt(HIDDEN)
    x = rng.normal(size=(steps, batch, DIM)).astype(np.float32)
    labels = np.argmax(np.tanh(x @ w1) @ w2, axis=-1).astype(np.int32)
    return {"x": x, "label": labels}, (w1, w2)


def init_base(teacher, seed: int, mesh):
    """The frozen base: the teacher perturbed, each matrix sharded FSDP over the mesh."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed + 1)
    w1, w2 = (w + 0.5 * rng.normal(size=w.shape) * np.std(w) for w in teacher)
    base = {"w1": np.float32(w1), "w2": np.float32(w2)}
    if mesh is None:
        return jax.device_put(base)
    specs = {"w1": P(None, "data"), "w2": P("data", None)}  # split over the hidden units
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in base.items()}


def init_adapters(seed: int):
    """``a`` random, ``b`` zero: the adapted model starts as the base (as in LoRA)."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "a1": jax.random.normal(k1, (DIM, RANK)) / jnp.sqrt(DIM),
        "b1": jnp.zeros((RANK, HIDDEN)),
        "a2": jax.random.normal(k2, (HIDDEN, RANK)) / jnp.sqrt(HIDDEN),
        "b2": jnp.zeros((RANK, CLASSES)),
    }


def make_step(args, mesh):
    import jax
    import jax.numpy as jnp

    import unsplit

    def loss_fn(adapters, example, key, base):  # ONE example, its own key; base is frozen
        x = example["x"]
        h = jnp.tanh(x @ base["w1"] + (x @ adapters["a1"]) @ adapters["b1"])
        h = unsplit.dropout(key, h, args.dropout)
        logits = h @ base["w2"] + (h @ adapters["a2"]) @ adapters["b2"]
        return -jax.nn.log_softmax(logits)[example["label"]]

    return unsplit.value_and_grad(
        loss_fn, microbatches=args.microbatches, mesh=mesh, bitwise=args.bitwise
    )


def train(args) -> list[str]:
    """The loss curve as exact hex strings."""
    import jax
    import optax

    import unsplit

    mesh = _schedule.data_mesh(args.devices)
    step = make_step(args, mesh)
    data, teacher = make_data(args.seed, args.batch, args.steps)
    base = init_base(teacher, args.seed, mesh)
    optimizer = optax.adam(1e-2)
    adapters = init_adapters(args.seed)
    opt_state = optimizer.init(adapters)  # the adapters' state only: the base has none
    train_fn = unsplit.train_step(step, optimizer)
    curve = []
    for s in range(args.steps):
        batch = {k: v[s] for k, v in data.items()}
        key = jax.random.key(args.seed)  # the step key fold_in(key, s), made in the program
        loss, adapters, opt_state = train_fn(adapters, opt_state, batch, key, step=s, frozen=base)
        curve.append(_schedule.exact(loss))
    return curve


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch % (args.devices * args.microbatches) or HIDDEN % args.devices:
        print(f"--batch {args.batch} must be a multiple of devices x microbatches, and "
              f"{HIDDEN} hidden units of --devices", file=sys.stderr)  # fmt: skip
        return 2
    return _schedule.compare(args, train)


if __name__ == "__main__":
    sys.exit(main())
