"""Bitwise mode's runner: one plan's programs, dispatched per call.

:class:`Runner` places a call's inputs on each local group's devices (its
rows, the key, the params as flat vectors), runs the group's chunk program
once per chunk of its share, adds the chunk sums in the canonical tree as they
come (:mod:`unsplit._src.bitwise.reduce`), combines the groups' blocks in the
fixed-order reduce-scatter and unpacks the total into grads with the params'
shardings (the four programs: :mod:`unsplit._src.bitwise.programs`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise import accelerators, cache, placement, programs, reduce
from unsplit._src.bitwise.combine import program as combine
from unsplit._src.bitwise.combine import scatter
from unsplit._src.bitwise.plan import Plan


# Long: one plan's programs and the per-call stages that share them (placement, dispatch,
# the canonical sums, the aux); the compile cache and the placement helpers are apart.
class Runner:
    """The programs of one plan, compiled on first use, and the per-call placement of inputs."""

    def __init__(self, owner: Any, plan: Plan):
        self.owner = owner
        self.plan = plan
        mesh = owner.layout.mesh
        self.shared = cache.shared(owner.spec)
        self.pack = self._program(("pack", plan), lambda: programs.pack_program(plan))
        self.combine = self._program(("combine", plan), lambda: combine.program(plan))
        grad_shardings, loss_sharding = placement.output_shardings(plan, mesh, owner.single)
        self.grad_shardings, self.loss_sharding = grad_shardings, loss_sharding
        self.unpack = self._program(
            ("unpack", plan, owner.single),
            lambda: programs.unpack_program(plan, grad_shardings, loss_sharding),
        )
        me = jax.process_index()
        self.local_groups = [
            g
            for g in range(plan.groups)
            if any(d.process_index == me for d in plan.group_devices(g).flat)
        ]
        built = {g: programs.chunk_program(plan, owner.spec, g) for g in self.local_groups}
        self.chunk_fns = {g: run for g, (run, _) in built.items()}
        self.chunk_params = ChunkParams({g: gather for g, (_, gather) in built.items()})
        self.executables: dict[int, Any] = {}
        gentry = partition.entry(plan.group_axes)
        self.slots_sharding = NamedSharding(plan.compute, combine.slots_spec(plan))
        self.fused = None
        if tuple(plan.compute.devices.flat) == tuple(mesh.devices.flat):
            self.fused = self._program(("fused", plan, owner.single), lambda: _fused(self))
        self.placed = placement.GroupInputs(plan, self.local_groups)
        self.held = self.placed.held
        self.launched = accelerators.Launched(plan.compute.devices.flat, plan.group_devices(0).size)
        self.total_sharding = NamedSharding(mesh, P(gentry))

    def combine_slots(self) -> list[jax.ShapeDtypeStruct]:
        """The combine program's inputs: every group's blocks of packed sums, stacked."""
        plan = self.plan
        return [
            jax.ShapeDtypeStruct(
                self._slots_shape(n * plan.devices_per_group),
                dtype,
                sharding=self.slots_sharding,
            )
            for n, dtype in zip(plan.sums_flat.lengths, plan.sums_flat.vectors, strict=True)
        ]

    def _slots_shape(self, length: int) -> tuple[int, ...]:
        """A combine input's shape, for a group's vector of ``length`` (combine.slots_spec)."""
        plan = self.plan
        if plan.slots == 1:
            return (plan.groups * length,)
        return (plan.groups, plan.slots, length)

    def combine_compiled(self) -> Any:
        """The combine program for this plan, compiled (its HLO, bytes sent and memory)."""
        return self.combine.lower(*self.combine_slots()).compile()

    def _program(self, key, build):
        """A jitted data-movement program, shared like the chunk programs."""
        if key not in self.shared:
            self.shared[key] = build()
        return self.shared[key]

    def run(self, params, batch, key, ids):
        # Under the user's jax.set_mesh the one-group programs would be checked against
        # that mesh's devices; they run on their group's own (the loss's shardings were
        # moved there when traced: step/constraints).
        with jax.set_mesh(None):
            return self._run(params, batch, key, ids)

    def _run(self, params, batch, key, ids):
        inputs = self._inputs(params, batch, ids, key)
        if not self.executables:
            self._compile(inputs)
        aux_parts: dict[int, list] = {g: [] for g in self.local_groups}

        def chunk_sums(g):  # asynchronous: the groups run at once (where XLA:CPU allows)
            group_vectors, chunks, group_key = inputs[g]
            # An FSDP group's params, gathered here: held from its first chunk to its last.
            group_vectors = self.launched(self.chunk_params(g, group_vectors))
            for chunk in chunks:
                sums, aux = self.launched(self.executables[g](group_vectors, *chunk, group_key))
                aux_parts[g].append(aux)
                yield sums

        loss, grads, weight = self._finish(
            self._slots({g: chunk_sums(g) for g in self.local_groups})
        )
        aux = None
        if self.owner.spec.has_aux:
            aux = self._aux({g: self._concat(aux_parts[g], g) for g in self.local_groups})
        return loss, grads, aux, weight

    def _concat(self, parts, g: int):
        """A group's chunks' aux in row order (FSDP groups: each device its block of rows)."""
        if not self.plan.chunk_axes:
            return programs.concat_rows(parts)
        sharding = NamedSharding(self.plan.group_mesh(g), P(partition.entry(self.plan.chunk_axes)))
        return self.launched(programs.row_concat(sharding)(parts))

    def _inputs(self, params, batch, ids, key) -> dict:
        """Each local group's (params vectors, chunks of (rows, hi, lo), key) on its devices
        (:class:`~.placement.GroupInputs`); a group of one chunk is not split."""
        plan = self.plan
        inputs = {}
        placed = self.placed(self.pack(params), params, batch, ids, key, self.executables)
        for g, (vectors, group_rows, group_key) in placed.items():
            if plan.per_group == 1:  # the group's rows are its one chunk (placed as a chunk's)
                chunks = [group_rows]
            elif plan.chunk_axes:
                split = programs.chunk_splitter(plan.chunk, self.placed.placer(g).split)
                chunks = self.launched(split(group_rows))
            else:
                chunks = programs.split_chunks(group_rows, plan.chunk)
            inputs[g] = (vectors, chunks, group_key)
        return inputs

    def _total(self, outs: dict) -> Any:
        """The groups' per-chunk packed sums added in the canonical tree, on the user's mesh
        (``outs``: as :meth:`_slots` takes them)."""
        return self._combined(self._slots(outs))

    def _finish(self, slots) -> Any:
        """``(loss, grads, weight)`` from the combine's inputs: the combine and the unpack as
        one program when the user's mesh is the compute mesh's devices in the same order
        (one program launch on every device less per step), else one after the other."""
        if self.fused is None:
            return self.unpack(self._combined(slots))
        return self.fused(*slots)

    def _combined(self, slots) -> Any:
        totals = self.combine(*slots)
        # On the user's mesh: the same buffers when its devices are the compute mesh's (in
        # any axis order), else copied to the devices of the axes no param uses.
        return placement.rename_tree(totals, self.total_sharding)

    def _slots(self, outs: dict) -> list:
        """The combine's inputs: each group's blocks of the canonical tree, stacked.

        ``outs[g]`` yields group ``g``'s chunk sums in order; each is added as soon as its
        sibling in the tree is there, so a group holds O(log chunks) of them, not all.
        """
        plan = self.plan
        blocks = {}
        for g in self.local_groups:
            acc = reduce.Accumulator(add=programs.add_blocks)  # its blocks: at most plan.slots
            for i, chunk_sums in enumerate(outs[g]):
                acc.push(g * plan.per_group + i, chunk_sums)
                del chunk_sums  # the accumulator holds it (or its sum) from here
            blocks[g] = list(acc.blocks.values())  # left to right
        if plan.slots == 1:  # taken as they are (combine.slots_spec)
            stacked = {g: blocks[g][0] for g in self.local_groups}
        else:
            stacked = {g: programs.stack_blocks(blocks[g], plan.slots) for g in self.local_groups}
        slots = [
            jax.make_array_from_single_device_arrays(
                self._slots_shape(stacked[self.local_groups[0]][i].shape[-1]),
                self.slots_sharding,
                [s.data for g in self.local_groups for s in stacked[g][i].addressable_shards],
            )
            for i in range(len(plan.sums_flat.vectors))
        ]
        if jax.process_count() > 1:
            # Multi-process (gloo on CPU): a collective program dispatched while many one-device
            # programs are still queued hung under load (measured: 2 processes, 50 steps, a
            # busy machine). Wait for this process's chunk sums before the combine.
            jax.block_until_ready(slots)
        return slots

    def _compiled(self, fns: dict, args: dict, tag: str) -> dict:
        """The local groups' programs ``fns`` for ``args``, from the cache or compiled."""
        return cache.compile_groups(
            self.shared, self.plan, self.owner.spec, self.local_groups, fns, args, tag
        )

    def _compile(self, inputs) -> None:
        """Compiles the chunk program for the local groups (see :meth:`_compiled`)."""
        args = {
            g: (self.chunk_params.like(g, v), *chunks[0], k) for g, (v, chunks, k) in inputs.items()
        }
        self.executables.update(self._compiled(self.chunk_fns, args, "sums"))

    def _aux(self, outputs):
        """The groups' per-example aux, as global arrays in global-batch order."""
        plan = self.plan
        size = plan.chunks * plan.chunk
        sharding = NamedSharding(plan.compute, P(self.owner.layout.batch_entry))
        per_group = [outputs[g] for g in self.local_groups]

        def assemble(*leaves):
            shards = [s.data for leaf in leaves for s in leaf.addressable_shards]
            shards = [x for x in shards if x.devices() <= set(sharding.device_set)]
            return jax.make_array_from_single_device_arrays(
                (size, *leaves[0].shape[1:]), sharding, shards
            )

        return jax.tree.map(assemble, *per_group)


