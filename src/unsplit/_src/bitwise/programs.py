"""The programs of a bitwise step: pack, chunk (per group), unpack (combine: its module).

1. ``pack`` (the user's mesh, one SPMD program): every device's local blocks
   of the params as flat vectors; params sharded over the batch axes (FSDP) are
   gathered first (an all-gather is exact data movement).
2. ``chunk`` (compiled once per group: one device, or the group's
   model-parallel devices): one chunk's partial sums, from inputs of one
   chunk's shape, so the same program for every schedule. The host runs it
   for each of the group's chunks and adds their sums like a binary counter
   over the *global* chunk index (the canonical tree of
   :mod:`unsplit._src.bitwise.reduce`), with an elementwise add program.
   On CPU its dots are put in a canonical layout on the YNNPACK path, so its bits
   do not depend on the thread count (:mod:`unsplit._src.bitwise.canonical_dots`).
3. ``combine`` (the compute mesh): the groups' blocks added in the same tree,
   by reduce-scatters of two devices or a fixed-order ``all_to_all``, then an
   all-gather (:mod:`unsplit._src.bitwise.combine.program`). Never a ``psum``.
4. ``unpack`` (the user's mesh): the total back into grads with the params'
   shardings, divided once by the global weight.

Elementwise adds and divisions are exactly rounded, so steps 1, 3 and 4 give
the same bits wherever they run; only step 2 computes, and it is the same
program for every schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import partition
from unsplit._src.bitwise import canonical_dots, placement
from unsplit._src.bitwise import plan as bitwise_plan
from unsplit._src.bitwise.blocked import chunk as blocked_chunk
from unsplit._src.bitwise.combine import pairwise, scatter
from unsplit._src.bitwise.combine import program as combine_program
from unsplit._src.bitwise.fsdp import group_reduce
from unsplit._src.bitwise.plan import Plan
from unsplit._src.step import sums


def pack_program(plan: Plan):
    """Params (any sharding on the user's mesh) -> each device's flat local blocks."""
    mesh = plan.layout.required_mesh()
    # Gathered over the outer batch axes; kept sharded over the chunk axes (FSDP groups).
    batch_axes = tuple(a for a in plan.layout.batch_axes if a not in plan.chunk_axes)

    def gather_axes(spec, ndim):  # per dimension, the batch axes it is gathered over
        entries = [*spec, *[None] * (ndim - len(spec))]
        return tuple(tuple(n for n in partition.names(e) if n in batch_axes) for e in entries)

    specs = plan.packed_specs  # direct (frozen) leaves are not packed

    def local(*blocks):
        gathers = [gather_axes(s, x.ndim) for x, s in zip(blocks, specs, strict=True)]
        leaves = placement.gathered_blocks(list(blocks), gathers, dict(mesh.shape))
        return tuple(plan.params_flat.pack(leaves))

    every = P(tuple(mesh.axis_names))
    count = len(plan.params_flat.vectors)
    run = jax.shard_map(
        local, mesh=mesh, in_specs=specs, out_specs=(every,) * count, check_vma=False
    )
    return OnArrayLeaves(run, plan.packed_mask)


class OnArrayLeaves:
    """A jitted function of a pytree's array leaves, called with the whole pytree.

    The other leaves (an Equinox module's activation function, a string field) are
    no jit arguments: the plan holds them as static.
    """

    def __init__(self, fn: Callable, mask: tuple[bool, ...]):
        self.jitted = jax.jit(fn)
        self.mask = mask

    def arrays(self, tree: Any) -> list[Any]:
        leaves = jax.tree.leaves(tree)
        return [x for x, is_array in zip(leaves, self.mask, strict=True) if is_array]

    def __call__(self, tree: Any) -> Any:
        return self.jitted(*self.arrays(tree))

    def lower(self, tree: Any) -> Any:
        return self.jitted.lower(*self.arrays(tree))


class GroupIO:
    """How a program on group ``group``'s devices reads the flat params and writes sums.

    One-device groups: plain unpacking and packing. Groups of several devices
    (model axes, chunk axes): per device, inside ``shard_map``, so each device
    unpacks and packs only its local blocks (exact data movement). FSDP groups
    (chunk axes) compute manual over the chunk axes, their sums added in a fixed
    order (:attr:`reducer`, :mod:`unsplit._src.bitwise.fsdp.group_reduce`).
    """

    def __init__(self, plan: Plan, group: int):
        self.plan = plan
        self.gmesh = plan.group_mesh(group) if plan.group_axes else None
        self.gentry = partition.entry(plan.group_axes)
        self.centry = partition.entry(plan.chunk_axes)
        self.diff_specs = [
            s for s, d in zip(plan.local_specs, plan.structure.diff, strict=True) if d
        ]
        self.reducer = None
        if plan.chunk_axes and group_reduce.fixed_order():
            assert self.gmesh is not None  # the chunk axes are group axes
            self.reducer = group_reduce.GroupReduce(plan, self.gmesh)

    def retargeted(self, spec: sums.LossSpec) -> sums.LossSpec:
        """``spec`` whose loss's shardings are on the group's mesh, as its programs trace it.

        Inside the manual region of an FSDP group the chunk axes are gone from the
        specs (each device computes its own rows) and the context's mesh is the one
        the constraints go to.
        """
        layout = self.plan.layout
        if self.reducer is None:
            return bitwise_plan.retargeted(spec, layout, self.plan.group_axes, self.gmesh)
        others = tuple(a for a in self.plan.group_axes if a not in self.plan.chunk_axes)
        return bitwise_plan.retargeted(spec, layout, others)

    def sums(self, fn, vectors, rows, key, whole=False):
        """``fn(params, rows, key) -> (grads, loss_sum, weight, aux)`` of one chunk as packed
        sums (each device its blocks) and its aux: model-parallel groups by the canonical-block
        rewrite, FSDP groups per device on its rows (their sums added in a fixed order).

        ``vectors``: the params as flat vectors, or (``whole``, FSDP groups) their array
        leaves whole over the chunk axes, from :meth:`whole_params`."""
        if self.plan.model_axes and not self.plan.chunk_axes and blocked_chunk.ENABLED:
            assert self.gmesh is not None  # model axes are group axes
            return blocked_chunk.chunk_sums(
                self.plan, self.gmesh, fn, vectors, rows, key, self.plan.canonical_blocks
            )
        arrays = vectors if whole else self.unpack(vectors)
        if self.reducer is not None:
            return self.reducer.chunk_sums(fn, arrays, rows, key, whole=whole)
        grads, loss_sum, weight, aux = fn(arrays, self.rows(rows), key)
        return self.pack_sums(grads, loss_sum, weight), self.aux(aux)

    def whole_params(self, vectors) -> list:
        """An FSDP group's params (flat vectors, each device its blocks) as array leaves whole
        over the chunk axes (exact all-gathers): what its chunk programs compute with."""
        assert self.reducer is not None  # FSDP groups only
        return self.reducer.gather_params(self.unpack(vectors))

    def unpack(self, vectors) -> list:
        """The params' array leaves (each device its local blocks) from the flat vectors and
        the direct (frozen) leaves after them, placed as the group computes with them."""
        flat = self.plan.params_flat
        if self.gmesh is None:
            return flat.unpack(vectors)
        n = len(flat.vectors)
        specs = tuple(flat.packed(self.plan.local_specs))
        unpack = jax.shard_map(lambda *v: tuple(flat.unpacked(v)), mesh=self.gmesh,
                               in_specs=(P(self.gentry),) * n, out_specs=specs, check_vma=False)  # fmt: skip
        return flat.merged(unpack(*vectors[:n]), vectors[n:])

    def pack_sums(self, grads, loss_sum, weight) -> list:
        """``(grads..., loss_sum, weight)`` as the sums' flat vectors (each device its blocks)."""
        plan = self.plan
        if self.gmesh is None:
            return plan.pack_sums([*grads, loss_sum, weight])
        grads = [
            jax.lax.with_sharding_constraint(g, NamedSharding(self.gmesh, s))
            for g, s in zip(grads, self.diff_specs, strict=True)
        ]
        return list(
            jax.shard_map(
                lambda *xs: tuple(plan.pack_sums(xs)),
                mesh=self.gmesh,
                in_specs=(*self.diff_specs, P(), P()),
                out_specs=(P(self.gentry),) * len(plan.sums_flat.vectors),
                check_vma=False,
            )(*grads, loss_sum, weight)
        )

    def rows(self, tree):
        """FSDP groups: each device computes its piece of the chunk's rows."""
        if not self.plan.chunk_axes:
            return tree
        assert self.gmesh is not None  # the chunk axes are group axes
        split = NamedSharding(self.gmesh, P(self.centry))
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, split), tree)

    def aux(self, tree):
        """Per-example aux with its rows as the chunk's (split over the chunk axes) and
        whole over the group's other axes (an activation sharded over a sequence axis)."""
        if self.gmesh is None:
            return tree
        rows = NamedSharding(self.gmesh, P(self.centry))
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows), tree)

    def replicated(self, tree):
        """``tree`` whole on every device of the group (one-device groups: as it is)."""
        if self.gmesh is None:
            return tree
        whole = NamedSharding(self.gmesh, P())
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, whole), tree)


