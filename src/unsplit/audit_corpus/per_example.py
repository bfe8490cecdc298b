"""Per-example losses with one problem each (``unsplit.audit``).

Each factory returns ``(loss_fn, (params, batch, key), options)``; the line
the audit reports carries ``# expect: <case>``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import unsplit
from unsplit.audit_corpus import _data

NOISE_KEY = jax.random.key(42)


def closure_key():
    """A key captured from the enclosing scope: every example gets the same noise."""

    def loss_fn(w, example, key):
        noise = jax.random.normal(NOISE_KEY, example["x"].shape)  # expect: closure_key
        return jnp.sum(((example["x"] + noise) @ w) ** 2 * example["mask"])

    return loss_fn, (_data.weights(), _data.sequences(), _data.key()), {}


def key_inside_loss():
    """``jax.random.key(0)`` inside the loss: the same noise for every example and step."""

    def loss_fn(w, example, key):
        fixed = jax.random.key(0)
        keep = jax.random.bernoulli(fixed, 0.9, example["x"].shape)  # expect: key_inside_loss
        return jnp.sum((jnp.where(keep, example["x"], 0.0) @ w) * example["mask"])

    return loss_fn, (_data.weights(), _data.sequences(), _data.key()), {}


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(_data.WIDTH)(x)
        return nn.Dropout(0.1, deterministic=False)(h)  # expect: linen_captured_rngs


def linen_captured_rngs():
    """Linen ``rngs={'dropout': captured_key}``: the stream ignores the example's key."""
    model = _LinenMLP()
    params = _data.abstract_init(model)

    def loss_fn(params, example, key):
        out: Any = model.apply(params, example["x"], rngs={"dropout": NOISE_KEY})
        return jnp.sum(out**2 * example["mask"][:, None])

    return loss_fn, (params, _data.sequences(), _data.key()), {}


class _NNXDropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(_data.WIDTH, _data.WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)  # holds the module's own stream

    def __call__(self, x):
        return self.dropout(self.linear(x))  # expect: nnx_module_rngs


def nnx_module_rngs():
    """An NNX module drawing from its own ``nnx.Rngs``: one stream for every example."""
    model = _NNXDropoutMLP(nnx.Rngs(0, dropout=1))

    def loss_fn(model, example, key):
        return jnp.sum(model(example["x"]) ** 2 * example["mask"][:, None])

    return loss_fn, (model, _data.sequences(), _data.key()), {}


class _LinenNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(_data.WIDTH)(x)
        return nn.BatchNorm(use_running_average=False)(h)  # expect: linen_batchnorm


def linen_batchnorm():
    """BatchNorm in a per-example loss: statistics of one example, updates discarded."""
    model = _LinenNorm()
    variables = _data.abstract_init(model)

    def loss_fn(variables, example, key):
        out, _ = model.apply(variables, example["x"], mutable=["batch_stats"])
        return jnp.sum(out**2 * example["mask"][:, None])

    return loss_fn, (variables, _data.sequences(), _data.key()), {}


class _NNXNorm(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(_data.WIDTH, _data.WIDTH, rngs=rngs)
        self.norm = nnx.BatchNorm(_data.WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))  # expect: nnx_batchnorm


def nnx_batchnorm():
    """NNX BatchNorm in training mode inside the loss: its BatchStat updates are dropped."""
    model = _NNXNorm(nnx.Rngs(0))

    def loss_fn(model, example, key):
        return jnp.sum(model(example["x"]) ** 2 * example["mask"][:, None])

    return loss_fn, (model, _data.sequences(), _data.key()), {}


def pmean_in_loss():
    """A collective in the loss: centring by the mean over the devices' examples."""

    def loss_fn(w, example, key):
        h = example["x"] @ w
        centred = h - jax.lax.pmean(jnp.mean(h), "batch")  # expect: pmean_in_loss
        return jnp.sum(unsplit.dropout(key, centred, 0.1) ** 2 * example["mask"])

    return loss_fn, (_data.weights(), _data.sequences(), _data.key()), {}


def rbg_key():
    """Draws from an rbg key derived from the example key: not exact under vmap."""

    def loss_fn(w, example, key):
        words = jnp.tile(jax.random.key_data(key), 2)
        rbg = jax.random.wrap_key_data(words, impl="rbg")
        noise = jax.random.normal(rbg, example["x"].shape)  # expect: rbg_key
        return jnp.sum(((example["x"] + noise) @ w) ** 2 * example["mask"])

    return loss_fn, (_data.weights(), _data.sequences(), _data.key()), {}


class _Attention(nn.Module):
    attention_fn: Any = nn.dot_product_attention

    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(  # expect: attention_dropout
            num_heads=2, dropout_rate=0.1, deterministic=False, attention_fn=self.attention_fn
        )(x, x)


def attention_loss(attention_fn=nn.dot_product_attention):
    """A one-example attention loss with attention dropout (also used by the clean case)."""
    model = _Attention(attention_fn)
    params = _data.abstract_init(model)

    def loss_fn(params, example, key):
        out: Any = model.apply(params, example["x"], rngs={"dropout": key})
        return jnp.sum(out**2 * example["mask"][:, None]), jnp.sum(example["mask"])

    return loss_fn, (params, _data.sequences(), _data.key()), {"weighted": True}


def attention_dropout():
    """Flax attention dropout draws (heads, L, L) at once: its bits depend on the padded L."""
    return attention_loss()


def device_index_key():
    """A key folded with the device index: the noise depends on the device count."""

    def loss_fn(w, example, key):
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))  # expect: device_index_key
        return jnp.sum((unsplit.dropout(key, example["x"], 0.1) @ w) * example["mask"])

    return loss_fn, (_data.weights(), _data.sequences(), _data.key()), {}
