"""Steps the audit must find nothing in: the same ideas written schedule-invariantly."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import unsplit
from unsplit.audit_corpus import _data, batched, per_example


def unsplit_loss():
    """Every draw from the example's key: unsplit's dropout, and Linen's via rngs=."""

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.1, deterministic=False)(nn.Dense(_data.WIDTH)(x))

    model = MLP()
    params = _data.abstract_init(model)

    def loss_fn(params, example, key):
        k1, k2 = jax.random.split(key)
        h: Any = model.apply(params, unsplit.dropout(k1, example["x"], 0.1), rngs={"dropout": k2})
        return jnp.sum(h**2 * example["mask"][:, None]), jnp.sum(example["mask"])

    return loss_fn, (params, _data.sequences(), _data.key()), {"weighted": True}


class _EvalNorm(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(_data.WIDTH, _data.WIDTH, rngs=rngs)
        self.norm = nnx.BatchNorm(_data.WIDTH, use_running_average=True, rngs=rngs)
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, x, key):
        return self.dropout(self.norm(self.linear(x)), rngs=nnx.Rngs(dropout=key))


def nnx_eval_batchnorm():
    """NNX: BatchNorm with running averages (no update), dropout from the example key."""
    model = _EvalNorm(nnx.Rngs(0))

    def loss_fn(model, example, key):
        return jnp.sum(model(example["x"], key) ** 2 * example["mask"][:, None])

    return loss_fn, (model, _data.sequences(), _data.key()), {}


def per_coordinate_attention(query, key, value, bias=None, mask=None, *, dropout_rng=None,
                             dropout_rate=0.0, deterministic=False, dtype=None, precision=None,
                             **kwargs):  # fmt: skip
    """Attention whose dropout element depends only on (key, head, query, key position).

    A stand-in for ``unsplit.linen.dot_product_attention`` where that is not
    available: the rng is folded with ``head * 2**16 + query`` and a 1-D mask
    is drawn along the key positions, so every draw is prefix-stable.
    """
    weights = nn.dot_product_attention_weights(
        query, key, bias, mask, deterministic=True, dtype=dtype, precision=precision
    )
    if not deterministic and dropout_rate > 0.0:
        heads, queries, keys = weights.shape[-3:]
        rows = jnp.arange(heads)[:, None] * 2**16 + jnp.arange(queries)[None, :]

        def row(index):
            rng = jax.random.fold_in(dropout_rng, index)  # pyright: ignore[reportArgumentType]  # set: not deterministic
            return jax.random.bernoulli(rng, 1.0 - dropout_rate, (keys,))

        keep = jax.vmap(jax.vmap(row))(rows)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def stable_attention():
    """Attention dropout that survives padding: unsplit's attention function when present."""
    attention = getattr(unsplit.linen, "dot_product_attention", per_coordinate_attention)
    return per_example.attention_loss(attention)


def unsplit_step():
    """``unsplit.value_and_grad`` on 2 devices x 2 microbatches.

    ``unsplit audit`` checks a step's per-example loss; the tests also check
    the step itself with ``unsplit.audit_step`` (its ``shard_map``, microbatch
    ``scan`` and default ids from ``axis_index``).
    """
    loss_fn, (params, batch, key), _ = unsplit_loss()
    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    step = unsplit.value_and_grad(loss_fn, weighted=True, microbatches=2, mesh=mesh)
    return step, (params, batch, key)


def vmapped_example_keys():
    """An ordinary step written the unsplit way: per-example keys, one global division."""

    @jax.jit
    def step(w, batch, key, ids):
        keys = unsplit.example_keys(key, ids)

        def one(x, k):
            return unsplit.dropout(k, x, 0.1)

        x = jax.vmap(one)(batch["x"], keys)
        errors = (x @ w - batch["y"]) ** 2
        return jnp.sum(errors * batch["mask"]) / jnp.sum(batch["mask"])

    ids = jnp.arange(_data.BATCH, dtype=jnp.uint32)
    return step, (_data.weights(), _data.regression(), _data.key(), ids)


def constant_size_example_keys():
    """``batched.constant_size_microbatches`` written the unsplit way: per-example keys."""
    micro_size = _data.BATCH // batched.MICROBATCHES

    @jax.jit
    def step(w, batch, key):
        keys = unsplit.example_keys(key, jnp.arange(_data.BATCH, dtype=jnp.uint32))

        def body(i, carry):
            micro = jax.tree.map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, i * micro_size, micro_size), batch
            )
            micro_keys = jax.lax.dynamic_slice_in_dim(keys, i * micro_size, micro_size)
            x = jax.vmap(lambda k, row: unsplit.dropout(k, row, 0.1))(micro_keys, micro["x"])
            errors = (x @ w - micro["y"]) ** 2
            return carry[0] + jnp.sum(errors * micro["mask"]), carry[1] + jnp.sum(micro["mask"])

        loss_sum, weight = jax.lax.fori_loop(0, batched.MICROBATCHES, body, (0.0, 0.0))
        return loss_sum / weight

    return step, (_data.weights(), _data.regression(), _data.key())
