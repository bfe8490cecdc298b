"""The rule: every example's randomness comes from its global id.

This module is the whole of unsplit's randomness contract. Everything else in
the library (the step, the dropout layers, the bitwise reductions) is built on
it, so its guarantees and their limits are stated here once.

**The rule.** A training step receives one *step key* (typically
``jax.random.fold_in(seed_key, step)``). Each example of the global batch has a
*global id*: by default its position in the global batch, or any stable record
id the data pipeline provides. The example's key is::

    example_keys(key, ids)[i] == jax.random.fold_in(key, ids[i])   # 0 <= ids[i] < 2**32

Because the key is a function of ``(step key, id)`` only, it does not depend on
how many devices share the batch, how many gradient-accumulation microbatches
it is cut into, in which order the examples arrive, or which process loads
them.

**64-bit ids.** Ids up to ``2**63 - 1`` are supported. The example key is the
threefry-2x32 block cipher of the step key applied to the id's two 32-bit
words ``(hi, lo)``; for ``hi == 0`` this is exactly ``fold_in``. A block cipher
is a bijection of its 64-bit input for a fixed key, so **distinct ids always
give distinct keys** (no birthday bound). With ``jax_enable_x64`` on, pass
``int64``/``uint64`` arrays. With it off (JAX's default) a JAX array cannot
hold 64-bit integers, so pass either a NumPy ``int64``/``uint64`` array (split
exactly on the host) or an :class:`Ids64` built by :func:`ids64` (two
``uint32`` words, usable inside ``jit``). Never pass an ``int64`` NumPy array
as an argument of your own ``jax.jit`` with x64 off: JAX converts it to
``int32`` without an error (id ``2**33 + i`` arrives as ``i``), and nothing
inside the function can tell; pass ``ids64(ids)`` instead.

**What is tied, what is independent.**

* equal ids give equal keys, hence *tied* noise across those examples;
* different ids give independent keys;
* a different step key gives new noise for every example.

**Limits.**

* Only ``threefry2x32`` keys (JAX's default) are accepted. ``rbg`` and
  ``unsafe_rbg`` keys do not give the same bits under ``vmap`` as one at a
  time (see the table in ``jax.random``'s docs), so the per-example rule would
  silently break; they are refused with an error.
* Legacy raw keys (``uint32[2]`` from ``jax.random.PRNGKey``) are accepted as
  threefry key data, like ``jax.random`` does, and give legacy raw keys back
  (shape ``ids.shape + (2,)``), so ``keys[i] == fold_in(key, ids[i])`` holds in
  both worlds.
* Negative ids are refused when the ids are concrete. Inside ``jit`` a traced
  signed id cannot be checked; it wraps modulo ``2**32`` exactly as
  ``jax.random.fold_in`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jex_random

_MAX_ID = 2**63 - 1
_THREEFRY = "threefry2x32"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Ids64:
    """Example ids of up to 63 bits, held as two ``uint32`` words.

    Use it when ids may exceed ``2**32 - 1`` and ``jax_enable_x64`` is off.
    Build it with :func:`ids64`; it is a pytree, so it can be passed through
    ``jit`` and sliced like an array of ids.

    Example:
        >>> import jax, numpy as np, unsplit
        >>> ids = unsplit.ids64(np.array([3, 2**40 + 7], dtype=np.int64))
        >>> ids.shape
        (2,)
        >>> unsplit.example_keys(jax.random.key(0), ids).shape
        (2,)
    """

    hi: jax.Array  # dtype=uint32, the id's upper 32 bits
    lo: jax.Array  # dtype=uint32, the id's lower 32 bits

    def __post_init__(self):
        _check_words(self.hi, self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.lo.shape)

    def __getitem__(self, index: Any) -> Ids64:
        return Ids64(hi=self.hi[index], lo=self.lo[index])

    def reshape(self, *shape: int) -> Ids64:
        return Ids64(hi=self.hi.reshape(*shape), lo=self.lo.reshape(*shape))


def _check_words(hi: Any, lo: Any) -> None:
    """Refuses float words (they would truncate silently) and hi/lo of different shapes.

    JAX rebuilds pytrees with placeholders (None, tracers, float0 tangents), so
    only words that carry a dtype or are Python numbers are checked; NumPy words
    are range-checked too (free: they are on the host).
    """
    shapes = []
    for name, word in (("hi", hi), ("lo", lo)):
        if isinstance(word, float | complex | list):  # not tuples: tree.map(np.shape, ids)
            word = np.asarray(word)
        dtype = getattr(word, "dtype", None)
        if dtype is None:
            continue
        if jnp.issubdtype(dtype, jnp.inexact) or jnp.issubdtype(dtype, jnp.bool_):
            raise TypeError(
                f"Ids64.{name} must hold integer words (uint32); got dtype={dtype}. Float words "
                "would be truncated silently, giving distinct ids the same noise. Fix: build "
                "the ids with unsplit.ids64(ids) from integer ids."
            )
        if isinstance(word, np.ndarray | np.generic) and np.size(word):
            top = 2**31 - 1 if name == "hi" else 2**32 - 1
            low, high = int(np.min(word)), int(np.max(word))
            if low < 0 or high > top:
                raise ValueError(
                    f"Ids64.{name} words must lie in [0, {top}]; got min={low}, max={high} "
                    f"(ids are at most 2**63 - 1). Fix: build the ids with unsplit.ids64(ids)."
                )
        shapes.append(tuple(np.shape(word)))
    if len(shapes) == 2 and shapes[0] != shapes[1]:
        raise ValueError(
            f"Ids64.hi and Ids64.lo must have the same shape, one pair of words per id; got "
            f"hi.shape={shapes[0]} and lo.shape={shapes[1]}. Fix: build the ids with "
            "unsplit.ids64(ids)."
        )


def ids64(values: Any) -> Ids64:
    """Splits integer ids (up to ``2**63 - 1``) exactly into an :class:`Ids64`.

    Args:
        values: integer ids, any shape: a Python int, a sequence, a NumPy
            array of any integer dtype, or a JAX integer array.

    Returns:
        An :class:`Ids64` whose keys equal ``fold_in(key, id)`` for ids below
        ``2**32``.

    Example:
        >>> import numpy as np, unsplit
        >>> ids = unsplit.ids64([0, 2**33])
        >>> int(ids.hi[1]), int(ids.lo[1])
        (2, 0)
    """
    if isinstance(values, Ids64):
        return values
    if isinstance(values, jax.Array) and not isinstance(values, jax.core.Tracer):
        values = np.asarray(values)
    if isinstance(values, jax.core.Tracer):
        _check_integer_dtype(values.dtype, "ids")
        hi, lo = _split_words(values)
        return Ids64(hi=hi, lo=lo)
    arr = np.asarray(values)
    if arr.dtype == object:
        raise TypeError(
            f"ids must be integers; got Python ints that do not fit 64 bits: {values!r}. "
            f"Fix: ids must lie in [0, 2**63 - 1]."
        )
    _check_integer_dtype(arr.dtype, "ids")
    _check_nonnegative(arr, "ids")
    wide = arr.astype(np.uint64)
    return Ids64(
        hi=jnp.asarray((wide >> np.uint64(32)).astype(np.uint32)),
        lo=jnp.asarray((wide & np.uint64(0xFFFFFFFF)).astype(np.uint32)),
    )


def example_keys(key: jax.Array, ids: Any) -> jax.Array:
    """Returns one PRNG key per example, a function of the step key and the id only.

    Args:
        key: the step key, a typed PRNG key of shape ``()`` made by
            ``jax.random.key`` (threefry2x32), or a legacy ``uint32[2]`` key.
        ids: the examples' global ids, any shape: an integer array with values
            in ``[0, 2**63 - 1]`` (64-bit values need x64, a NumPy array, or an
            :class:`Ids64`; see the module docs).

    Returns:
        Keys of shape ``ids.shape`` (legacy input: ``ids.shape + (2,)`` raw
        ``uint32``) with ``keys[i] == jax.random.fold_in(key, ids[i])`` for
        ``0 <= ids[i] < 2**32``. Distinct ids give distinct keys.

    Raises:
        TypeError: ``key`` is not a threefry PRNG key, or ``ids`` is not integer.
        ValueError: ``key`` is not a single key, or an id is negative or too big.

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> key = jax.random.key(0)
        >>> keys = unsplit.example_keys(key, jnp.arange(4))
        >>> bool(jnp.all(jax.random.key_data(keys[2])
        ...               == jax.random.key_data(jax.random.fold_in(key, 2))))
        True
    """
    key_data, typed_impl = _key_words(key)
    hi, lo = id_words(ids)
    shape = lo.shape
    n = lo.size
    if n == 0:
        data = jnp.zeros((*shape, 2), jnp.uint32)
    else:
        # threefry_2x32 enciphers the pairs (count[j], count[n + j]); fold_in(key, d)
        # is the pair (0, d), so the pair (hi, lo) extends it to 64-bit ids.
        count = jnp.concatenate([hi.reshape(-1), lo.reshape(-1)])
        out = jex_random.threefry_2x32(key_data, count)
        data = jnp.stack([out[:n], out[n:]], axis=-1).reshape(*shape, 2)
    if typed_impl is None:
        return data
    return jax.random.wrap_key_data(data, impl=typed_impl)


def is_typed_key(key: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(key, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def check_key(key: Any, what: str = "key") -> None:
    """Raises a clear error unless ``key`` is a single threefry PRNG key (no device work)."""
    _key_words(key, what, data=False)


def step_key(key: Any, step: Any = None) -> Any:
    """The step key ``jax.random.fold_in(key, step)`` (``key`` itself for ``step=None``);
    jittable, the same bits as a ``fold_in`` on the host."""
    return key if step is None else jax.random.fold_in(key, step)


def step_number(step: Any) -> Any:
    """``step=`` as the compiled programs take it, checked (no device work): ``None``; a
    Python or NumPy integer in ``[0, 2**32)`` as ``np.uint32`` (one type for every step,
    so nothing is traced again); an integer array of shape ``()`` (``state.step``) as it is.
    """
    if step is None:
        return None
    if isinstance(step, int | np.integer) and not isinstance(step, bool | np.bool_):
        if not 0 <= int(step) < 2**32:
            raise ValueError(
                f"step must be a step number in [0, 2**32) (it is folded into the key, "
                f"jax.random.fold_in(key, step)); got {step=}. Fix: pass the loop's counter."
            )
        return np.uint32(step)
    dtype = getattr(step, "dtype", None)
    if dtype is None or np.shape(step) != () or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"step must be an integer of shape () (the step number folded into the key); got "
            f"{step=}. Fix: pass the loop's counter (an int) or state.step."
        )
    return step


def _key_words(key: Any, what: str = "key", data: bool = True) -> tuple[Any, Any]:
    """Returns (uint32[2] key data, impl or None for a legacy key), validated."""
    if is_typed_key(key):
        impl = jax.random.key_impl(key)
        if str(impl) != _THREEFRY:
            raise TypeError(
                f"{what} uses the {str(impl)!r} PRNG implementation; unsplit needs "
                f"{_THREEFRY!r}. rbg and unsafe_rbg keys do not give the same bits under "
                "vmap as one example at a time, so per-example noise would silently depend "
                "on the batch. Fix: make the key with jax.random.key(seed) (the default "
                "threefry2x32 implementation)."
            )
        if key.shape != ():
            raise ValueError(
                f"{what} must be a single key of shape (); got a key array of shape "
                f"{key.shape}. Fix: pass the step key itself (e.g. "
                "jax.random.fold_in(seed_key, step)); unsplit derives the per-example keys."
            )
        return (jax.random.key_data(key) if data else None), impl
    dtype = getattr(key, "dtype", None)
    shape = getattr(key, "shape", None)
    if dtype == jnp.uint32 and shape is not None and tuple(shape) == (2,):
        config: Any = jax.config  # its flags are attributes the type stubs do not list
        default_impl = config.jax_default_prng_impl
        if default_impl != _THREEFRY:
            raise TypeError(
                f"{what} is a legacy uint32[2] key, which jax reads with the default PRNG "
                f"implementation {default_impl!r}, not {_THREEFRY!r}. "
                "Fix: pass a typed key made by jax.random.key(seed, impl='threefry2x32')."
            )
        return (jnp.asarray(key) if data else None), None
    raise TypeError(
        f"{what} must be a PRNG key made by jax.random.key(seed); got "
        f"{type(key).__name__} with dtype={dtype} and shape={shape}. "
        "Fix: key = jax.random.key(seed) (or jax.random.fold_in(key, step) per step)."
    )


def id_words(ids: Any) -> tuple[jax.Array, jax.Array]:
    """Returns the ids as (hi, lo) uint32 words, validated."""
    if isinstance(ids, Ids64):
        return jnp.asarray(ids.hi, jnp.uint32), jnp.asarray(ids.lo, jnp.uint32)
    if isinstance(ids, jax.core.Tracer):
        _check_integer_dtype(ids.dtype, "ids")
        return _split_words(ids)
    if isinstance(ids, jax.Array):
        _check_integer_dtype(ids.dtype, "ids")
        if jnp.issubdtype(ids.dtype, jnp.signedinteger) and ids.size and bool(jnp.min(ids) < 0):
            _check_nonnegative(np.asarray(ids), "ids")
        return _split_words(ids)
    if isinstance(ids, np.ndarray | np.generic) and np.asarray(ids).dtype.itemsize == 8:
        split = ids64(ids)  # exact on the host, also without x64
        return split.hi, split.lo
    arr = np.asarray(ids)
    if arr.dtype == object:
        return id_words(ids64(ids))
    _check_integer_dtype(arr.dtype, "ids")
    _check_nonnegative(arr, "ids")
    if arr.dtype.itemsize == 8:
        split = ids64(arr)
        return split.hi, split.lo
    return _split_words(jnp.asarray(arr))


def step_words(ids: Any, size: int, *, on_host: bool = False) -> tuple[Any, Any]:
    """A step's checked ids (``None``, :class:`Ids64` or an integer array) as (hi, lo) words.

    ``None`` is ``arange(size)`` (NumPy words with ``on_host``, for arrays that
    are placed later; JAX words otherwise, e.g. inside a compiled step). Reads
    nothing back from the device: the step checked the ids' dtype before, and
    negative values of a JAX array wrap as in ``fold_in``.
    """
    if ids is None:
        xp = np if on_host else jnp
        return xp.zeros(size, xp.uint32), xp.arange(size, dtype=xp.uint32)
    if isinstance(ids, Ids64):
        return ids.hi, ids.lo
    return _split_words(jnp.asarray(ids))


def _split_words(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    if jnp.dtype(ids.dtype).itemsize == 8:
        wide = ids.astype(jnp.uint64)
        return (wide >> 32).astype(jnp.uint32), (wide & 0xFFFFFFFF).astype(jnp.uint32)
    lo = ids.astype(jnp.uint32)
    return jnp.zeros_like(lo), lo


def _check_integer_dtype(dtype: Any, what: str) -> None:
    if not jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
        raise TypeError(
            f"{what} must be an integer array (the examples' global ids); got dtype={dtype}. "
            f"Fix: pass integer ids, e.g. jnp.arange(batch_size) or record ids as uint32/int64; "
            f"never float ids, which would silently round distinct ids together."
        )


def _check_nonnegative(arr: np.ndarray, what: str) -> None:
    if arr.size == 0:
        return
    lowest = int(arr.min())
    highest = int(arr.max())
    if lowest < 0:
        hint = ""
        if arr.dtype == np.int32:
            hint = (
                " Negative int32 ids are often int64 ids >= 2**31 that JAX truncated to int32 "
                "(jnp.asarray, jax.device_put or a jit argument, with x64 off): check them."
            )
        raise ValueError(
            f"{what} must be non-negative global example ids; got min({what})={lowest}.{hint} "
            f"Fix: use ids in [0, 2**63 - 1], e.g. the example's position in the global batch; "
            f"pass 64-bit ids as unsplit.ids64(ids) (two uint32 words, exact through jit)."
        )
    if highest > _MAX_ID:
        raise ValueError(
            f"{what} must be at most 2**63 - 1; got max({what})={highest}. "
            f"Fix: map record ids into [0, 2**63 - 1]."
        )
