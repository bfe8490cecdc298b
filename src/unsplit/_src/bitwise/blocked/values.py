"""The values of the canonical-block rewrite: a device's block and its split dimensions.

A dimension is named by the mesh axes it is split over; the names matter, not
the axes' sizes (:mod:`~unsplit._src.bitwise.blocked.rewrite`).

Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> from unsplit._src.bitwise.blocked import values
    >>> values.dims_of(P(None, "model"), 3)
    ((), ('model',), ())
    >>> values.block_count(12, 8), values.block_count(768, 8), values.block_count(8, 8)
    (2, 8, 4)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec as P

from unsplit._src import partition

Dims = tuple[tuple[str, ...], ...]  # per dimension: the mesh axes it is split over


DEFAULT_BLOCKS = 8


class Unsupported(Exception):
    """An equation the rewrite does not run on split dimensions (the message says which)."""


class BlockError(ValueError):
    """A split that does not divide a dimension's canonical block count."""


class V(NamedTuple):
    """A value of the evaluation: this device's block and how its dimensions are split."""

    value: Any
    dims: Dims


def replicated(x: Any) -> V:
    return V(x, ((),) * np.ndim(x))


def dims_of(spec: P, ndim: int) -> Dims:
    """A value's split dimensions from its spec."""
    entries = (*spec, *([None] * (ndim - len(spec))))
    return tuple(partition.names(e) for e in entries)


def block_count(size: int, blocks: int) -> int:
    """The canonical blocks of a split dimension of ``size``: the largest power of two
    dividing both ``blocks`` and ``size / 2``, so a block holds at least two elements.

    A degree that left one element of a dimension per device gave other bits (XLA
    simplifies ops on a dimension of one differently: a broadcast along it vanishes, a
    sum over it is no sum): measured on CPU with 4 experts over 4 devices, and with FSDP
    groups of one row per device.
    """
    half = size // 2
    return math.gcd(half & -half, blocks & -blocks) if half else 1