class ChunkParams:
    """Each local group's chunk programs' params: an FSDP group's gathered whole over its chunk
    axes by its ``gather`` program (:func:`.programs.chunk_program`, compiled on first use),
    once a step for all of its chunks; other groups' (``None``) flat vectors as they are."""

    def __init__(self, gathers: dict[int, Any]):
        self.programs = gathers
        self.compiled: dict[int, Any] = {}  # per FSDP group (bitwise_cost: their bytes sent)

    def gathers(self) -> bool:
        """Whether the groups' chunk programs take gathered params (FSDP groups)."""
        return any(p is not None for p in self.programs.values())

    def __call__(self, g: int, vectors) -> Any:
        """Group ``g``'s chunk programs' params, from its flat vectors."""
        return vectors if self.programs[g] is None else self._gather(g, vectors)(vectors)

    def like(self, g: int, vectors) -> Any:
        """What a call returns, as shapes and shardings (the first call compiles the chunk
        programs without holding the gathered params)."""
        return vectors if self.programs[g] is None else self._gather(g, vectors).out_info

    def _gather(self, g: int, vectors) -> Any:
        if g not in self.compiled:
            program = self.programs[g]
            assert program is not None  # an FSDP group's
            self.compiled[g] = program.lower(vectors).compile()
        return self.compiled[g]


def _fused(runner: Runner):
    """The combine and the unpack as one program: the large leaves' totals divided by the
    weight as the reduce-scatter's pieces, before their all-gather; the grads of params
    sharded over the groups' axes never all-gathered
    (:mod:`~unsplit._src.bitwise.combine.scatter`)."""
    plan = runner.plan
    layouts = scatter.layouts(plan)
    add, unpack = runner.combine, runner.unpack
    if any(kind != scatter.WHOLE for kind in layouts):
        add = combine.program(plan, layouts)
        unpack = programs.unpack_program(plan, runner.grad_shardings, runner.loss_sharding, layouts)
    # The unpack's shardings, as given (inside another jit they only constrain).
    grads = plan.structure.grads_tree(runner.grad_shardings)
    outs = (runner.loss_sharding, grads, runner.loss_sharding)
    return jax.jit(lambda *slots: unpack(list(add(*slots))), out_shardings=outs)
