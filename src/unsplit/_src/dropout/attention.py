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
* one threefry hash serves four weights; its four keep bits are packed into a
  byte in the hash's own loop (a quarter byte per weight is all that is
  written, see :func:`unsplit._src.masks.grid_keep_mask_from_data`), and the
  backward pass draws the mask again instead of saving it (when forward and
  backward are one program, XLA computes the packed bits once for both);
* kept weights are divided by the keep probability the 16-bit threshold gives,
  so the expectation is exact; ``dropout_rate == 1`` gives zero weights where
  Flax accepts that rate (Flax's gives NaN: it divides by a keep probability of
  0); where the installed Flax refuses it, ours raises Flax's error;
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

from unsplit._src import masks, random
from unsplit._src.dropout.functional import MaskLayout, check_rate, masked, sharding_specs

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
    threshold = masks.keep_threshold(rate)
    scaled = weights / jnp.asarray(masks.keep_probability(threshold), dtype)
    return masked(
        data, np.uint32(threshold), scaled, MaskLayout(True, shape, *sharding_specs(scaled, shape))
    )


VALUE_SUBSCRIPTS = "...hqk,...khd->...qhd"  # Flax's weights x value contraction


def weights_times_value(einsum: Callable[..., Array], weights: Array, value: Array) -> Array:
    """Flax's ``einsum("...hqk,...khd->...qhd", weights, value)``, contracted head-major.

    The value is moved to ``[..., heads, k, d]`` first and the result moved
    back from ``[..., heads, q, d]``: the same contraction (each output element
    is the same sum over ``k``), whose batch axes ``(..., heads)`` now lead in
    every operand. XLA's CPU matmuls then need no transposes of the large
    weights in the forward or backward pass (the attention benchmark times both layouts; the figures are in the
    Benchmarks guide, https://unsplit.readthedocs.io/en/latest/benchmarks/).

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
    # ~65 lines with the inner function that drops the weights; split, Flax's call and our
    # mask would be read in two places.
    flax = functools.partial(
        nn.dot_product_attention,
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        broadcast_dropout=broadcast_dropout,
        dropout_rate=dropout_rate,
        dtype=dtype,
        module=module,
        force_fp32_for_softmax=force_fp32_for_softmax,
    )
    qk, av = qk_attn_weights_einsum, attn_weights_value_einsum
    invalid = bool(qk) != bool(av) or bool((precision or einsum_dot_general) and (qk or av))
    if deterministic or not dropout_rate > 0.0 or invalid:  # Flax's path and errors
        return flax(
            dropout_rng=dropout_rng,
            deterministic=deterministic,
            precision=precision,
            einsum_dot_general=einsum_dot_general,
            qk_attn_weights_einsum=qk,
            attn_weights_value_einsum=av,
        )
    head_major = not qk  # a user's own einsums get Flax's subscripts, as from Flax
    if not qk:  # the einsums Flax builds from precision / einsum_dot_general
        qk = av = functools.partial(
            jnp.einsum, precision=precision, _dot_general=einsum_dot_general or lax.dot_general
        )
    compute_dtype = linen_dtypes.canonicalize_dtype(query, key, value, dtype=dtype)
    value_einsum = av
    assert value_einsum is not None  # both einsums given, or both built just above

    def dropped_weights_times_value(subscripts: str, weights: Array, values: Array) -> Array:
        weights = attention_dropout(
            dropout_rng, weights, dropout_rate, broadcast_dropout=broadcast_dropout,
            dtype=compute_dtype,
        )  # fmt: skip
        if head_major and subscripts == VALUE_SUBSCRIPTS:
            return weights_times_value(value_einsum, weights, values)
        return value_einsum(subscripts, weights, values)

    # Flax computes the weights (deterministic: no mask of its own); we drop them just
    # before Flax's weights x value contraction.
    return flax(
        deterministic=True,
        qk_attn_weights_einsum=qk,
        attn_weights_value_einsum=dropped_weights_times_value,
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
    options: dict[str, Any] = dict(
        bias=bias,
        mask=mask,
        broadcast_dropout=broadcast_dropout,
        dropout_rate=dropout_rate,
        precision=precision,
        module=module,
        promote_dtype=promote_dtype,
        is_causal=is_causal,
    )
    flax = functools.partial(nnx_attention.dot_product_attention, query, key, value, **options)
    if deterministic or not dropout_rate > 0.0:
        return flax(dropout_rng=dropout_rng, deterministic=deterministic, dtype=dtype)
    # module=None: the checks run on shapes, so they must not sow into the module.
    _nnx_flax_checks(functools.partial(flax, dtype=dtype, module=None), dropout_rng, dropout_rate)
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    # Flax's weights without its mask (deterministic); ours next.
    weights = nnx_attention.dot_product_attention_weights(
        query, key, deterministic=True, dtype=query.dtype, **options
    )
    weights = attention_dropout(
        dropout_rng, weights, dropout_rate, broadcast_dropout=broadcast_dropout, dtype=query.dtype
    )
    return _nnx_weights_times_value(weights, value, precision)


def _nnx_flax_checks(flax: Callable[..., Array], dropout_rng: Any, dropout_rate: Any) -> None:
    """Flax's own checks of the call's arguments, on shapes only (nothing runs).

    Whatever the installed Flax raises, ours raises: its checks of everything
    else first (a shape error stays a shape error), then its error type for a
    missing ``dropout_rng``, with the fix in the message.
    """

    def check(rng, deterministic=False):
        jax.eval_shape(functools.partial(flax, deterministic=deterministic, dropout_rng=rng))

    if dropout_rng is not None:
        check(dropout_rng)
        return
    check(None, deterministic=True)
    try:
        check(None)
    except Exception as error:
        raise type(error)(missing_rng_message(dropout_rate)) from error
    raise TypeError(missing_rng_message(dropout_rate))


def _nnx_weights_times_value(weights: Array, value: Array, precision: Any) -> Array:
    """The dropped weights times the values, as Flax contracts them (grouped-query too)."""
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
