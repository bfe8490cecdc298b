"""Fast, prefix-stable dropout: a function and drop-in Flax layers.

* :func:`dropout` -- ``dropout(key, x, rate, *, broadcast_dims=())``, for
  Equinox-style code where keys are passed explicitly;
* :class:`LinenDropout` (``unsplit.linen.Dropout``) -- the fields and
  ``__call__`` of ``flax.linen.Dropout``;
* :class:`NNXDropout` (``unsplit.nnx.Dropout``) -- the constructor and
  ``__call__`` of ``flax.nnx.Dropout``.

Semantics follow Flax: ``rate`` is the drop probability; ``rate == 0`` returns
the input itself and ``rate == 1`` returns zeros (no draw, no NaN gradients);
kept elements are ``x / (1 - rate)`` computed in ``x``'s dtype; a
deterministic layer returns its input; ``broadcast_dims`` share one mask
along those axes (the mask is drawn with those axes of size 1).

Differences from Flax, on purpose:

* the mask comes from :mod:`unsplit._src.random`: element ``i`` of the mask
  depends only on ``(key, i)`` (prefix-stable) and one threefry hash serves
  four elements, so the bits differ from ``jax.random.bernoulli``'s and
  ``rate`` has a resolution of ``2**-16``;
* the backward pass regenerates the mask from the key (``jax.custom_vjp``)
  instead of autodiff saving it;
* a missing rng stream is an error: Linen's ``make_rng`` silently falls back
  to the ``'params'`` stream and ``nnx.Rngs`` to ``'default'``, which would
  silently share noise between layers that should differ;
* ``rate`` outside ``[0, 1]`` and non-float inputs are clear errors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import errors as flax_errors
from flax import nnx
from jax import lax

from unsplit._src import random


def dropout(
    key: jax.Array, x: jax.typing.ArrayLike, rate: float, *, broadcast_dims: Sequence[int] = ()
) -> jax.Array:
    """Zeroes each element of ``x`` with probability ``rate``; scales the rest by ``1/(1-rate)``.

    The mask element at flat index ``i`` depends only on ``(key, i)``, so a
    longer (padded) ``x`` keeps the same mask on the shared prefix. Give each
    example its own key (``unsplit.example_keys``) and ``jax.vmap`` over them.

    Args:
        key: a threefry PRNG key of shape ``()`` (``jax.random.key``), or a
            legacy ``uint32[2]`` key.
        x: a floating-point array (float16, bfloat16, float32, float64).
        rate: the drop probability, a Python number in ``[0, 1]`` (resolution
            ``2**-16``). ``0`` returns ``x``; ``1`` returns zeros.
        broadcast_dims: axes of ``x`` that share one mask (the mask is drawn
            with these axes of size 1).

    Returns:
        An array of ``x``'s shape and dtype.

    Raises:
        ValueError: ``rate`` is outside ``[0, 1]``, or a ``broadcast_dims``
            entry is not an axis of ``x``.
        TypeError: ``rate`` is traced, ``x`` is not floating point, or ``key``
            is not a threefry key.

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> y = unsplit.dropout(jax.random.key(0), jnp.ones((2, 4)), 0.5)
        >>> sorted({float(v) for v in y.ravel()})
        [0.0, 2.0]
        >>> keys = unsplit.example_keys(jax.random.key(1), jnp.arange(8))
        >>> jax.vmap(lambda k, x: unsplit.dropout(k, x, 0.1))(keys, jnp.ones((8, 16))).shape
        (8, 16)
    """
    rate = check_rate(rate)
    x = jnp.asarray(x)
    check_floating(x)
    data = random.key_data(key)
    shape = mask_shape(x.shape, broadcast_dims)
    if rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    return _dropout(data, x, rate, shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dropout(data: jax.Array, x: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    return _apply_mask(data, x, rate, shape)


def _dropout_fwd(data, x, rate, shape):
    return _apply_mask(data, x, rate, shape), data


def _dropout_bwd(rate, shape, data, g):
    # The residual is the key alone: the mask is drawn again, never stored.
    return None, _apply_mask(data, g, rate, shape)


_dropout.defvjp(_dropout_fwd, _dropout_bwd)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _apply_mask(data: jax.Array, x: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    x_spec, spec = _specs(x, shape)
    mask = random.mask_from_data(data, shape, random.keep_threshold(rate), spec)
    mask = jnp.broadcast_to(mask, x.shape, out_sharding=x_spec)
    keep_prob = 1.0 - rate
    return lax.select(mask, x / keep_prob, jnp.zeros_like(x))  # as flax does


def _specs(x: jax.Array, shape: tuple[int, ...]) -> tuple[jax.P | None, jax.P | None]:
    """x's and the mask's PartitionSpecs when x is sharded over explicit mesh axes, else None."""
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    if spec is None or all(entry is None for entry in spec):
        return None, None
    entries = (*spec, *([None] * (len(shape) - len(spec))))
    return spec, jax.P(*(None if size == 1 else e for size, e in zip(shape, entries, strict=True)))


def check_rate(rate: Any) -> float:
    """Returns ``rate`` as a float, or raises a clear error unless it is in ``[0, 1]``."""
    if isinstance(rate, jax.core.Tracer):
        raise TypeError(
            f"dropout rate must be a concrete Python number; got a traced value {rate=}. "
            "Fix: pass the rate as a static Python float (e.g. rate=0.1), not a jit argument "
            "(use static_argnames for it)."
        )
    try:
        value = float(rate)
    except (TypeError, ValueError):
        raise TypeError(
            f"dropout rate must be a number in [0, 1]; got {rate=!r} of type "
            f"{type(rate).__name__}. Fix: pass e.g. rate=0.1."
        ) from None
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(
            f"dropout rate must be in [0, 1] (the probability of dropping an element, "
            f"not of keeping it); got {rate=}. Fix: pass e.g. rate=0.1; for a keep "
            "probability p use rate=1 - p."
        )
    return value


def check_floating(x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"dropout needs a floating-point input; got dtype={x.dtype}. Fix: cast it, e.g. "
            "x.astype(jnp.float32) (kept elements are scaled by 1 / (1 - rate))."
        )


def mask_shape(shape: tuple[int, ...], broadcast_dims: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with the ``broadcast_dims`` axes set to 1 (as flax does)."""
    out = list(shape)
    for dim in broadcast_dims:
        if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
            raise ValueError(
                f"broadcast_dims must be axes of the input; got {broadcast_dims=} for an "
                f"input of shape {tuple(shape)}. Fix: use axes in [-{len(shape)}, "
                f"{len(shape) - 1}], e.g. broadcast_dims=(0,) to share the mask over axis 0."
            )
        out[dim] = 1
    return tuple(out)


