"""Attention with unsplit's dropout: drop-ins for Flax's ``dot_product_attention``.

``linen_dot_product_attention`` (``unsplit.linen.dot_product_attention``) and
``nnx_dot_product_attention`` (``unsplit.nnx.dot_product_attention``) take
exactly the arguments of ``flax.linen.dot_product_attention`` and
``flax.nnx.dot_product_attention``, so they plug into ``attention_fn=`` of
``nn.MultiHeadDotProductAttention`` and ``nnx.MultiHeadAttention``. Without
dropout (``deterministic=True`` or ``dropout_rate == 0``) they *are* Flax's
functions (same code path, same bits, no rng needed). With dropout, Flax
computes everything (dtype promotion, checks, bias, mask, softmax, sowing the
weights into ``module``, the value contraction) except the weight-dropout
mask, which comes from :func:`attention_dropout`:

* an element of the weights ``[batch..., heads, q, k]`` is kept or dropped
  depending only on the key and its coordinates ``(batch..., head, q, k)``
  (the grid layout of :mod:`unsplit._src.random`), never on the lengths, so an
  example padded from ``L`` to ``2 L`` tokens keeps the mask of its first
  ``L`` query and key positions; and a batched call with one key gives row
  ``b`` the mask a call on row ``b`` alone gets with ``fold_in(key, b)``;
* with ``broadcast_dropout=True`` (Flax's default) one ``(q, k)`` mask is
  shared by every batch row and head, as in Flax (it is the mask of
  coordinate 0 of each shared axis);
* one threefry hash serves four weights, and the backward pass draws the mask
  again instead of storing it;
* kept weights are divided by the keep probability the 16-bit threshold gives,
  so the expectation is exact; ``dropout_rate == 1`` gives zero weights where
  Flax accepts that rate (Flax's gives NaN: it divides by a keep probability of
  0); where Flax refuses it (nnx since Flax 0.12.12), ours raises Flax's error;
* the dropped weights are contracted with the values head-major (see
  :func:`weights_times_value`): the same products and sums as Flax's einsum,
  a faster layout for XLA's CPU matmuls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import dtypes as linen_dtypes
from flax.nnx.nn import attention as nnx_attention
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from unsplit._src import random
from unsplit._src.dropout.functional import Layout, check_rate, masked, sharding_specs

Array = jax.Array


def attention_dropout(
    key: Any, weights: Array, rate: Any, *, broadcast_dropout: bool, dtype: Any
) -> Array:
    """Drops attention weights ``[batch..., heads, q, k]`` in the grid layout.

    Args:
        key: ``dropout_rng``: a threefry PRNG key of shape ``()`` (or ``uint32[2]``).
        weights: the attention weights after the softmax.
        rate: the drop probability, in ``(0, 1]``.
        broadcast_dropout: share one ``(q, k)`` mask over the batch and head axes.
        dtype: the computation dtype: kept weights are divided by the keep
            probability in this dtype (as Flax multiplies by a multiplier of it).

    Returns:
        The dropped weights (``weights`` promoted with ``dtype``, as Flax's).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from unsplit._src.dropout.attention import attention_dropout
        >>> w = jnp.full((2, 3, 4, 4), 0.25)
        >>> y = attention_dropout(jax.random.key(0), w, 0.5, broadcast_dropout=True,
        ...                       dtype=jnp.float32)
        >>> bool(jnp.all(y == y[:1, :1])), sorted({float(v) for v in y.ravel()})
        (True, [0.0, 0.5])
    """
    rate = check_rate(rate)
    if key is None:
        raise TypeError(missing_rng_message(rate))
    data = random.key_data(key)
    if rate == 1.0:  # every weight dropped; no division by a keep probability of 0
        return weights * jnp.zeros((), dtype)
    if broadcast_dropout:
        shape = (1,) * (weights.ndim - 2) + tuple(weights.shape[-2:])
    else:
        shape = tuple(weights.shape)
    threshold = random.keep_threshold(rate)
    scaled = weights / jnp.asarray(random.keep_probability(threshold), dtype)
    return masked(
        data, np.uint32(threshold), scaled, Layout(True, shape, *sharding_specs(scaled, shape))
    )


VALUE_SUBSCRIPTS = "...hqk,...khd->...qhd"  # Flax's weights x value contraction


def weights_times_value(einsum: Callable[..., Array], weights: Array, value: Array) -> Array:
    """Flax's ``einsum("...hqk,...khd->...qhd", weights, value)``, contracted head-major.

    The value is moved to ``[..., heads, k, d]`` first and the result moved
    back from ``[..., heads, q, d]``: the same contraction (each output element
    is the same sum over ``k``), whose batch axes ``(..., heads)`` now lead in
    every operand. XLA's CPU matmuls then need no transposes of the large
    weights in the forward or backward pass: measured, the attention's
    forward+backward with dropout takes about 0.6x Flax's time instead of 0.8x
    (``benchmarks/attention_bench.py``), with the same bits on the tested shapes.

    Example:
        >>> import jax.numpy as jnp
        >>> from unsplit._src.dropout.attention import weights_times_value
        >>> w, v = jnp.ones((2, 3, 4, 5)), jnp.ones((2, 5, 3, 6))
        >>> bool(jnp.all(weights_times_value(jnp.einsum, w, v)
        ...              == jnp.einsum("...hqk,...khd->...qhd", w, v)))
        True
    """
    head_major = einsum("...hqk,...hkd->...hqd", weights, jnp.swapaxes(value, -2, -3))
    return jnp.swapaxes(head_major, -2, -3)


def missing_rng_message(rate: Any) -> str:
    return (
        f"dot_product_attention draws a dropout mask (dropout_rate={rate}, "
        "deterministic=False) but got dropout_rng=None. Fix: pass dropout_rng=key, or "
        "deterministic=True (the attention modules pass self.make_rng('dropout'))."
    )


def linen_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nn.Module | None = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
) -> Array:
    """``flax.linen.dot_product_attention`` with unsplit's attention-weight dropout.

    Same arguments, defaults, checks, errors and result as Flax's (see its
    docs); only the dropout mask differs (see :mod:`unsplit._src.dropout.attention`):
    a weight's mask bit depends only on the key and its ``(batch..., head,
    query, key position)`` coordinates. Pass it as ``attention_fn=`` of
    ``nn.MultiHeadDotProductAttention`` (or ``nn.MultiHeadAttention``,
    ``nn.SelfAttention``).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from unsplit import linen as ulinen
        >>> layer = nn.MultiHeadDotProductAttention(
        ...     num_heads=2, dropout_rate=0.1, deterministic=False,
        ...     attention_fn=ulinen.dot_product_attention)
        >>> x = jnp.ones((3, 8, 4))
        >>> params = layer.init(jax.random.key(0), x)  # no 'dropout' stream: 'params' is used
        >>> layer.apply(params, x, rngs={"dropout": jax.random.key(1)}).shape
        (3, 8, 4)
    """
    flax_args = (query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate)
    options = dict(
        deterministic=deterministic,
        dtype=dtype,
        precision=precision,
        module=module,
        force_fp32_for_softmax=force_fp32_for_softmax,
        einsum_dot_general=einsum_dot_general,
        qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum,
    )
    qk, av = qk_attn_weights_einsum, attn_weights_value_einsum
    invalid = bool(qk) != bool(av) or bool((precision or einsum_dot_general) and (qk or av))
    if deterministic or not dropout_rate > 0.0 or invalid:
        return nn.dot_product_attention(*flax_args, **options)  # Flax's path and errors
    head_major = not qk  # a user's own einsums get Flax's subscripts, as from Flax
    if not qk:  # the einsums Flax builds from precision / einsum_dot_general
        qk = av = functools.partial(
            jnp.einsum, precision=precision, _dot_general=einsum_dot_general or lax.dot_general
        )
    compute_dtype = linen_dtypes.canonicalize_dtype(query, key, value, dtype=dtype)

    def dropped_weights_times_value(subscripts: str, weights: Array, values: Array) -> Array:
        weights = attention_dropout(
            dropout_rng,
            weights,
            dropout_rate,
            broadcast_dropout=broadcast_dropout,
            dtype=compute_dtype,
        )
        if head_major and subscripts == VALUE_SUBSCRIPTS:
            return weights_times_value(av, weights, values)
        return av(subscripts, weights, values)

    # Flax computes the weights (deterministic: no mask of its own), we drop them just
    # before Flax's weights x value contraction.
    return nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        broadcast_dropout,
        None,
        dropout_rate,
        True,
        dtype,
        None,
        module,
        force_fp32_for_softmax,
        None,
        qk,
        dropped_weights_times_value,
    )


def nnx_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Callable[..., Any] = nnx_dtypes.promote_dtype,
    is_causal: bool = False,
) -> Array:
    """``flax.nnx.dot_product_attention`` with unsplit's attention-weight dropout.

    Same arguments, defaults, checks, errors and result as Flax's (see its
    docs; grouped-query attention included); only the dropout mask differs
    (see :mod:`unsplit._src.dropout.attention`): a weight's mask bit depends only on
    the key and its ``(batch..., head, query, key position)`` coordinates.
    Pass it as ``attention_fn=`` of ``nnx.MultiHeadAttention``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from unsplit import nnx as unnx
        >>> layer = nnx.MultiHeadAttention(
        ...     num_heads=2, in_features=4, dropout_rate=0.1, decode=False,
        ...     attention_fn=unnx.dot_product_attention, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((3, 8, 4)), deterministic=False).shape
        (3, 8, 4)
    """
    options = dict(
        broadcast_dropout=broadcast_dropout,
        dropout_rate=dropout_rate,
        dtype=dtype,
        precision=precision,
        promote_dtype=promote_dtype,
        is_causal=is_causal,
    )
    flax = functools.partial(nnx_attention.dot_product_attention, **options)
    if deterministic or not dropout_rate > 0.0:
        return flax(
            query,
            key,
            value,
            bias,
            mask,
            dropout_rng=dropout_rng,
            deterministic=deterministic,
            module=module,
        )

    # Flax's own checks of these very arguments, on shapes only (nothing runs): whatever this
    # Flax version raises, ours raises (Flax 0.12.12 added a rate check and a ValueError for a
    # missing dropout_rng; 0.12.8 has neither).
    def flax_checks(dropout_rng, deterministic=False):
        checked = functools.partial(flax, deterministic=deterministic)
        jax.eval_shape(checked, query, key, value, bias, mask, dropout_rng=dropout_rng)

    if dropout_rng is None:
        flax_checks(None, deterministic=True)  # the checks of everything else first, as Flax
        try:
            flax_checks(None)
        except Exception as error:  # Flax's error type for the missing key, with the fix
            raise type(error)(missing_rng_message(dropout_rate)) from error
        raise TypeError(missing_rng_message(dropout_rate))
    flax_checks(dropout_rng)
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    weights = nnx_attention.dot_product_attention_weights(
        query,
        key,
        bias,
        mask,
        broadcast_dropout,
        None,
        dropout_rate,
        True,  # Flax's weights without its mask; ours next
        query.dtype,
        precision,
        module,
        promote_dtype,
        is_causal,
    )
    weights = attention_dropout(
        dropout_rng, weights, dropout_rate, broadcast_dropout=broadcast_dropout, dtype=query.dtype
    )
    if weights.shape[-3] == value.shape[-2]:
        return weights_times_value(
            functools.partial(jnp.einsum, precision=precision), weights, value
        )
    # Grouped-query attention, contracted as Flax does: value heads shared by groups.
    q_heads, v_heads = weights.shape[-3], value.shape[-2]
    groups = weights.reshape(
        (*weights.shape[:-3], v_heads, q_heads // v_heads, *weights.shape[-2:])
    )
    value = jnp.expand_dims(value, axis=-2)
    out = jnp.einsum("...hgqk,...kh1d->...qhgd", groups, value, precision=precision)
    return out.reshape((*out.shape[:-3], q_heads, out.shape[-1]))
