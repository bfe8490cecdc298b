"""Many arrays as a few flat vectors (one per dtype), and back: exact data movement.

Bitwise mode moves params into its per-group programs, and partial gradient
sums out of them, as flat vectors: then the host handles one array per dtype
and device whatever the number of parameters, and every add of partial sums is
one elementwise add over all of them (exactly rounded, as per leaf).

Typed PRNG keys travel as their ``uint32`` key data and are wrapped again.

Example:
    >>> import jax.numpy as jnp
    >>> from unsplit._src.bitwise.flat import FlatPlan
    >>> leaves = [jnp.ones((2, 3)), jnp.arange(4), jnp.zeros(5)]
    >>> plan = FlatPlan.of(leaves)
    >>> [v.shape for v in plan.pack(leaves)]
    [(11,), (4,)]
    >>> [x.shape for x in plan.unpack(plan.pack(leaves))]
    [(2, 3), (4,), (5,)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src import keys as keys_lib


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """Where each array lives in the flat vectors: its dtype's vector and its offset there."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]  # each array's dtype (a key dtype for typed keys)
    impls: tuple[Any, ...]  # each typed key's PRNG implementation (None for other arrays)
    vectors: tuple[Any, ...]  # the flat vectors' dtypes, in order of first use
    slots: tuple[tuple[int, int], ...]  # (vector index, offset) per array
    lengths: tuple[int, ...]  # per vector

    @staticmethod
    def of(arrays: Sequence[Any], shapes: Sequence[tuple[int, ...]] | None = None) -> FlatPlan:
        """The plan for ``arrays`` (or their given local ``shapes``)."""
        shapes = [tuple(np.shape(a)) for a in arrays] if shapes is None else list(shapes)
        is_key = [keys_lib.is_typed_key(a) for a in arrays]
        dtypes = [a.dtype if k else jnp.result_type(a) for a, k in zip(arrays, is_key, strict=True)]
        impls = [jax.random.key_impl(a) if k else None for a, k in zip(arrays, is_key, strict=True)]
        vectors: list[Any] = []
        lengths: list[int] = []
        slots = []
        for shape, dtype in zip(shapes, dtypes, strict=True):
            storage, per_element = _storage(dtype)
            if storage not in vectors:
                vectors.append(storage)
                lengths.append(0)
            v = vectors.index(storage)
            slots.append((v, lengths[v]))
            lengths[v] += math.prod(shape) * per_element
        return FlatPlan(
            tuple(shapes), tuple(dtypes), tuple(impls), tuple(vectors), tuple(slots), tuple(lengths)
        )

    def pack(self, arrays: Sequence[Any]) -> list[jax.Array]:
        """The flat vectors (one per storage dtype)."""
        parts: list[list[jax.Array]] = [[] for _ in self.vectors]
        for a, dtype, (v, _) in zip(arrays, self.dtypes, self.slots, strict=True):
            data = jax.random.key_data(a) if jnp.issubdtype(dtype, jax.dtypes.prng_key) else a
            parts[v].append(jnp.ravel(data).astype(self.vectors[v]))
        return [
            jnp.concatenate(p) if p else jnp.zeros((0,), d)
            for p, d in zip(parts, self.vectors, strict=True)
        ]

    def unpack(self, vectors: Sequence[jax.Array]) -> list[jax.Array]:
        """The arrays back from their flat vectors (exact: slices and reshapes)."""
        out = []
        for shape, dtype, impl, (v, offset) in zip(
            self.shapes, self.dtypes, self.impls, self.slots, strict=True
        ):
            if impl is not None:
                n = math.prod(shape) * 2
                data = vectors[v][offset : offset + n].reshape(*shape, 2)
                out.append(jax.random.wrap_key_data(data, impl=impl))
            else:
                n = math.prod(shape)
                out.append(vectors[v][offset : offset + n].reshape(shape).astype(dtype))
        return out


def _storage(dtype: Any) -> tuple[Any, int]:
    """The flat vector dtype an array of ``dtype`` is stored in, and words per element."""
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.dtype(jnp.uint32), 2
    return jnp.dtype(dtype), 1
