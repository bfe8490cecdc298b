"""Choosing bitwise mode's chunk size for every schedule a run may use: ``chunk_size_for``.

The chunk size fixes a bitwise step's bits, so the schedules whose results
should agree must share it, and each of them must accept it:

* the batch axes' devices ``d`` divide the global batch (as in default mode);
* with FSDP groups (``chunk_axes``, groups of ``G`` devices) each group's rows
  are split over its ``G`` devices, so ``d`` is a multiple of ``G`` and the
  chunk a multiple of ``G``;
* each group's share, ``global_batch // (d // G)`` examples, is a whole number
  of chunks;
* groups of several sizes ``G`` agree when each device computes its rows as
  the chunk's canonical row blocks (``block_count(chunk, blocks)`` blocks of at
  least two rows, shared by the group's devices): every listed ``G`` divides
  that block count. A group of one size alone has no such rule (its bits are
  then its own size's).

The valid chunks are then the multiples of every ``G`` dividing the greatest
common divisor of the shares (and, with several group sizes, whose row blocks
every ``G`` divides); :func:`chunk_size_for` returns the largest (or the
largest not above ``at_most``).

Given a bitwise step and its inputs, it also keeps to the largest that **fits**:
a candidate's chunk program is compiled (as the step's first call compiles it,
and cached for it) and fits when the memory check
(:mod:`unsplit._src.step.memory`) accepts it with a margin left for what the
step holds beside it while it runs: the partial sums of the canonical tree
(``floor(log2(chunks per group))`` more sums vectors, at the listed schedule
with the most chunks per group) and :data:`HEADROOM` of the free memory (the
allocator's fragmentation). Candidates are tried largest first, then by
bisection: a few compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax

from unsplit._src import frozen as frozen_lib
from unsplit._src.bitwise.blocked.values import block_count
from unsplit._src.bitwise.cost import _held_sums
from unsplit._src.step import memory

#: The share of a device's free memory a fitting chunk leaves unused (the allocator's
#: fragmentation, buffers XLA's analysis does not count).
HEADROOM = 0.05


def chunk_size_for(
    global_batch: int,
    batch_devices: int | Sequence[int] = (1, 8, 64),
    *,
    group_devices: int | Sequence[int] = 1,
    blocks: int = 8,
    at_most: int | None = None,
    step: Any = None,
    params: Any = None,
    batch: Any = None,
    key: jax.Array | None = None,
    frozen: Any = None,
) -> int:
    """The largest bitwise ``chunk_size`` that every listed schedule accepts (and that fits).

    Pass the result as ``unsplit.value_and_grad(..., bitwise=True,
    chunk_size=...)`` on every schedule: the runs then agree bit for bit
    whichever of these device counts (and any ``microbatches``) computes them.
    A larger chunk means fewer, larger chunk programs (faster) but more
    activation memory per device; ``at_most`` caps it.

    Args:
        global_batch: examples per step (with ``group_size=G``, rows // G).
        batch_devices: the numbers of devices the batch axes may span (the
            product of the ``batch_axes`` sizes), one int or several.
        group_devices: with ``chunk_axes`` (FSDP groups), the devices of the
            chunk axes: every chunk is split over them. Several sizes (e.g.
            ``(2, 4, 8)``): the chunk's row blocks are then shared by groups of
            each size, so all of them give the same bits.
        blocks: the step's ``Bitwise(blocks=...)`` (8 by default): the most
            row blocks a chunk is cut into for FSDP groups of several sizes.
        at_most: the largest chunk size to consider (activation memory).
        step: a bitwise step (``value_and_grad(..., bitwise=True)``, a
            per-example loss), with ``params``, ``batch`` (the global batch of
            ``global_batch`` examples), ``key`` (and ``frozen``) as it will be called: the
            chunk must then also fit its devices' free memory, with the margin
            the step needs beside its chunk program (see the module). Its own
            ``chunk_size`` is ignored; the candidates' programs are compiled
            (a few compiles) and kept for a step of the same loss function.

    Returns:
        The largest chunk size, a multiple of each ``group_devices`` dividing
        every group's share of the batch (with several group sizes: whose row
        blocks each of them divides), not above ``at_most`` and, with ``step``,
        fitting the devices' memory (on a backend that reports no free memory,
        unchecked: as the memory check).

    Raises:
        ValueError: a device count does not divide the batch or is not a
            multiple of each ``group_devices``, ``blocks`` is not a power of two,
            ``at_most`` is below their least
            common multiple, or no chunk has row blocks that every listed group
            size divides; with
            ``step``, not even the smallest chunk fits, or the batch is not
            ``global_batch`` examples.
        TypeError: an argument is not a positive int; ``step`` is not a
            bitwise step of a per-example loss, or its inputs are missing.

    Example:
        >>> import unsplit
        >>> unsplit.chunk_size_for(512, (1, 8, 64))  # shares 512, 64 and 8 examples
        8
        >>> unsplit.chunk_size_for(512, (1, 8)), unsplit.chunk_size_for(512, (1, 8), at_most=16)
        (64, 16)
        >>> unsplit.chunk_size_for(96, (4, 8), group_devices=4)  # 1 or 2 groups of 4
        48
        >>> unsplit.chunk_size_for(64, 8, group_devices=(2, 4, 8))  # 8 row blocks of 2 rows
        16

        The largest that also fits the device's memory (here all of them do):

        >>> import jax, jax.numpy as jnp
        >>> step = unsplit.value_and_grad(lambda w, x, key: jnp.sum(w * x), bitwise=True)
        >>> unsplit.chunk_size_for(32, 1, step=step, params=jnp.ones(4), batch=jnp.ones((32, 4)),
        ...                        key=jax.random.key(0))
        32
    """
    size = _positive("global_batch", global_batch)
    groups = _group_sizes(group_devices)
    row_blocks = _positive("blocks", blocks)
    if row_blocks & (row_blocks - 1):
        raise ValueError(
            f"blocks must be a power of two, as the step's Bitwise(blocks=...) is; got "
            f"blocks={row_blocks}. Fix: pass the step's blocks, e.g. blocks=8 (the default)."
        )
    devices = _device_counts(batch_devices)
    cap = None if at_most is None else _positive("at_most", at_most)
    shares = []
    for group in groups:
        for d in devices:
            if d % group:
                raise ValueError(
                    f"with FSDP groups of group_devices={group} every batch device count must "
                    f"be a multiple of {group} (the batch axes include the chunk axes); got "
                    f"batch_devices={devices}, {d} is not. Fix: drop {d}, or list counts like "
                    f"{tuple(group * k for k in (1, 2, 4))}."
                )
            if size % d:
                raise ValueError(
                    f"every batch device count must divide the global batch (each device gets "
                    f"whole examples); got global_batch={size}, batch_devices={devices}: {d} "
                    f"does not divide {size}. Fix: drop {d}, or use a global batch that is a "
                    f"multiple of {math.lcm(*devices)}."
                )
            shares.append(size // (d // group))
    # Every share is group * (size // d), so with one group size the multiples of it dividing
    # their gcd include the group itself: only at_most can leave no chunk. Several sizes need
    # a common multiple of theirs dividing every share, and row blocks they all divide.
    step_size = math.lcm(*groups)
    common = functools.reduce(math.gcd, shares)
    fits = [c for c in range(step_size, common + 1, step_size) if common % c == 0]
    if not fits:
        raise ValueError(
            f"no chunk size is split evenly over groups of each of {_text(groups)} devices "
            f"(a multiple of {step_size}) and divides every group's share of the batch "
            f"({sorted(set(shares))} examples); got global_batch={size}, batch_devices="
            f"{devices}. Fix: group sizes that divide each other (e.g. (2, 4, 8)), or a "
            f"global batch that is a multiple of {math.lcm(*devices) * step_size}."
        )
    if cap is not None and cap < step_size:
        raise ValueError(
            f"no chunk size fits: with FSDP groups of group_devices={_text(groups)} a chunk is "
            f"split over each group's devices, so expected a multiple of {step_size}, at most "
            f"at_most={cap}; got none. Fix: at_most >= {step_size} (or smaller groups)."
        )
    fits = [c for c in fits if cap is None or c <= cap]
    if len(groups) > 1:
        shared = [c for c in fits if all(block_count(c, row_blocks) % g == 0 for g in groups)]
        if not shared:
            counts = {c: block_count(c, row_blocks) for c in fits}
            raise ValueError(
                f"no chunk size lets FSDP groups of {_text(groups)} devices share its row "
                f"blocks (each device computes its rows as the chunk's canonical row blocks of "
                f"two or more rows, at most blocks={row_blocks}; every group size must divide "
                f"their number, or its bits are its own size's); got global_batch={size}, "
                f"batch_devices={devices}: the valid chunks {sorted(counts)} have "
                f"{sorted(set(counts.values()))} row blocks. Fix: "
                f"{_shared_blocks_fix(groups, max(fits), row_blocks)}."
            )
        fits = shared
    if step is None:
        return fits[-1]
    held = {c: max(_held(size // c, share // c) for share in shares) for c in fits}
    return _largest_that_fits(step, (params, batch, key), frozen, batch_size=size, fits=held)


def _held(chunks: int, per_group: int) -> int:
    """The most partial sums a group holds beside its chunk program's output, at the
    schedule whose groups run ``per_group`` of the step's ``chunks`` chunks each."""
    return max(_held_sums(g * per_group, per_group) for g in range(chunks // per_group)) - 1


def _largest_that_fits(step, inputs: tuple, frozen, *, batch_size: int, fits: dict) -> int:
    """The largest chunk of ``fits`` (chunk -> the partial sums held beside it) whose program
    the memory check accepts with the step's margin: the largest first, then bisection."""
    engine = getattr(step, "_engine", None)
    if getattr(engine, "chunk", None) is None or getattr(
        getattr(engine, "spec", None), "coupled", True
    ):
        raise TypeError(
            f"chunk_size_for(step=...) compiles a bitwise step's chunk programs; got "
            f"step={step!r}. Fix: pass a step made with unsplit.value_and_grad(loss_fn, "
            "bitwise=True) of a per-example loss (a batch_loss step runs other programs: "
            "pick its chunk with at_most=...)."
        )
    missing = [n for n, v in zip(("params", "batch", "key"), inputs, strict=True) if v is None]
    if missing:
        raise TypeError(
            f"chunk_size_for(step=...) compiles the step for its inputs; got no {missing}. "
            "Fix: pass params=, batch= and key= as you will call the step."
        )
    params, batch, key = inputs
    inputs = (frozen_lib.combine(params, frozen), batch, key)  # as the step combines them
    rows = jax.tree.leaves(batch)[0].shape[0]
    if step.group_size is None and rows != batch_size:
        raise ValueError(
            f"chunk_size_for(global_batch={batch_size}, step=...) needs the global batch the "
            f"step will get; got a batch of {rows} examples. Fix: pass that batch (or "
            f"global_batch={rows})."
        )
    candidates = sorted(fits)
    verdicts = {}

    def ok(chunk: int) -> bool:
        verdicts[chunk] = _verdict(step, inputs, chunk, fits[chunk])
        return verdicts[chunk] is None

    if ok(candidates[-1]):
        return candidates[-1]
    low, high = 0, len(candidates) - 1  # candidates[high] does not fit
    best = None
    while low < high:
        mid = (low + high) // 2
        if ok(candidates[mid]):
            best, low = candidates[mid], mid + 1
        else:
            high = mid
    if best is None:
        smallest = candidates[0]
        raise ValueError(
            f"no chunk size fits the devices' memory: the smallest, chunk_size={smallest}, "
            f"{verdicts[smallest]}. Fix: chunk_axes=... (FSDP groups: the params sharded over "
            "a group that computes each chunk together), more devices for the batch, or a "
            "smaller model or example."
        )
    return best


def _verdict(step, inputs: tuple, chunk: int, held: int) -> str | None:
    """``None`` if ``step``'s chunk program at ``chunk`` fits with the margin, else why not.

    The program is compiled as the step's first call compiles it (and cached for the
    steps of this loss function), after the call's inputs are placed, so the free
    memory is what the memory check will see.
    """
    params, batch, key = inputs  # params: with the frozen inputs, if any
    options = step.options
    bitwise = dataclasses.replace(options.bitwise, chunk_size=chunk)
    probe = type(step)(step.loss_fn, dataclasses.replace(options, bitwise=bitwise))
    engine = probe._engine
    grouped, _ = probe._group(batch, None)
    state, placed = engine.prepare(params, grouped, key)
    with jax.set_mesh(None):
        inputs = state._inputs(placed, engine.place_batch(grouped), None, key)
        try:
            state._compile(inputs)
        except memory.OutOfMemoryError as error:
            return str(error).split("; it was not run")[0].removeprefix("RESOURCE_EXHAUSTED: ")
        analyses = [x.memory_analysis() for x in state.executables.values()]
        needed = max(memory.needed_bytes(x) or 0 for x in state.executables.values())
        sums = max(int(a.output_size_in_bytes) for a in analyses)
        devices = [d for g in state.local_groups for d in state.plan.group_devices(g).flat]
        free = [b for d in devices if (b := memory.available_bytes(d)) is not None]
    if not free or not memory.enabled():
        return None
    margin = held * sums + int(HEADROOM * min(free))
    if needed + margin <= min(free):
        return None
    return (
        f"needs {memory.size_text(needed)} per device for its chunk program and "
        f"{memory.size_text(margin)} beside it ({held} partial sums of "
        f"{memory.size_text(sums)} and {HEADROOM:.0%} headroom), and "
        f"{memory.size_text(min(free))} is free"
    )


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise TypeError(
            f"{name} must be a positive int; got {name}={value!r}. Fix: pass e.g. {name}=8."
        )
    return int(value)


def _group_sizes(group_devices: Any) -> tuple[int, ...]:
    if isinstance(group_devices, numbers.Integral) and not isinstance(group_devices, bool):
        return (_positive("group_devices", group_devices),)
    try:
        sizes = tuple(group_devices)
    except TypeError:
        sizes = ()
    if not sizes:
        raise TypeError(
            f"group_devices must be a positive int or a non-empty sequence of them (the "
            f"devices of the chunk axes); got group_devices={group_devices!r}. Fix: pass e.g. "
            "group_devices=4 or group_devices=(2, 4, 8)."
        )
    sizes = tuple(_positive("group_devices", g) for g in sizes)
    if len(sizes) > 1 and 1 in sizes:
        raise ValueError(
            f"group_devices={sizes} lists 1 beside larger groups: without chunk_axes a chunk "
            "is computed whole on one device, not as the row blocks a group's devices share, "
            f"so its bits are not the groups'. Fix: list group sizes of 2 or more, e.g. "
            f"group_devices={tuple(g for g in sizes if g > 1)}."
        )
    return tuple(sorted(set(sizes)))


def _shared_blocks_fix(groups: tuple[int, ...], chunk: int, blocks: int) -> str:
    """What lets every group size divide a chunk's row blocks (a power of two)."""
    if any(g & (g - 1) for g in groups):
        return "group sizes that are powers of two (the row blocks are), or one group size"
    largest = max(groups)
    if block_count(chunk, largest) % largest == 0:  # only the block count held it back
        return f"blocks={largest} (the step's Bitwise(blocks={largest}) too), or fewer group sizes"
    return (
        f"a global batch with {2 * largest} or more rows per group of the most groups "
        f"(a chunk of {2 * largest} rows has {largest} blocks of 2), or fewer group sizes"
    )


def _text(sizes: tuple[int, ...]) -> str:
    return str(sizes[0]) if len(sizes) == 1 else str(sizes)


def _device_counts(batch_devices: Any) -> tuple[int, ...]:
    if isinstance(batch_devices, numbers.Integral) and not isinstance(batch_devices, bool):
        batch_devices = (batch_devices,)
    try:
        counts = tuple(batch_devices)
    except TypeError:
        counts = ()
    if not counts:
        raise TypeError(
            f"batch_devices must be a device count or a non-empty sequence of them; got "
            f"batch_devices={batch_devices!r}. Fix: pass e.g. batch_devices=(1, 8, 64)."
        )
    bad = [d for d in counts if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1]
    if bad:
        raise TypeError(
            f"batch_devices must hold positive ints (device counts); got "
            f"batch_devices={batch_devices!r}, with {bad}. Fix: pass e.g. batch_devices=(1, 8, 64)."
        )
    return tuple(int(d) for d in counts)
