"""Bitwise mode's chunk settings and schedule checks: the default chunk size, the chunk
axes, whole chunks per group, and a warning for gathered params.

Example:
    >>> default_chunk_size(48), default_chunk_size(12)
    (8, 4)
    >>> check_chunk_axes("fsdp", ("data", "fsdp"))
    ('fsdp',)
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from jax.sharding import Mesh

from unsplit._src import links, partition
from unsplit._src.bitwise.blocked.values import block_count
from unsplit._src.bitwise.plan import Plan

DEFAULT_CHUNK = 8


def default_chunk_size(batch: int) -> int:
    """``min(8, the largest power of two dividing batch)``: depends on the batch only.

    The chunk size must not depend on the schedule (it fixes the bits), so the
    default is a function of the global batch size alone.
    """
    return min(DEFAULT_CHUNK, batch & -batch)


def check_chunk_axes(
    chunk_axes: Any, batch_axes: tuple[str, ...], mesh_axes: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    """``chunk_axes`` as a tuple of batch axes, in ``batch_axes``' order (``()``: none).

    They must be the last of the batch axes, so each group's rows are one
    contiguous block of the global batch, split over the group in order.
    """
    if chunk_axes is None:
        return ()
    names = (chunk_axes,) if isinstance(chunk_axes, str) else chunk_axes
    if not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"chunk_axes must be a mesh axis name or a tuple of names; got {chunk_axes!r}. "
            "Fix: e.g. chunk_axes='fsdp' (one of batch_axes)."
        )
    names = tuple(names)
    absent = [n for n in names if mesh_axes is not None and n not in mesh_axes]
    if absent:
        raise ValueError(
            f"chunk_axes names axes the step's mesh does not have: {absent} (its axes: "
            f"{tuple(mesh_axes or ())}). Fix: name the mesh axis whose devices compute each chunk "
            "together (one of batch_axes), e.g. chunk_axes='fsdp' on a ('data', 'fsdp') mesh."
        )
    unknown = [n for n in names if n not in batch_axes]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(
            f"chunk_axes must be distinct batch axes; expected a subset of "
            f"batch_axes={batch_axes}, got chunk_axes={chunk_axes!r}"
            + (f" ({unknown} not in batch_axes)" if unknown else "")
            + ". Fix: add the axis to batch_axes (the batch is split over the chunk axes "
            "too), e.g. batch_axes=('data', 'fsdp'), chunk_axes='fsdp'."
        )
    ordered = tuple(a for a in batch_axes if a in names)
    if batch_axes[len(batch_axes) - len(ordered) :] != ordered:
        fixed = (*(a for a in batch_axes if a not in names), *ordered)
        raise ValueError(
            f"chunk_axes must be the last of the batch axes (each group's rows are then one "
            f"block of the batch); got batch_axes={batch_axes}, chunk_axes={chunk_axes!r}. "
            f"Fix: batch_axes={fixed} (the order of batch axes does not change the bits)."
        )
    return ordered


def chunk_split(mesh: Mesh, chunk_axes: tuple[str, ...]) -> int:
    """How many pieces a chunk's rows are split into: the chunk axes' devices (1 without)."""
    return math.prod(mesh.shape[a] for a in chunk_axes)


# Bitwise mode warns once when params gathered over the batch axes exceed this, per device.
GATHERED_WARN_BYTES = 2**30


def check_schedule(size: int, chunk: int, shards: int, split: int, chunk_axes: tuple) -> None:
    """Refuses a chunk size that does not cut each group's share into whole chunks, with
    the chunk sizes that would (``shards``: the batch axes' devices; ``split``: a group's)."""
    groups = shards // split
    share = size // groups  # the step has checked that the batch axes divide the batch
    # The chunk sizes that would work here: multiples of the group's devices that divide
    # a group's share.
    fits = [c for c in range(split, share + 1, split) if share % c == 0]
    choices = choices_text(fits)
    if chunk % split:
        raise ValueError(
            f"bitwise mode with chunk_axes={chunk_axes} splits each chunk's rows over "
            f"the {split} devices of those axes: expected chunk_size a multiple of {split}, "
            f"got chunk_size={chunk}. Fix: pass chunk_size={choices} here (a multiple of "
            f"{split} that divides each group's {share} examples; the same one for every "
            "schedule you compare)."
        )
    if share % chunk and split > 1:
        raise ValueError(
            f"bitwise mode needs each device group's share of the batch to be a whole "
            f"number of chunks: batch {size} over {groups} group(s) of {split} device(s) "
            f"(chunk_axes={chunk_axes}) is {share} examples each, not a multiple of "
            f"chunk_size={chunk}. Fix: pass chunk_size={choices} (a multiple of {split} "
            f"that divides {share}), or use a bigger batch."
        )
    if share % chunk:
        fewer = " or use fewer devices for the batch" if groups > 1 else ""
        raise ValueError(
            f"bitwise mode needs each device's share of the batch to be a whole number of "
            f"chunks: batch {size} over {groups} batch device(s) is {share} examples each, "
            f"not a multiple of chunk_size={chunk}. Fix: pass chunk_size={choices} (it "
            f"must divide {share}; the same one for every schedule you compare: it fixes "
            f"the bits){fewer}."
        )


def warn_gathered(plan: Plan, batch_axes: tuple, chunk_axes: tuple, warned: set[str]) -> None:
    """Once (``warned``): params sharded over batch axes gathered whole on each device, and large."""
    if "gathered" in warned:
        return
    outer = [a for a in batch_axes if a not in chunk_axes]
    if not any(partition.spec_axes(s) & set(outer) for s in plan.specs):
        return
    size = sum(
        n * np.dtype(d).itemsize
        for n, d in zip(plan.params_flat.lengths, plan.params_flat.vectors, strict=True)
    )
    if size <= GATHERED_WARN_BYTES:
        return
    warned.add("gathered")
    warnings.warn(
        f"bitwise mode gathers the params sharded over the batch axes {tuple(outer)} whole "
        f"on every device: {size / 2**30:.1f} GiB per device (plus as much again for the "
        "partial sums). Fix: chunk_axes= names batch axes whose devices compute each chunk "
        "together with the params kept sharded over them (FSDP groups), e.g. "
        f"value_and_grad(..., bitwise=True, batch_axes=('data', 'fsdp'), "
        "chunk_axes='fsdp'); see " + links.doc_ref("bitwise", "fsdp-groups-chunk_axes") + ".",
        stacklevel=5,
    )


class GroupSizeWarning(UserWarning):
    """An FSDP group whose bits are its own size's only (it cannot share the row blocks)."""


