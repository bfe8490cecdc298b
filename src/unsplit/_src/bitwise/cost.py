"""What a bitwise step holds and sends per device, read from its compiled programs.

``step.lower(...).compile().memory_analysis()`` answers this for default mode's one
program. A bitwise step runs several programs (pack, one chunk program per chunk and
group, combine, unpack), so its per-device memory is the peak they hold together:

* held through the step: the params and frozen inputs the caller holds, the flat
  params the pack program makes (one copy per device: every chunk program reads it;
  frozen inputs the devices already hold are no part of it, the chunk programs read
  the caller's buffers) and the partial sums the canonical tree holds: each chunk's
  sums are added as soon as their sibling is there, so a group of ``c`` chunks holds
  at most ``floor(log2 c) + 1`` of them;
* on top, the largest of: a chunk program's other arguments (one chunk of rows, the
  key, the ids; an FSDP group's: the params gathered whole over its chunk axes too,
  once per step for all its chunks) and its temp; the combine program (its inputs,
  outputs and temp); the unpack program (likewise).

Bytes sent are counted from the programs' HLO as ring algorithms send them
(:func:`unsplit.testing.bytes_sent`): the pack, a group's chunk programs (and an FSDP
group's one gather of its params) and the combine.

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
from typing import Any, NamedTuple

import jax
import numpy as np

from unsplit._src import frozen as frozen_lib
from unsplit._src import links
from unsplit._src.bitwise import reduce, traffic
from unsplit._src.bitwise.blocked import paired
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
        params_bytes: the params and frozen inputs the caller holds (one device's shards).
        flat_params_bytes: the flat params vectors the pack program makes, and the frozen
            inputs sharded over the batch axes gathered whole (frozen inputs the devices
            already hold are not copied: the chunk programs read the caller's buffers).
        partial_sums_bytes: the partial sums the canonical tree holds at most at once.
        program_peak_bytes: the largest of a chunk program's rows, key, ids and temp,
            the combine program's and the unpack program's memory (or, where the step
            runs them as one program, that program's).
        bytes_sent_per_device: what the pack, a group's chunk programs (an FSDP group's
            gather of its params) and the combine send per device per step (ring accounting).
        combine_vs_ring: the combine's bytes over a ring all-reduce's of the same sums
            (``2 (G - 1) / G`` of them; 1.0 with one group, which sends nothing); below 1
            where the grads of params sharded over the batch axes stay in their shards
            (a reduce-scatter, no all-gather).
        chunk_programs: chunk programs each group runs per step.
        chunk_collectives: collectives in a chunk program (model-parallel layouts).
        chunk_bytes_sent: what one chunk program sends per device (groups of several
            devices: the params' all-gather and the in-group reduce of the sums).
        frozen_bytes: the part of ``params_bytes`` that is frozen inputs (``frozen=``).
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
    frozen_bytes: int = 0


def bitwise_cost(
    step: Any, params: Any, batch: Any, key: jax.Array, ids: Any = None, *, frozen: Any = None
) -> BitwiseCost:
    """The per-device memory and bytes sent of ``step`` (``bitwise=True``) on these inputs.

    Takes the step's arguments as the step does, ``frozen=`` included (the same
    checks: a loss that needs ``frozen`` called without it is refused with the
    step's ``TypeError``). Compiles the step's programs for inputs of this shape
    if they are not compiled yet; runs none of the loss. Per-example losses only:
    a ``batch_loss`` step runs other programs (its passes).
    """
    state, placed = _compiled(step, params, batch, key, ids, frozen, "bitwise_cost")
    with jax.set_mesh(None):  # its programs are compiled on their own meshes, as the step runs
        return _cost(state, placed)


def _compiled(step: Any, params, batch, key, ids, frozen, what: str) -> tuple[Any, Any]:
    """The step's runner for these inputs, its programs compiled, and the placed params."""
    engine = getattr(step, "_engine", None)
    if not isinstance(engine, BitwiseStep):
        raise TypeError(
            f"{what} reads a bitwise step's programs; got {step!r}. Fix: pass a step "
            "made with unsplit.value_and_grad(..., bitwise=True); for default mode, "
            "step.lower(params, batch, key).compile().memory_analysis() describes its program."
        )
    if engine.spec.coupled:
        raise NotImplementedError(
            f"{what} covers per-example losses; a batch_loss step runs its passes' own "
            "programs (features, batch loss, pullback), which it does not account for yet. "
            "Fix: measure the process's peak memory instead (as the Benchmarks guide does, "
            f"{links.doc_page('benchmarks', 'losses-that-couple-examples-batch_loss')})."
        )
    grouped, grouped_ids = step._group(batch, ids)
    # The step's own checks: frozen= given exactly when the loss takes it (the arity error).
    words = step._inputs.check(params, grouped, key, grouped_ids, frozen, audit=False)
    state, placed = engine.prepare(frozen_lib.combine(params, frozen), grouped, key)
    if isinstance(state, paired.Paired):  # a degree-1 model layout computed at degree 2
        placed, grouped = state.moved(placed, grouped)
        engine = state.inner
        state, placed = engine.prepare(placed, grouped, key)
    if not state.executables:  # compiled for these inputs (placed as a call places them)
        with jax.set_mesh(None):
            state._compile(state._inputs(placed, engine.place_batch(grouped), words, key))
    return state, placed


