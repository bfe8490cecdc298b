"""The four programs of a bitwise step: pack, chunks (per group), combine, unpack.

1. ``pack`` (the user's mesh, one SPMD program): every device's local blocks
   of the params as flat vectors; params sharded over the batch axes (FSDP) are
   gathered first (an all-gather is exact data movement).
2. ``chunks`` (one program per group: one device, or the group's model-parallel
   devices): a loop over the group's chunks, each computed by the same code,
   whose partial sums are added like a binary counter over the *global* chunk
   index (the canonical tree of :mod:`unsplit._src.reduce`). The trip count is
   a run-time value, so the loop body is compiled the same for every schedule.
3. ``combine`` (the compute mesh): the groups' blocks added in the same tree:
   recursive doubling with ``ppermute`` when every group holds one aligned
   subtree, else an all-gather and the tree. Never a ``psum``.
4. ``unpack`` (the user's mesh): the total back into grads with the params'
   shardings, divided once by the global weight.

Elementwise adds and divisions are exactly rounded, so steps 1, 3 and 4 give
the same bits wherever they run; only step 2 computes, and it is the same
program for every schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import reduce, sums
from unsplit._src.bitwise_plan import Plan


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def pack_program(plan: Plan):
    """Params (any sharding on the user's mesh) -> each device's flat local blocks."""
    mesh = plan.layout.mesh
    batch_axes = plan.layout.batch_axes

    def local(*blocks):
        leaves = []
        for x, spec in zip(blocks, plan.specs, strict=True):
            for dim, entry in enumerate(spec):
                names = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
                gather = tuple(n for n in names if n in batch_axes)
                if gather:
                    x = jax.lax.all_gather(x, _entry(gather), axis=dim, tiled=True)
            leaves.append(x)
        return tuple(plan.params_flat.pack(leaves))

    every = P(tuple(mesh.axis_names))
    count = len(plan.params_flat.vectors)
    run = jax.shard_map(
        local, mesh=mesh, in_specs=plan.specs, out_specs=(every,) * count, check_vma=False
    )
    mask = plan.structure.array_mask

    def pack(params):  # the whole pytree: jit flattens it (no Python work per leaf)
        leaves = jax.tree.leaves(params)
        return run(*(x for x, is_array in zip(leaves, mask, strict=True) if is_array))

    return jax.jit(pack)


def chunks_program(plan: Plan, spec: sums.LossSpec, group: int):
    """One group's program: its chunks' partial sums, as aligned blocks (and the aux)."""
    gmesh = plan.group_mesh(group) if plan.group_axes else None
    gentry = _entry(plan.group_axes)
    structure, c, slots = plan.structure, plan.chunk, plan.slots
    n_params = len(plan.params_flat.vectors)
    n_sums = len(plan.sums_flat.vectors)
    diff_specs = [s for s, d in zip(plan.local_specs, structure.diff, strict=True) if d]

    def unpack(vectors):
        if gmesh is None:
            return plan.params_flat.unpack(vectors)
        return list(
            jax.shard_map(
                lambda *v: tuple(plan.params_flat.unpack(v)),
                mesh=gmesh,
                in_specs=(P(gentry),) * n_params,
                out_specs=plan.local_specs,
                check_vma=False,
            )(*vectors)
        )

    def pack_sums(grads, loss_sum, weight):
        if gmesh is None:
            return plan.sums_flat.pack([*grads, loss_sum, weight])
        grads = [
            jax.lax.with_sharding_constraint(g, NamedSharding(gmesh, s))
            for g, s in zip(grads, diff_specs, strict=True)
        ]
        return list(
            jax.shard_map(
                lambda *xs: tuple(plan.sums_flat.pack(xs)),
                mesh=gmesh,
                in_specs=(*diff_specs, P(), P()),
                out_specs=(P(gentry),) * n_sums,
                check_vma=False,
            )(*grads, loss_sum, weight)
        )

    def zeros(length, dtype):
        x = jnp.zeros((slots, length), dtype)
        if gmesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(gmesh, P(None, gentry)))

    def run(vectors, batch, hi, lo, key, start, count):
        arrays = unpack(vectors)
        rows = count_rows(batch)
        if rows == c:
            # One chunk per group: the chunk would be the whole (loop-invariant) input, and
            # XLA would compile its computation differently from a sliced chunk (measured:
            # other bits). A padded copy keeps it a slice at a run-time offset.
            batch, hi, lo = jax.tree.map(
                lambda x: jnp.concatenate([x, jnp.zeros_like(x)]), (batch, hi, lo)
            )

        def chunk_sums(i):
            chunk = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * c, c), batch)
            ids = keys_lib.Ids64(
                hi=jax.lax.dynamic_slice_in_dim(hi, i * c, c),
                lo=jax.lax.dynamic_slice_in_dim(lo, i * c, c),
            )
            (loss_sum, weight, grads), aux = sums.example_sums(
                spec, structure, arrays, chunk, key, ids
            )
            return pack_sums(grads, loss_sum, weight), aux

        (first, aux_shape) = jax.eval_shape(chunk_sums, 0)
        state = (
            [zeros(v.shape[0], v.dtype) for v in first],
            jnp.zeros((slots,), jnp.int32),  # each slot's block: first chunk
            jnp.zeros((slots,), jnp.int32),  # and size
            jnp.int32(0),  # slots in use
            jax.tree.map(lambda a: jnp.zeros((rows, *a.shape[1:]), a.dtype), aux_shape),
        )

        def body(i, state):
            stack, lows, sizes, depth, aux_all = state
            value, aux = chunk_sums(i)

            def can_merge(carry):
                _, _, size, d = carry
                top = jnp.maximum(d - 1, 0)
                return (d > 0) & (sizes[top] == size) & (lows[top] % (2 * size) == 0)

            def merge(carry):  # the top block is this block's left sibling: left + right
                value, _, size, d = carry
                left = [s[d - 1] for s in stack]
                return (
                    [a + b for a, b in zip(left, value, strict=True)],
                    lows[d - 1],
                    2 * size,
                    d - 1,
                )

            value, low, size, depth = jax.lax.while_loop(
                can_merge, merge, (value, start + i, jnp.int32(1), depth)
            )
            stack = [s.at[depth].set(v) for s, v in zip(stack, value, strict=True)]
            lows, sizes = lows.at[depth].set(low), sizes.at[depth].set(size)
            aux_all = jax.tree.map(
                lambda acc, a: jax.lax.dynamic_update_slice_in_dim(acc, a, i * c, 0), aux_all, aux
            )
            return stack, lows, sizes, depth + 1, aux_all

        stack, _, _, _, aux_all = jax.lax.fori_loop(0, count, body, state)
        return [s[None] for s in stack], aux_all

    return run


def count_rows(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


def combine_program(plan: Plan):
    """The groups' blocks -> the total, added in the canonical tree (on the compute mesh)."""
    mesh = plan.compute
    batch = _entry(plan.layout.batch_axes)
    gentry = _entry(plan.group_axes)
    n = len(plan.sums_flat.vectors)
    groups = plan.groups
    layout = [plan.blocks(g) for g in range(groups)]

    def add(a, b):
        return [x + y for x, y in zip(a, b, strict=True)]

    def local(*slots):  # each (1, slots, length): this group's blocks
        if plan.doubling:
            # Round r adds partners g and g ^ 2**r; IEEE addition is commutative, so both
            # get left + right, bit for bit, holding one extra block at a time.
            x = [s[0, 0] for s in slots]
            for r in range(groups.bit_length() - 1):
                perm = [(g, g ^ (1 << r)) for g in range(groups)]
                x = add(x, [jax.lax.ppermute(v, batch, perm) for v in x])
            return tuple(x)
        everyone = [jax.lax.all_gather(s, batch, tiled=True) for s in slots]
        named = {
            block: [e[g, j] for e in everyone]
            for g, blocks in enumerate(layout)
            for j, block in enumerate(blocks)
        }
        return tuple(reduce.combine(named, plan.chunks, add))

    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(batch, None, gentry),) * n,
            out_specs=(P(gentry),) * n,
            check_vma=False,
        )
    )


def unpack_program(plan: Plan, grad_shardings, loss_sharding):
    """The total -> ``(loss, grads)``: grads with the params' shardings, divided by the weight."""
    mesh = plan.layout.mesh
    gentry = _entry(plan.group_axes)
    structure = plan.structure
    diff_specs = tuple(s for s, d in zip(plan.local_specs, structure.diff, strict=True) if d)
    n = len(plan.sums_flat.vectors)
    dtypes = [
        d for d, is_diff in zip(plan.params_flat.dtypes, structure.diff, strict=True) if is_diff
    ]

    def local(*vectors):
        *grads, loss_sum, weight = plan.sums_flat.unpack(vectors)
        return loss_sum, weight, tuple(grads)

    split = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(gentry),) * n,
        out_specs=(P(), P(), diff_specs),
        check_vma=False,
    )

    def unpack(vectors):  # the grads pytree (None for non-float leaves), built by jit
        loss_sum, weight, grads = split(*vectors)
        loss, grads = sums.normalize(loss_sum, weight, list(grads), dtypes)
        return loss, structure.grads_tree(grads), weight

    shardings = (loss_sharding, structure.grads_tree(grad_shardings), loss_sharding)
    return jax.jit(unpack, out_shardings=shardings)