class LinenDropout(nn.Dropout):
    """``flax.linen.Dropout`` with unsplit's fast prefix-stable mask.

    Same fields and ``__call__`` as ``flax.linen.Dropout`` (it is a subclass):
    ``rate``, ``broadcast_dims``, ``deterministic``, ``rng_collection``
    (default ``'dropout'``) and ``__call__(inputs, deterministic=None,
    rng=None)``. Unlike Flax it never falls back to the ``'params'`` stream:
    without a ``rng_collection`` stream (and no ``rng=``) it raises.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from unsplit import linen as ulinen
        >>> layer = ulinen.Dropout(0.5, deterministic=False)
        >>> y = layer.apply({}, jnp.ones((2, 4)), rngs={"dropout": jax.random.key(0)})
        >>> sorted({float(v) for v in y.ravel()})
        [0.0, 2.0]
        >>> ulinen.Dropout(0.5).apply({}, jnp.ones(3), deterministic=True)
        Array([1., 1., 1.], dtype=float32)
    """

    @nn.compact
    def __call__(
        self, inputs: Any, deterministic: bool | None = None, rng: jax.Array | None = None
    ) -> jax.Array:
        """Applies a random dropout mask to ``inputs`` (see ``flax.linen.Dropout``).

        Args:
            inputs: the inputs to mask.
            deterministic: if true, ``inputs`` are returned as they are; must be
                given here or as the field, not both.
            rng: an optional key; by default one is made with
                ``make_rng(self.rng_collection)``.

        Returns:
            The masked inputs scaled by ``1 / (1 - rate)``.
        """
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        rate = check_rate(self.rate)
        if rate == 0.0 or deterministic:
            return inputs
        if rate == 1.0:  # no draw: prevents NaN gradients, as flax does
            return jnp.zeros_like(inputs)
        if rng is None:
            if not self.has_rng(self.rng_collection):
                raise flax_errors.InvalidRngError(_linen_missing_stream(self))
            rng = self.make_rng(self.rng_collection)
        return dropout(rng, inputs, rate, broadcast_dims=self.broadcast_dims)


def _linen_missing_stream(module: nn.Module) -> str:
    streams = sorted(getattr(module.scope, "rngs", {}))
    name = module.rng_collection
    return (
        f"{type(module).__name__} {module.name!r} draws its mask from the rng stream "
        f"rng_collection={name!r}, but the rng streams passed are {streams}. (flax's "
        "make_rng would silently use the 'params' stream instead; unsplit refuses, since "
        f"that ties dropout noise to parameter init.) Fix: pass rngs={{{name!r}: key}} to "
        f"apply (and rngs={{'params': k1, {name!r}: k2}} to init), pass rng=key at call, "
        "or use deterministic=True."
    )