def warn_group_size(plan: Plan, warned: set[str]) -> None:
    """Once (``warned``): an FSDP group whose devices do not divide the chunk's row blocks
    (its bits are then those of groups of its own size only)."""
    if not plan.chunk_axes or "group size" in warned:
        return
    devices = math.prod(plan.compute.shape[a] for a in plan.chunk_axes)
    count = block_count(plan.chunk, plan.canonical_blocks)
    if count % devices == 0:
        return
    warned.add("group size")
    fix = max(2 * devices, plan.chunk)
    warnings.warn(
        f"bitwise mode: FSDP groups of {devices} devices (chunk_axes={plan.chunk_axes}) at "
        f"chunk_size={plan.chunk} and blocks={plan.canonical_blocks} have {count} row blocks of "
        f"two or more rows, which {devices} devices cannot share: each device computes its "
        f"{plan.chunk // devices} row(s) as one block, and the bits match groups of "
        f"{devices} devices only. Fix: chunk_size={fix} (or a multiple: {devices} devices "
        f"then share its blocks){'' if devices <= plan.canonical_blocks else f' and blocks={devices}'}.",
        GroupSizeWarning,
        stacklevel=5,
    )


def choices_text(sizes: list[int]) -> str:
    """``[4, 8, 16]`` as ``"4, 8 or 16"`` (the largest few: larger chunks run faster)."""
    shown = [str(c) for c in sizes[-4:]]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]
