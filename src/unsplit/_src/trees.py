"""Comparing pytrees: bit-for-bit equality and relative distance.

Example:
    >>> import jax.numpy as jnp
    >>> from unsplit.testing import bits_equal, rel_l2
    >>> a = {"w": jnp.ones(3)}
    >>> bits_equal(a, {"w": jnp.ones(3)}), bits_equal(a, {"w": jnp.ones(3) + 1e-7})
    (True, False)
    >>> round(rel_l2({"w": jnp.array([1.0, 1.0])}, {"w": jnp.array([1.0, 0.0])}), 3)
    1.0
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def rel_l2(a: Any, b: Any) -> float:
    """Relative L2 distance ``|a - b| / |b|`` of two pytrees, over all their leaves together.

    Example:
        >>> import numpy as np
        >>> round(rel_l2({"w": np.array([3.0, 4.0])}, {"w": np.array([3.0, 4.5])}), 4)
        0.0925
    """
    la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
    num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(la, lb, strict=True))
    den = sum(float(np.sum(y**2)) for y in lb)
    return float(np.sqrt(num / max(den, 1e-300)))


def bits_equal(a: Any, b: Any) -> bool:
    """True when two pytrees have the same structure, dtypes and bit-identical leaves.

    Leaves may be any array layout: an accelerator's ``jax.device_get`` can return a
    non-contiguous NumPy view, compared here by value, not by memory.

    Example:
        >>> import numpy as np
        >>> x = np.arange(6.0).reshape(2, 3)
        >>> bits_equal({"w": x.T}, {"w": np.ascontiguousarray(x.T)})
        True
        >>> bits_equal(np.float32(0.0), np.float32(-0.0))  # equal as numbers, not as bits
        False
    """
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    return all(_same_bits(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True))


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return np.array_equal(_bytes(x), _bytes(y))


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.atleast_1d(x)).view(np.uint8)


def canonical_dtype(dtype: Any) -> Any:
    """The dtype JAX gives an array of ``dtype`` (int64 -> int32 without x64; keys as they
    are). Newer JAX warns at an abstract value of a dtype it would truncate."""
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)
