"""unsplit's default-mode ``train_step`` vs the user's own jitted train step (a diffusion step).

The step is a small denoiser trained the diffusion way: each example draws a timestep and
Gaussian noise from its own key, noises the clean example, and the model (an MLP over the
noisy example and a sinusoidal embedding of the timestep: residual blocks with norm scales and biases, a skip connection) predicts
the noise; the loss is the mean squared error. 8 simulated CPU devices, a ``data`` mesh,
params replicated, the batch sharded over ``data``, AdamW.

* **plain**: what the user writes without unsplit: ``jax.jit(train, donate_argnums=(0, 1))``
  where ``train`` does ``jax.value_and_grad`` of the batch-mean loss (keys
  ``unsplit.example_keys(key, arange(B))``, so both do the same work) and the optax update;
* **unsplit train_step**: ``unsplit.train_step(unsplit.value_and_grad(loss_fn, mesh=mesh),
  optax.adamw(...))`` given the same keys (goal: <= 1.0x plain);
* **README loop**: the same train function driven as the README writes it, one key and the
  step number, ``train(params, opt_state, xs, key, step=i)``: the number is folded into
  the key inside the compiled program (goal: <= 1.0x plain);
* **README loop, fold_in on the host**: the loop the README used to show,
  ``train(params, opt_state, xs, jax.random.fold_in(key, i))``, for scale;
* **unsplit grads alone**: the ``Step`` called on its own (no update), for scale.

Step time: alternating rounds, median ratio to plain with min and max. Per-device memory:
XLA's compiled analysis (arguments + outputs + temp) of the plain train step and of
unsplit's grads program.

Run: ``python benchmarks/train_step_bench.py`` (``--quick``: smaller, docs untouched).
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

MARKER = "train_step"
DOC = "benchmarks.md"


def embed(t, dim):
    """A sinusoidal embedding of the timestep ``t`` in [0, 1)."""
    freqs = jnp.exp(-jnp.log(1000.0) * jnp.arange(dim // 2) / (dim // 2))
    angles = 1000.0 * t * freqs
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)])


def denoiser(p, x_t, t):
    """A UNet-ish MLP: down, residual blocks conditioned on ``t`` (each with its own biases and
    norm scale, as a UNet's many small leaves), up with a skip from the first layer."""
    h0 = jax.nn.gelu(x_t @ p["down"])
    h = h0 + embed(t, h0.shape[-1]) @ p["time"]
    for block in p["blocks"]:
        normed = h * jax.lax.rsqrt(jnp.mean(h**2) + 1e-6) * block["scale"]
        inner = jax.nn.gelu(normed @ block["w1"] + block["b1"])
        h = h + inner @ block["w2"] + block["b2"]
    return (h + h0) @ p["up"]


def loss_fn(p, x, key):
    """One example's denoising loss: its key draws the timestep and the noise."""
    t_key, noise_key = jax.random.split(key)
    t = jax.random.uniform(t_key)
    noise = jax.random.normal(noise_key, x.shape)
    alpha = jnp.cos(0.5 * jnp.pi * t) ** 2
    x_t = jnp.sqrt(alpha) * x + jnp.sqrt(1.0 - alpha) * noise
    return jnp.mean((denoiser(p, x_t, t) - noise) ** 2)


def init(rng, data_dim, width, depth):
    def matrix(m, n):
        return rng.normal(0, 1 / np.sqrt(m), (m, n)).astype(np.float32)

    def block():
        return {
            "scale": np.ones(width, np.float32),
            "w1": matrix(width, 2 * width),
            "b1": np.zeros(2 * width, np.float32),
            "w2": matrix(2 * width, width),
            "b2": np.zeros(width, np.float32),
        }

    return {
        "down": matrix(data_dim, width),
        "time": matrix(width, width),
        "blocks": [block() for _ in range(depth)],
        "up": matrix(width, data_dim),
    }


def plain_train(optimizer):
    """The user's own train step, jitted and donated."""

    def batch_loss(p, xs, key):
        keys = unsplit.example_keys(key, jnp.arange(xs.shape[0]))
        return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0, 0))(p, xs, keys))

    def train(params, opt_state, xs, key):
        loss, grads = jax.value_and_grad(batch_loss)(params, xs, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return jax.jit(train, donate_argnums=(0, 1))


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    data_dim, width, depth, batch = (64, 64, 4, 64) if args.quick else (128, 128, 16, 128)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    host = init(rng, data_dim, width, depth)
    xs = jax.device_put(
        rng.normal(size=(batch, data_dim)).astype(np.float32), NamedSharding(mesh, P("data"))
    )
    optimizer = optax.adamw(1e-3)

    def placed():
        params = jax.device_put(host, replicated)
        return params, jax.device_put(optimizer.init(params), replicated)

    step = unsplit.value_and_grad(loss_fn, mesh=mesh)
    train = unsplit.train_step(step, optimizer)
    plain = plain_train(optimizer)
    # Each candidate carries its own params and state from call to call (both donate them).
    state = {name: placed() for name in ("plain", "unsplit", "readme", "host", "grads")}
    keys = iter(jax.random.split(jax.random.key(0), 100_000))
    key, numbers = jax.random.key(0), iter(range(100_000))

    def run_plain():
        loss, *state["plain"] = plain(*state["plain"], xs, next(keys))
        return loss

    def run_train():
        loss, *state["unsplit"] = train(*state["unsplit"], xs, next(keys))
        return loss

    def run_readme():
        loss, *state["readme"] = train(*state["readme"], xs, key, step=next(numbers))
        return loss

    def run_host_fold_in():
        loss, *state["host"] = train(*state["host"], xs, jax.random.fold_in(key, next(numbers)))
        return loss

    def run_grads():
        return step(state["grads"][0], xs, next(keys))

    params, opt_state = placed()
    memory_plain = common.compiled_bytes(
        plain.lower(params, opt_state, xs, keys.__next__()).compile()
    )
    memory_grads = common.compiled_bytes(step.lower(params, xs, jax.random.key(1)).compile())
    timing = common.compare(
        {
            "plain": run_plain,
            "unsplit train_step": run_train,
            "README loop (step=i)": run_readme,
            "README loop, fold_in on the host": run_host_fold_in,
            "unsplit grads alone": run_grads,
        },
        baseline="plain",
        repeats=3 if args.quick else 41,
        inner=1 if args.quick else 5,
    )
    header = ["candidate", "step time / plain (median, min-max)", "memory per device"]
    memory = {"plain": memory_plain, "unsplit grads alone": memory_grads}
    cells = [
        [
            r.name,
            common.ratio_cell(r),
            f"{memory[r.name] / 2**20:.1f} MiB" if r.name in memory else "",
        ]
        for r in timing
    ]
    leaves = len(jax.tree.leaves(host))
    title = (
        f"diffusion train step, 8 devices (data {data_dim}, width {width}, {depth} blocks, "
        f"{leaves} params leaves, batch {batch})"
    )
    common.print_table(title, header, cells)
    if common.should_write(args):
        common.write_table(DOC, MARKER, common.markdown_table(header, cells))


if __name__ == "__main__":
    main()
