"""A small causal transformer from standard Flax layers, used by tests, demo and benchmarks.

It is a plain ``flax.linen`` model: ``nn.MultiHeadDotProductAttention`` with
attention-weight dropout and dropout on the residual branches. By default both
are unsplit's drop-ins (``dropout_cls=unsplit.linen.Dropout``,
``attention_fn=unsplit.linen.dot_product_attention``), so an example's noise
depends only on its key and token positions: padding it longer changes
nothing on its real tokens. :func:`with_flax_dropout` gives the same model
with Flax's own ``nn.Dropout`` and ``nn.dot_product_attention`` (the same
parameters), for baselines. It is applied to ONE example (``tokens`` of shape
``(L,)``); unsplit vmaps it over the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from unsplit._src.dropout.attention import linen_dot_product_attention
from unsplit._src.dropout.linen import Dropout


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes of :class:`Transformer` (defaults: a few hundred thousand parameters)."""

    vocab: int = 64
    length: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.1


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, dropout on both residual branches."""

    config: TransformerConfig
    dropout_cls: Any = Dropout
    attention_fn: Any = linen_dot_product_attention

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        c = self.config
        causal = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=c.heads,
            dropout_rate=c.attention_dropout,
            deterministic=not train,
            attention_fn=self.attention_fn,
        )(h, h, mask=causal)
        x = x + self.dropout_cls(c.dropout, deterministic=not train)(h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * c.width)(h)
        h = nn.gelu(h)
        h = self.dropout_cls(c.dropout, deterministic=not train)(h)
        h = nn.Dense(c.width)(h)
        return x + self.dropout_cls(c.dropout, deterministic=not train)(h)


class Transformer(nn.Module):
    """Causal language model over ``tokens: int[L]`` -> logits ``float[L, vocab]``.

    Leading batch axes (``int[B, L]``) work too, as the naive batch-level
    baselines in tests and benchmarks need. ``dropout_cls`` and ``attention_fn``
    pick the residual and attention-weight dropout (unsplit's by default).
    """

    config: TransformerConfig
    dropout_cls: Any = Dropout
    attention_fn: Any = linen_dot_product_attention

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = True) -> jax.Array:
        c = self.config
        x = nn.Embed(c.vocab, c.width)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (c.length, c.width))
        length = tokens.shape[-1]
        # Explicit broadcast so a batched call (B, L) also works under strict rank promotion.
        x = x + pos[:length].reshape((1,) * (x.ndim - 2) + (length, c.width))
        x = self.dropout_cls(c.dropout, deterministic=not train)(x)
        for _ in range(c.layers):
            x = Block(c, self.dropout_cls, self.attention_fn)(x, train=train)
        x = nn.LayerNorm()(x)
        return nn.Dense(c.vocab)(x)


def with_flax_dropout(model: Transformer) -> Transformer:
    """``model`` with Flax's own ``nn.Dropout`` and ``nn.dot_product_attention`` (same params).

    Example:
        >>> from unsplit import models
        >>> model = models.Transformer(models.TransformerConfig())
        >>> models.with_flax_dropout(model).attention_fn.__module__
        'flax.linen.attention'
    """
    return model.clone(dropout_cls=nn.Dropout, attention_fn=nn.dot_product_attention)


def init_params(model: Transformer, seed: int = 0) -> Any:
    """Parameters for ``model`` from ``seed`` (deterministic, no dropout)."""
    tokens = jnp.zeros((model.config.length,), jnp.int32)
    return model.init(jax.random.key(seed), tokens, train=False)["params"]


def token_loss(model: Transformer):
    """A weighted one-example loss: ``(sum of masked token losses, number of tokens)``.

    The example is ``{"inputs": int[L], "targets": int[L], "mask": float[L]}``.
    """

    def loss_fn(params, example, key):
        # apply's annotation includes the (out, state) pair of mutable=...; not asked for here.
        logits: Any = model.apply({"params": params}, example["inputs"], rngs={"dropout": key})
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, example["targets"][:, None], axis=-1)[:, 0]
        mask = example["mask"].astype(jnp.float32)
        return jnp.sum(nll * mask), jnp.sum(mask)

    return loss_fn


def mean_loss(model: Transformer):
    """An unweighted one-example loss: the mean of the example's masked token losses."""
    weighted = token_loss(model)

    def loss_fn(params, example, key):
        loss_sum, count = weighted(params, example, key)
        return loss_sum / jnp.maximum(count, 1.0)

    return loss_fn


def synthetic_batch(config: TransformerConfig, batch: int, seed: int = 0, ragged: bool = True):
    """A batch of random token sequences; with ``ragged`` each example has its own length."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k1, (batch, config.length + 1), 0, config.vocab)
    if ragged:
        lengths = jax.random.randint(k2, (batch,), config.length // 4, config.length + 1)
    else:
        lengths = jnp.full((batch,), config.length)
    mask = (jnp.arange(config.length)[None, :] < lengths[:, None]).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}