def chunk_program(plan: Plan, spec: sums.LossSpec, group: int):
    """One chunk's packed partial sums (and its aux), on group ``group``'s devices: the same
    program for every schedule (a loop over a group's chunks in one program got other bits
    when the group's share changed); model-parallel groups': :mod:`.blocked.chunk`.

    Returns ``(run, gather)``: ``run(vectors, chunk, hi, lo, key)`` is the chunk's sums;
    ``gather`` (jitted) takes an FSDP group's flat vectors to its params whole over its chunk
    axes, which ``run`` then takes for ``vectors``: one all-gather of the params per step for
    all of the group's chunks, not one per chunk (exact data movement). ``None`` for other
    groups: ``run`` takes the flat vectors.
    """
    io = GroupIO(plan, group)
    # The loss's shardings name the user's mesh: moved onto the group's (step/constraints).
    spec = io.retargeted(spec)

    def compute(arrays, rows, key):
        chunk, hi, lo = rows
        ids = keys_lib.Ids64(hi=hi, lo=lo)
        (loss_sum, weight, grads), aux = sums.example_sums(
            spec, plan.structure, arrays, chunk, key, ids
        )
        return grads, loss_sum, weight, aux

    whole = io.reducer is not None

    def run(vectors, chunk, hi, lo, key):
        return io.sums(compute, vectors, (chunk, hi, lo), key, whole=whole)

    return run, (jax.jit(io.whole_params) if whole else None)