class BitwiseLowered:
    """A bitwise step's programs for some inputs: what ``step.lower(...)`` returns in bitwise
    mode, as ``jax.stages.Lowered`` does for one program. :meth:`compile` compiles them
    (runs none of the loss) and reads them (:class:`BitwiseCompiled`)."""

    def __init__(self, step: Any, args: tuple, frozen: Any):
        self._step, self._args, self._frozen = step, args, frozen

    def compile(self) -> BitwiseCompiled:
        params, batch, key, ids = self._args
        state, placed = _compiled(self._step, params, batch, key, ids, self._frozen, "step.lower")
        with jax.set_mesh(None):
            return BitwiseCompiled(_cost(state, placed), state)

    def as_text(self) -> str:
        """The chunk program's HLO (the one program that computes; the others move data)."""
        return self.compile().as_text()


class BitwiseMemory(NamedTuple):
    """:meth:`BitwiseCompiled.memory_analysis`: the step's peak per device (their sum is
    :attr:`BitwiseCost.memory_per_device`), in the fields of XLA's memory analysis."""

    argument_size_in_bytes: int  # the params and frozen inputs the caller holds
    output_size_in_bytes: int  # the grads and loss one device gets
    temp_size_in_bytes: int  # the rest: flat params, partial sums, a program's own peak


class BitwiseCompiled:
    """A bitwise step's compiled programs, read as ``jax.stages.Compiled`` is for one.

    Attributes:
        cost: the step's :class:`BitwiseCost` (memory per device, bytes sent).
    """

    def __init__(self, cost: BitwiseCost, state: Any):
        self.cost = cost
        self._state = state

    def memory_analysis(self) -> BitwiseMemory:
        """Per device, each buffer once; the three fields add up to ``cost.memory_per_device``."""
        with jax.set_mesh(None):
            out = _unpack_compiled(self._state).memory_analysis().output_size_in_bytes
        temp = self.cost.memory_per_device - self.cost.params_bytes - out
        return BitwiseMemory(self.cost.params_bytes, out, temp)

    def cost_analysis(self) -> dict[str, float]:
        """XLA's cost analysis of the programs one device runs per step, added up: its
        chunk programs (one per chunk of its group), the combine and the unpack."""
        state = self._state
        chunk = next(iter(state.executables.values()))
        parts = [(chunk, state.plan.per_group), (state.combine_compiled(), 1)]
        total: dict[str, float] = {}
        for compiled, times in parts:
            analysis = compiled.cost_analysis()
            for name, value in (analysis[0] if isinstance(analysis, list) else analysis).items():
                total[name] = total.get(name, 0.0) + times * float(value)
        return total

    def as_text(self) -> str:
        """The chunk program's compiled HLO (the one program that computes)."""
        return next(iter(self._state.executables.values())).as_text()


def _cost(state: Any, params: Any) -> BitwiseCost:
    plan = state.plan
    packed = sum(_device_bytes(v) for v in state.pack(params))
    # Frozen leaves are chunk program arguments of their own: the caller's buffers, or the
    # copies gathered over the batch axes (those count as flat params).
    held_frozen = state.held(params)[state.local_groups[0]]
    direct = sum(_device_bytes(x) for x in held_frozen)
    gathered = zip(held_frozen, state.held.gather, strict=True)
    flat = packed + sum(_device_bytes(x) for x, g in gathered if g)
    chunks = list(state.executables.values())
    chunk = max(chunks, key=_memory).memory_analysis()
    sums = chunk.output_size_in_bytes
    # An FSDP group's chunk programs take the params gathered whole over its chunk axes (one
    # buffer, made once per step, held through the group's chunks), not the flat params.
    gathers = state.chunk_params.gathers()
    own = 0 if gathers else packed + direct
    chunk_rest = chunk.argument_size_in_bytes - own + chunk.temp_size_in_bytes
    if state.fused is not None:  # the step runs the combine and the unpack as one program
        combine = state.fused.lower(*state.combine_slots()).compile()
        finish = _memory(combine)
    else:
        combine = state.combine_compiled()
        finish = max(_memory(combine), _memory(_unpack_compiled(state)))
    held = sum(_device_bytes(x) for x in jax.tree.leaves(params))
    peak = max(chunk_rest, finish)
    chunk_text = max((c.as_text() for c in chunks), key=traffic.bytes_sent)
    combine_bytes = traffic.bytes_sent(combine)
    sent = traffic.bytes_sent(state.pack.lower(params).compile())
    chunk_sent = traffic.bytes_sent(chunk_text)
    sent += plan.per_group * chunk_sent + combine_bytes
    if gathers:  # an FSDP group's params gathered once per step
        sent += max(traffic.bytes_sent(g) for g in state.chunk_params.compiled.values())
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
        frozen_bytes=sum(_device_bytes(x) for x in jax.tree.leaves(frozen_lib.frozen_of(params))),
    )


def _unpack_compiled(state: Any) -> Any:
    """The unpack program, compiled for the combine's outputs."""
    totals = [
        jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=state.total_sharding)
        for t in jax.eval_shape(state.combine, *state.combine_slots())
    ]
    return state.unpack.lower(totals).compile()


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