class NNXDropout(nnx.Dropout):
    """``flax.nnx.Dropout`` with unsplit's fast prefix-stable mask.

    Same constructor and ``__call__`` as ``flax.nnx.Dropout`` (it is a
    subclass, so ``model.train()``, ``model.eval()``, ``nnx.view`` and filters
    on ``nnx.Dropout`` work): ``Dropout(rate, *, broadcast_dims=(),
    deterministic=False, rng_collection='dropout', rngs=None)``. With ``rngs``
    an ``nnx.Rngs``, the layer forks its ``rng_collection`` stream, and each
    call draws the next key from it. Unlike Flax, a missing stream is an error,
    never a silent fallback to ``'default'``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from unsplit import nnx as unnx
        >>> layer = unnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
        >>> a, b = layer(jnp.ones(64)), layer(jnp.ones(64))
        >>> bool(jnp.any(a != b)), int(layer.rngs.count[...])
        (True, 2)
        >>> unnx.Dropout(0.5, rngs=nnx.Rngs(0))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: NNXDropout reads the rng stream rng_collection='dropout', but ...
    """

    def __init__(
        self,
        rate: float,
        *,
        broadcast_dims: Sequence[int] = (),
        deterministic: bool | None = False,
        rng_collection: str = "dropout",
        rngs: nnx.Rngs | nnx.RngStream | None = None,
    ):
        check_rate(rate)
        self.rate = rate
        self.broadcast_dims = broadcast_dims
        self.deterministic = deterministic
        self.rng_collection = rng_collection
        if isinstance(rngs, nnx.Rngs):
            self.rngs = _nnx_stream(rngs, rng_collection, "constructor").fork()
        elif isinstance(rngs, nnx.RngStream):
            self.rngs = rngs.fork()
        elif rngs is None:
            self.rngs = nnx.data(None)
        else:
            raise TypeError(
                f"rngs must be an nnx.Rngs, nnx.RngStream or None; got {type(rngs).__name__}. "
                f"Fix: Dropout(rate, rngs=nnx.Rngs({rng_collection}=0))."
            )

    def __call__(
        self,
        inputs: Any,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
    ) -> jax.Array:
        """Applies a random dropout mask to ``inputs`` (see ``flax.nnx.Dropout``).

        Args:
            inputs: the inputs to mask.
            deterministic: if true, ``inputs`` are returned as they are; takes
                precedence over the constructor's ``deterministic``.
            rngs: an optional ``nnx.Rngs``, ``nnx.RngStream`` or key; takes
                precedence over the stream stored at construction.

        Returns:
            The masked inputs scaled by ``1 / (1 - rate)``.
        """
        deterministic = deterministic if deterministic is not None else self.deterministic
        if deterministic is None:
            raise ValueError(
                "No `deterministic` argument was provided to Dropout: got deterministic=None "
                "at construction and at call. Fix: Dropout(..., deterministic=True/False), "
                "call it with deterministic=True/False, or use model.train() / model.eval()."
            )
        rate = check_rate(self.rate)
        if rate == 0.0 or deterministic:
            return inputs
        if rate == 1.0:  # no draw: prevents NaN gradients, as flax does
            return jnp.zeros_like(inputs)
        source = rngs if rngs is not None else self.rngs
        if isinstance(source, nnx.Rngs):
            key = _nnx_stream(source, self.rng_collection, "call")()
        elif isinstance(source, nnx.RngStream):
            key = source()
        elif isinstance(source, jax.Array):
            key = source
        elif source is None:
            raise ValueError(
                "`deterministic` is False, but no `rngs` argument was provided to Dropout "
                "as either a __call__ argument or class attribute. Fix: "
                f"Dropout(rate, rngs=nnx.Rngs({self.rng_collection}=0)), or call it with "
                "rngs=key, or deterministic=True."
            )
        else:
            raise TypeError(
                f"rngs must be an nnx.Rngs, nnx.RngStream or jax.Array key; got "
                f"{type(source).__name__}. Fix: call with rngs=jax.random.key(seed)."
            )
        return dropout(key, inputs, rate, broadcast_dims=self.broadcast_dims)


def _nnx_stream(rngs: nnx.Rngs, name: str, where: str) -> nnx.RngStream:
    if name not in rngs:
        raise ValueError(
            f"NNXDropout reads the rng stream rng_collection={name!r}, but the nnx.Rngs "
            f"passed at {where} has the streams {sorted(rngs)}. (nnx.Rngs would silently "
            "fall back to 'default', sharing noise with every other user of that stream; "
            f"unsplit refuses.) Fix: nnx.Rngs(0, {name}=1), or Dropout(..., "
            "rng_collection='default') to use the default stream on purpose."
        )
    return rngs[name]