# Chunk programs on CPU get canonical dots (their bits then do not depend on the process's
# thread count: canonical_dots). A switch for measuring what that costs, not a setting.
CANONICAL_DOTS = True


def lower_chunk(fn, args, devices):
    """Group ``devices``' chunk program ``fn`` lowered for ``args``, and its compiler options.

    On CPU the program's dots are rewritten to their canonical layout and sent to the
    YNNPACK library path (:mod:`unsplit._src.bitwise.canonical_dots`); elsewhere it
    is compiled as it is.
    """
    if CANONICAL_DOTS and canonical_dots.is_cpu(devices):
        return jax.jit(canonical_dots.canonicalize(fn), keep_unused=True).lower(
            *args
        ), canonical_dots.cpu_options()
    return jax.jit(fn, keep_unused=True).lower(*args), None


def check_chunk(compiled, options) -> None:
    """Refuses a CPU chunk program whose bits would depend on the thread count."""
    if options is not None:
        canonical_dots.check_cpu_program(compiled)


@functools.partial(jax.jit, static_argnums=1)
def split_chunks(rows, chunk: int):
    """A group's rows (any pytree) -> the list of its chunks (exact data movement)."""
    n = jax.tree.leaves(rows)[0].shape[0] // chunk
    return [jax.tree.map(lambda x, i=i: x[i * chunk : (i + 1) * chunk], rows) for i in range(n)]


@functools.cache
def chunk_splitter(chunk: int, sharding):
    """:func:`split_chunks` whose chunks come out with ``sharding`` (an FSDP group's rows).

    Chunk ``i`` is the group's rows ``[i * chunk, (i + 1) * chunk)`` split over
    the group's chunk axes in order, however the rows came in (exact data movement).
    """

    def split(rows):
        n = jax.tree.leaves(rows)[0].shape[0] // chunk
        return [jax.tree.map(lambda x, i=i: x[i * chunk : (i + 1) * chunk], rows) for i in range(n)]

    return jax.jit(split, out_shardings=sharding)


