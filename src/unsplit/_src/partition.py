"""PartitionSpec entries: the axis names in them, and specs with some axes kept or dropped.

A ``PartitionSpec`` entry is ``None`` (replicated), one mesh axis name, or a
tuple of names (the dimension is split over their product). Every part of
unsplit that reads or rewrites specs goes through these functions.

Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> from unsplit._src import partition
    >>> partition.names(("data", "fsdp")), partition.entry(("data",)), partition.entry(())
    (('data', 'fsdp'), 'data', None)
    >>> spec = P(("data", "fsdp"), "model", None)
    >>> sorted(partition.spec_axes(spec))
    ['data', 'fsdp', 'model']
    >>> partition.keep_axes(spec, ("fsdp", "model")) == P("fsdp", "model", None)
    True
    >>> partition.drop_axes(spec, ("fsdp",)) == P("data", "model", None)
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.sharding import PartitionSpec as P

Entry = None | str | tuple[str, ...]


def names(entry: Entry) -> tuple[str, ...]:
    """The mesh axis names of one spec entry (``()`` for ``None``)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entry(axes: Iterable[str]) -> Entry:
    """The spec entry that splits a dimension over ``axes``: None, a name, or a tuple."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def spec_axes(spec: Any) -> set[str]:
    """Every mesh axis named in ``spec``."""
    return {n for e in spec for n in names(e)}


def keep_axes(spec: Any, axes: Iterable[str]) -> P:
    """``spec`` with only the names in ``axes`` left (the others replicated)."""
    axes = tuple(axes)
    return P(*(entry(n for n in names(e) if n in axes) for e in spec))


def drop_axes(spec: Any, axes: Iterable[str]) -> P:
    """``spec`` with the names in ``axes`` removed (gathered over them)."""
    axes = tuple(axes)
    return P(*(entry(n for n in names(e) if n not in axes) for e in spec))


def plain(spec: Any) -> P:
    """``spec`` with ``P.UNCONSTRAINED`` entries as ``None`` (for reading axis names)."""
    return P(*(None if e is P.UNCONSTRAINED else e for e in spec))
