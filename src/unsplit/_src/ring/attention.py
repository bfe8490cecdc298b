"""``unsplit.ring_attention``: attention over a sequence split across devices, the same bits
at every split.

Called like Flax's ``dot_product_attention`` (``[batch..., length, heads, depth]``,
``dropout_rng``, ``dropout_rate``, ``broadcast_dropout``, ``deterministic``, ``is_causal``)
and like ringattention's ``ring_attention`` (inside ``jax.shard_map`` over the sequence
axis, on each device's part of the sequence, with ``axis_name=``). With ``mesh=`` it
declares that ``shard_map`` itself, so it plugs into ``attention_fn=`` of Flax's attention
modules. See :mod:`~unsplit._src.ring.passes` for how the ring runs and what it holds.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from unsplit._src import keys, masks, random
from unsplit._src.dropout.functional import check_rate
from unsplit._src.ring import passes, tiles

Array = jax.Array
MAX_DEFAULT_BLOCK = 128


def ring_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
    *,
    axis_name: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    block_size: int | None = None,
) -> Array:
    """Attention over a sequence split over a mesh axis; the same mask and bits at every split.

    Softmax attention of ``query`` over ``key``/``value`` (``[batch..., length, heads,
    depth]``, as ``flax.linen.dot_product_attention``), computed as a ring: each device
    holds ``L / S`` positions, the keys and values travel around the ``S`` devices of
    ``axis_name``, and no device ever holds a ``(L / S) x L`` score matrix. Its dropout
    keeps weight ``(batch..., head, q, k)`` by unsplit's rule for attention weights (the
    bit ``unsplit.linen.dot_product_attention`` draws for it: a function of the key and
    those coordinates only), and its partial softmaxes and gradient pieces are added in
    one fixed tree over the global block index, so the output and its gradients are the
    same bits at every ``S`` whose devices hold a power-of-two number of blocks
    (:mod:`unsplit._src.ring.passes` for the memory that costs).

    Three ways to call it:

    * inside ``jax.shard_map`` over ``axis_name`` (as ringattention's README calls its
      ring), on each device's part of the sequence;
    * with ``mesh=`` and ``axis_name=``: it declares that ``shard_map`` itself (the
      sequence dimension split over ``axis_name``; other axes stay the caller's) --
      e.g. ``attention_fn=functools.partial(unsplit.ring_attention, mesh=mesh,
      axis_name="seq", is_causal=True)`` of Flax's attention modules;
    * with neither: on one device, blockwise (the same bits as the ring).

    Args:
        query: ``[batch..., length, heads, depth]`` (each device's part).
        key: as ``query``.
        value: as ``query``.
        bias: not supported (a whole-sequence bias cannot be split over the ring): ``None``.
        mask: not supported, as ``bias``: ``None``; pass ``is_causal=True`` for a causal mask.
        broadcast_dropout: one ``(q, k)`` mask for every batch row and head (Flax's
            default), the mask of coordinate 0 of those axes.
        dropout_rng: a threefry key (``jax.random.key``), needed when dropping.
        dropout_rate: the probability of dropping an attention weight.
        deterministic: no dropout.
        dtype: the output's dtype (default: the inputs'); the scores, softmax and sums
            are computed in float32 (float64 for float64 inputs).
        precision: the dots' precision (``jax.lax.Precision``).
        module: must be ``None`` (a ring never forms the weights a module would sow).
        is_causal: each query attends to the keys at or before its position.
        axis_name: the mesh axis the sequence is split over.
        mesh: the mesh of ``axis_name``, to declare the ``shard_map`` here.
        block_size: queries and keys per tile (static). The bits depend on it: keep it
            the same at every degree you compare. Default: the largest power of two, at
            most 128, dividing ``L / 8`` (or ``L``), which every degree up to 8 that
            divides the sequence accepts.

    Returns:
        ``[batch..., length, heads, depth]``: this device's part of the output.

    Example:
        >>> import functools, jax, jax.numpy as jnp
        >>> import unsplit
        >>> from jax.sharding import PartitionSpec as P
        >>> q = k = v = jax.random.normal(jax.random.key(0), (32, 2, 8))
        >>> one = unsplit.ring_attention(q, k, v, is_causal=True)
        >>> mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> ring = jax.shard_map(
        ...     functools.partial(unsplit.ring_attention, axis_name="seq", is_causal=True),
        ...     mesh=mesh, in_specs=P("seq"), out_specs=P("seq"))
        >>> bool(jnp.allclose(ring(q, k, v), one, rtol=1e-6, atol=1e-7))  # 4 devices, one
        True
    """
    _check_flax_arguments(bias, mask, module)
    if mesh is not None:
        return _in_region(
            query, key, value, mesh, axis_name, broadcast_dropout, dropout_rng,
            dropout_rate, deterministic, dtype, precision, is_causal, block_size,
        )  # fmt: skip
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    _check_shapes(q, k, v, is_causal)
    out_dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(q, k, v)
    compute = jnp.promote_types(jnp.result_type(q, k, v), jnp.float32)
    size = _ring_size(axis_name)
    block = _block(block_size, q.shape[-3], k.shape[-3], size, axis_name)
    rate = 0.0 if deterministic else check_rate(dropout_rate)
    threshold = masks.keep_threshold(rate)
    scale = 1.0 / math.sqrt(q.shape[-1])
    options = tiles.Options(block, scale, bool(is_causal), threshold, precision)
    words = _words(dropout_rng, rate, q.shape[:-3], q.shape[-2], broadcast_dropout)
    ring = passes.Ring(axis_name, options)
    fn = functools.partial(passes.attention, ring=ring)
    for _ in q.shape[:-3]:  # the batch axes: one example at a time, each its own key words
        fn = jax.vmap(fn, in_axes=(0, 0, 0, 0 if words.ndim > 2 else None))
    out = fn(*(x.astype(compute) for x in (q, k, v)), words)
    return out.astype(out_dtype)


def _check_flax_arguments(bias: Any, mask: Any, module: Any) -> None:
    if mask is not None or bias is not None:
        what = "mask" if mask is not None else "bias"
        raise ValueError(
            f"ring_attention takes no {what} (got one of shape {np.shape(mask if mask is not None else bias)}): "
            "a mask or bias over the whole sequence cannot be split over the ring. Expected: "
            f"{what}=None. Fix: for causal attention pass is_causal=True (with Flax's "
            "attention modules: no mask, attention_fn=functools.partial("
            "unsplit.ring_attention, is_causal=True, ...))."
        )
    if module is not None:
        raise ValueError(
            "ring_attention cannot sow the attention weights into a module: a ring never "
            "forms them. Fix: call the attention module with sow_weights=False."
        )


def _check_shapes(q: Array, k: Array, v: Array, causal: bool) -> None:
    if (
        q.ndim < 3
        or k.shape != v.shape
        or q.shape[:-3] != k.shape[:-3]
        or q.shape[-2:] != k.shape[-2:]
    ):
        raise ValueError(
            "ring_attention expects query, key and value of shape [batch..., length, heads, "
            f"depth] with the same batch axes, heads and depth; got {q.shape=}, {k.shape=}, "
            f"{v.shape=}. Fix: project to [..., length, heads, depth] (as Flax's attention "
            "modules do) before the call."
        )
    if causal and q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"ring_attention with is_causal=True needs as many queries as keys on each "
            f"device; got {q.shape[-3]} queries and {k.shape[-3]} keys. Fix: split query, "
            "key and value over the same axis the same way."
        )


def _ring_size(axis_name: str | None) -> int:
    if axis_name is None:
        return 1
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"ring_attention got {axis_name=}, but no shard_map around the call is manual "
            "over that axis. Fix: call it inside jax.shard_map(..., mesh=mesh, in_specs="
            f"P(..., {axis_name!r}, None, None)), or pass mesh=mesh (it declares the "
            "shard_map itself), or axis_name=None on one device."
        ) from None


def default_block_size(length: int) -> int:
    """The default tile: the largest power of two, at most 128, dividing ``length / 8``
    (``length`` when 8 does not divide it): a function of the whole sequence only."""
    base = length // 8 if length % 8 == 0 else length
    return min(MAX_DEFAULT_BLOCK, base & -base)


def _block(block_size: Any, q_len: int, k_len: int, size: int, axis_name) -> int:
    if block_size is None:
        block = default_block_size(q_len * size)
    elif (
        isinstance(block_size, bool)
        or not isinstance(block_size, int | np.integer)
        or block_size < 1
    ):
        raise ValueError(
            f"ring_attention's block_size must be a positive int; got {block_size=}. Fix: "
            "e.g. block_size=128 (the same at every sequence degree you compare)."
        )
    else:
        block = int(block_size)
    for what, n in (("queries", q_len), ("keys", k_len)):
        if n % block:
            raise ValueError(
                f"ring_attention: each device's {what} ({n} positions, the sequence split "
                f"over {size} device(s) of {axis_name=}) are not a whole number of blocks of "
                f"{block=}. Expected: the sequence divisible into {size} x {block}-position "
                f"blocks. Fix: pass block_size= a power of two dividing {n} (the same at "
                "every degree you compare), or pad the sequence to a multiple of "
                f"{size * block}."
            )
    return block


def _words(rng: Any, rate: float, batch: tuple[int, ...], heads: int, broadcast: bool) -> Array:
    """Each (batch..., head)'s key words ``uint32[batch..., heads, 2]`` (``[1, 2]``: one
    shared mask), ``fold_in`` of the key by the leading coordinates (the grid layout)."""
    if rate == 0.0:
        return jnp.zeros((1, 2), jnp.uint32)
    if rng is None:
        raise ValueError(
            f"ring_attention draws a dropout mask ({rate=}, deterministic=False) but got "
            "dropout_rng=None. Fix: pass dropout_rng=key (a jax.random.key), or "
            "deterministic=True."
        )
    keys.check_key(rng, "ring_attention's dropout_rng")
    data = random.key_data(rng)
    lead = (*batch, heads)
    k0, k1 = data[0], data[1]
    for axis in range(len(lead)):  # key_c = fold_in(... fold_in(key, c_1) ..., c_n)
        shape = (1,) * len(lead) if broadcast else lead
        coord = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        k0, k1 = random.threefry2x32(k0, k1, jnp.zeros_like(coord), coord)
    words = jnp.stack([k0, k1], axis=-1)
    return words.reshape(1, 2) if broadcast else words


def _in_region(q, k, v, mesh, axis_name, broadcast, rng, rate, deterministic, dtype, precision,
               causal, block_size) -> Array:  # fmt: skip
    """The call declared in a ``shard_map`` over ``axis_name`` of ``mesh`` (the sequence
    dimension split over it; the caller's other axes left to the caller)."""
    if axis_name is None:
        raise ValueError(
            "ring_attention got mesh= without axis_name=. Fix: name the mesh axis the "
            "sequence is split over, e.g. axis_name='seq'."
        )
    q = jnp.asarray(q)
    dtype = None if dtype is None else jnp.dtype(dtype)
    region = _region(
        mesh, axis_name, q.ndim, broadcast, rate, deterministic, dtype, precision, causal,
        block_size,
    )  # fmt: skip
    return region(q, k, v, rng)


@functools.cache
def _region(mesh, axis_name, ndim, broadcast, rate, deterministic, dtype, precision, causal,
            block_size):  # fmt: skip
    """The jitted ``shard_map`` of one configuration (built once: a second call with the
    same settings does not trace again; inside a caller's jit it is inlined)."""
    seq = P(*(None,) * (ndim - 3), axis_name, None, None)

    def local(q_, k_, v_, rng_):
        return ring_attention(
            q_, k_, v_, broadcast_dropout=broadcast, dropout_rng=rng_, dropout_rate=rate,
            deterministic=deterministic, dtype=dtype, precision=precision, is_causal=causal,
            axis_name=axis_name, block_size=block_size,
        )  # fmt: skip

    region = jax.shard_map(
        local, mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=seq,
        axis_names={axis_name}, check_vma=False,
    )  # fmt: skip
    return jax.jit(region)  # eagerly, a shard_map manual over some axes only must be jitted