@functools.cache
def row_concat(sharding):
    """:func:`concat_rows` with the result placed by ``sharding`` (an FSDP group's rows)."""
    return jax.jit(
        lambda parts: jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts), out_shardings=sharding
    )


@jax.jit
def add_blocks(left, right):
    """Two blocks' packed sums, left + right (elementwise: exactly rounded anywhere; a zero's
    sign as it comes: :func:`~unsplit._src.bitwise.combine.pairwise.add`)."""
    return [pairwise.add(a, b) for a, b in zip(left, right, strict=True)]


@functools.partial(jax.jit, static_argnums=1)
def stack_blocks(blocks, slots: int):
    """A group's blocks (a list of packed sums) -> one (1, slots, length) array per vector."""
    stacked = []
    for vectors in zip(*blocks, strict=True):
        pad = [jnp.zeros_like(vectors[0])] * (slots - len(vectors))
        stacked.append(jnp.stack([*vectors, *pad])[None])
    return stacked


@jax.jit
def concat_rows(parts):
    """The chunks' aux, in row order."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def unpack_program(plan: Plan, grad_shardings, loss_sharding, layouts: tuple[str, ...] = ()):
    """The total -> ``(loss, grads)``: grads with the params' shardings, divided by the weight.

    ``layouts`` (:func:`~unsplit._src.bitwise.combine.scatter.layouts`; default all
    ``WHOLE``): a ``SHARD`` vector comes as each group's piece, its leaf's shard, divided
    where it lies; a ``PIECE`` one as the combine's piece, divided, then all-gathered
    (:func:`~unsplit._src.bitwise.combine.program.gather`): the division's work is
    ``1 / groups`` of the leaf on each device. Elementwise, so the same bits.
    """
    mesh = plan.layout.mesh
    gentry = partition.entry(plan.group_axes)
    structure = plan.structure
    layouts = layouts or (scatter.WHOLE,) * len(plan.sums_flat.vectors)
    flat = scatter.pieces_plan(plan, layouts)
    diff_specs = tuple(s for s, d in zip(plan.local_specs, structure.diff, strict=True) if d)
    kinds = [layouts[v] for v, _ in flat.slots[: len(diff_specs)]]
    shapes = plan.sums_flat.shapes
    out_specs = tuple(
        scatter.shard_spec(plan, s) if kind == scatter.SHARD else s
        for s, kind in zip(diff_specs, kinds, strict=True)
    )
    whole = P(gentry)
    in_specs = tuple(whole if k == scatter.WHOLE else scatter.piece_spec(plan) for k in layouts)
    dtypes = [
        d for d, is_diff in zip(plan.params_flat.dtypes, structure.diff, strict=True) if is_diff
    ]
    gather = combine_program.gather(plan) if scatter.PIECE in layouts else None

    def local(*vectors):
        *grads, loss_sum, weight = flat.unpack(vectors)
        for i, kind in enumerate(kinds):  # the pieces: divided where they lie
            if kind != scatter.WHOLE:
                grads[i] = scatter.divided(grads[i], weight, dtypes[i])
            if kind == scatter.PIECE:
                assert gather is not None
                grads[i] = gather(grads[i]).reshape(shapes[i])
        return loss_sum, weight, tuple(grads)

    split = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(P(), P(), out_specs),
        check_vma=False,
    )
    rest = [i for i, kind in enumerate(kinds) if kind == scatter.WHOLE]

    def unpack(vectors):  # the grads pytree (None for non-float leaves), built by jit
        loss_sum, weight, grads = split(*vectors)
        grads = list(grads)
        # The totals' zeros written +0 (fused into the division): the paths' totals differ in
        # their zeros' signs alone (pairwise's docstring).
        loss, divided = sums.normalize(
            pairwise.positive_zero(loss_sum),
            weight,
            pairwise.positive_zeros([grads[i] for i in rest]),
            [dtypes[i] for i in rest],
        )
        for i, g in zip(rest, divided, strict=True):
            grads[i] = g
        return loss, structure.grads_tree(grads), weight

    shardings = (loss_sharding, structure.grads_tree(grad_shardings), loss_sharding)
    return jax.jit(unpack, out_shardings=shardings)
