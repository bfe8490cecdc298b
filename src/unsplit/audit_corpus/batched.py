"""Ordinary batched train steps with one problem each (``unsplit.audit_step``).

Each factory returns ``(step, args)``; the line the audit reports carries
``# expect: <case>``. The loss is a token-weighted regression: each example
has a weight (its number of tokens) in ``batch["mask"]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from unsplit.audit_corpus import _data

MICROBATCHES = 4


def _sums(w, batch, keep=None):
    """(sum of weighted squared errors, sum of weights) of a (micro)batch."""
    x = batch["x"] if keep is None else jnp.where(keep, batch["x"] / 0.9, 0.0)
    errors = (x @ w - batch["y"]) ** 2
    return jnp.sum(errors * batch["mask"]), jnp.sum(batch["mask"])


def _microbatches(batch):
    return jax.tree.map(lambda x: x.reshape(MICROBATCHES, -1, *x.shape[1:]), batch)


def batch_level_dropout():
    """Flax-style batch-level dropout: one key draws the mask of the whole batch."""

    @jax.jit
    def step(w, batch, key):
        keep = jax.random.bernoulli(key, 0.9, batch["x"].shape)  # expect: batch_level_dropout
        loss_sum, weight = _sums(w, batch, keep)
        return loss_sum / weight

    return step, (_data.weights(), _data.regression(), _data.key())


def same_key_microbatches():
    """T5X-style accumulation: every microbatch draws with the same key."""

    @jax.jit
    def step(w, batch, key):
        sub = jax.random.split(key)[1]

        def body(carry, micro):
            keep = jax.random.bernoulli(sub, 0.9, micro["x"].shape)  # expect: same_key_microbatches
            loss_sum, weight = _sums(w, micro, keep)
            return (carry[0] + loss_sum, carry[1] + weight), None

        (loss_sum, weight), _ = jax.lax.scan(body, (0.0, 0.0), _microbatches(batch))
        return loss_sum / weight  # the global token count: only the noise is wrong

    return step, (_data.weights(), _data.regression(), _data.key())


def shard_prng_key():
    """``pmap`` with ``flax.training.common_utils.shard_prng_key``: one key per device."""
    from flax.training import common_utils  # this case alone needs Flax (unsplit[flax])

    def device_loss(w, x, key):
        noisy = w + 0.01 * jax.random.normal(key, w.shape)  # weight noise, drawn per device
        return jax.lax.pmean(jnp.mean((x @ noisy) ** 2), "devices")

    p_loss = jax.pmap(device_loss, axis_name="devices", in_axes=(None, 0, 0))

    def step(w, x, key):
        keys = common_utils.shard_prng_key(key)
        return p_loss(w, common_utils.shard(x), keys)[0]  # expect: shard_prng_key

    return step, (_data.weights(), _data.regression()["x"], _data.key())


def multisteps_token_mean():
    """``optax.MultiSteps`` over a token-weighted loss: a mean of microbatch token means."""
    opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=MICROBATCHES)

    def loss(w, batch):
        loss_sum, weight = _sums(w, batch)
        return loss_sum / weight  # expect: multisteps_token_mean

    @jax.jit
    def micro_step(w, state, batch):
        grads = jax.grad(loss)(w, batch)
        updates, state = opt.update(grads, state, w)
        return optax.apply_updates(w, updates), state

    w = _data.weights()
    return micro_step, (w, opt.init(w), _data.regression())


def scan_token_means():
    """A ``lax.scan`` accumulating each microbatch's token mean."""

    @jax.jit
    def step(w, batch):
        def body(total, micro):
            loss_sum, weight = _sums(w, micro)
            return total + loss_sum / weight, None  # expect: scan_token_means

        total, _ = jax.lax.scan(body, 0.0, _microbatches(batch))
        return total / MICROBATCHES

    return step, (_data.weights(), _data.regression())


MICRO = _data.BATCH // MICROBATCHES  # a constant of the code, as a config-driven trainer has it


def constant_size_microbatches():
    """A key split per microbatch of a size fixed in the code (``B // K`` from constants).

    A batch twice as large draws exactly the same: only where the noise meets
    the microbatch's rows shows that an example's noise is its position's.
    """

    @jax.jit
    def step(w, batch, key):
        keys = jax.random.split(key, MICROBATCHES)

        def body(i, carry):
            micro = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * MICRO, MICRO), batch)
            shape = (MICRO, _data.WIDTH)
            keep = jax.random.bernoulli(keys[i], 0.9, shape)  # expect: constant_size_microbatches
            loss_sum, weight = _sums(w, micro, keep)
            return carry[0] + loss_sum, carry[1] + weight

        loss_sum, weight = jax.lax.fori_loop(0, MICROBATCHES, body, (0.0, 0.0))
        return loss_sum / weight

    return step, (_data.weights(), _data.regression(), _data.key())


def explicit_mesh_dropout():
    """Batch-level dropout inside ``jax.shard_map`` over ``jax.make_mesh``'s Explicit axes."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])  # Explicit by default
    specs = ({"x": jax.P("data"), "y": jax.P("data"), "mask": jax.P("data")}, jax.P())

    def shard(w, batch, key):
        keep = jax.random.bernoulli(key, 0.9, batch["x"].shape)  # expect: explicit_mesh_dropout
        loss_sum, weight = _sums(w, batch, keep)
        return jax.lax.psum(loss_sum, "data") / jax.lax.psum(weight, "data")

    in_specs = (jax.P(), *specs)
    step = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=jax.P()))
    batch = jax.device_put(_data.regression(), jax.NamedSharding(mesh, jax.P("data")))
    return step, (_data.weights(), batch, _data.key())
