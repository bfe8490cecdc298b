"""What a bitwise step holds and sends per device, read from its compiled programs.

``step.lower(...).compile().memory_analysis()`` answers this for default mode's one
program. A bitwise step runs several programs (pack, one chunk program per chunk and
group, combine, unpack), so its per-device memory is the peak they hold together:

* held through the step: the params the caller holds, the flat params the pack
  program makes (one copy per device: every chunk program reads it) and the partial
  sums the canonical tree holds: each chunk's sums are added as soon as their sibling
  is there, so a group of ``c`` chunks holds at most ``floor(log2 c) + 1`` of them;
* on top, the largest of: a chunk program's other arguments (one chunk of rows, the
  key, the ids) and its temp; the combine program (its inputs, outputs and temp); the
  unpack program (likewise).

Bytes sent are counted from the programs' HLO as ring algorithms send them
(:func:`unsplit.testing.bytes_sent`): the pack, a group's chunk programs and the combine.

Example:
    >>> import jax, jax.numpy as jnp, unsplit, unsplit.testing
    >>> loss = lambda p, x, key: jnp.sum((p["w"] * x) ** 2)
    >>> step = unsplit.value_and_grad(loss, bitwise=True)
    >>> params, batch = {"w": jnp.ones(16)}, jnp.ones((32, 16))
    >>> cost = unsplit.testing.bitwise_cost(step, params, batch, jax.random.key(0))
    >>> cost.chunk_programs, cost.flat_params_bytes, cost.bytes_sent_per_device
    (4, 64, 0.0)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np

from unsplit._src import links
from unsplit._src.bitwise import reduce, traffic
from unsplit._src.bitwise.step import BitwiseStep

_COLLECTIVE = re.compile(
    r"= \S+ (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\("
)


@dataclasses.dataclass(frozen=True)
class BitwiseCost:
    """Per-device memory and traffic of one bitwise step (see :mod:`.cost`).

    Attributes:
        memory_per_device: the peak bytes a step holds on one device, each buffer once:
            ``params_bytes + flat_params_bytes + partial_sums_bytes + program_peak_bytes``.
        params_bytes: the params the caller holds (one device's shards).
        flat_params_bytes: the flat params vectors the pack program makes.
        partial_sums_bytes: the partial sums the canonical tree holds at most at once.
        program_peak_bytes: the largest of a chunk program's rows, key, ids and temp,
            the combine program's and the unpack program's memory.
        bytes_sent_per_device: what the pack, a group's chunk programs and the combine
            send per device per step (ring accounting).
        combine_vs_ring: the combine's bytes over a ring all-reduce's of the same sums
            (``2 (G - 1) / G`` of them; 1.0 with one group, which sends nothing).
        chunk_programs: chunk programs each group runs per step.
        chunk_collectives: collectives in a chunk program (model-parallel layouts).
        chunk_bytes_sent: what one chunk program sends per device (groups of several
            devices: the params' all-gather and the in-group reduce of the sums).
    """

    memory_per_device: int
    params_bytes: int
    flat_params_bytes: int
    partial_sums_bytes: int
    program_peak_bytes: int
    bytes_sent_per_device: float
    combine_vs_ring: float
    chunk_programs: int
    chunk_collectives: int
    chunk_bytes_sent: float = 0.0


def bitwise_cost(
    step: Any, params: Any, batch: Any, key: jax.Array, ids: Any = None
) -> BitwiseCost:
    """The per-device memory and bytes sent of ``step`` (``bitwise=True``) on these inputs.

    Runs the step once if its programs for inputs of this shape are not compiled yet.
    Per-example losses only: a ``batch_loss`` step runs other programs (its passes).
    """
    engine = getattr(step, "_engine", None)
    if not isinstance(engine, BitwiseStep):
        raise TypeError(
            f"bitwise_cost reads a bitwise step's programs; got {step!r}. Fix: pass a step "
            "made with unsplit.value_and_grad(..., bitwise=True); for default mode, "
            "step.lower(params, batch, key).compile().memory_analysis() describes its program."
        )
    if engine.spec.coupled:
        raise NotImplementedError(
            "bitwise_cost covers per-example losses; a batch_loss step runs its passes' own "
            "programs (features, batch loss, pullback), which it does not account for yet. "
            "Fix: measure the process's peak memory instead (as the Benchmarks guide does, "
            f"{links.doc_page('benchmarks', 'losses-that-couple-examples-batch_loss')})."
        )
    grouped, _ = step._group(batch, ids)
    state, placed = engine.prepare(params, grouped, key)
    if not state.executables:
        step(params, batch, key, ids)
    with jax.set_mesh(None):  # its programs are compiled on their own meshes, as the step runs
        return _cost(state, placed)


def _cost(state: Any, params: Any) -> BitwiseCost:
    plan = state.plan
    flat = sum(_device_bytes(v) for v in state.pack(params))
    chunks = list(state.executables.values())
    chunk = max(chunks, key=_memory).memory_analysis()
    sums = chunk.output_size_in_bytes
    chunk_rest = chunk.argument_size_in_bytes - flat + chunk.temp_size_in_bytes
    combine = state.combine_compiled()
    totals = [
        jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=state.total_sharding)
        for t in jax.eval_shape(state.combine, *state.combine_slots())
    ]
    unpack = state.unpack.lower(totals).compile()
    held = sum(_device_bytes(x) for x in jax.tree.leaves(params))
    peak = max(chunk_rest, _memory(combine), _memory(unpack))
    chunk_text = max((c.as_text() for c in chunks), key=traffic.bytes_sent)
    combine_bytes = traffic.bytes_sent(combine)
    sent = traffic.bytes_sent(state.pack.lower(params).compile())
    chunk_sent = traffic.bytes_sent(chunk_text)
    sent += plan.per_group * chunk_sent + combine_bytes
    sums_total = sum(
        n * np.dtype(d).itemsize
        for n, d in zip(plan.sums_flat.lengths, plan.sums_flat.vectors, strict=True)
    )
    ring = 2 * (plan.groups - 1) / plan.groups * sums_total
    partial = sums * max(_held_sums(g * plan.per_group, plan.per_group) for g in state.local_groups)
    return BitwiseCost(
        memory_per_device=held + flat + partial + peak,
        params_bytes=held,
        flat_params_bytes=flat,
        partial_sums_bytes=partial,
        program_peak_bytes=peak,
        bytes_sent_per_device=sent,
        combine_vs_ring=combine_bytes / ring if ring else 1.0,
        chunk_programs=plan.per_group,
        chunk_collectives=max(len(_COLLECTIVE.findall(c.as_text())) for c in chunks),
        chunk_bytes_sent=chunk_sent,
    )


def _held_sums(first: int, count: int) -> int:
    """The most chunk sums alive at once while a group's chunks ``[first, first + count)``
    are added in the canonical tree (the accumulator's blocks and the newest chunk's)."""
    acc = reduce.Accumulator(add=lambda a, b: None)
    most = 0
    for i in range(first, first + count):
        most = max(most, acc.depth + 1)
        acc.push(i, None)
    return most


def _memory(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def _device_bytes(x: Any) -> int:
    """Bytes of one device's piece of ``x`` (a sharded array's first addressable shard)."""
    shards = getattr(x, "addressable_shards", None)
    return shards[0].data.nbytes if shards else np.asarray(x).nbytes
