"""Bitwise mode: loss and grads bit-identical for every schedule of the same global batch.

What was measured (``docs/bitwise.md``) and what this module does:

* XLA's matmuls are not batch-invariant, so the unit of work is a **chunk** of
  ``chunk_size`` examples, always computed by the same program.
* The same computation compiled as a multi-device SPMD program and as a
  one-device program gives other bits (XLA's SPMD pipeline simplifies the
  algebra differently: e.g. a softmax's backward pass). So the chunks of each
  group -- one device, or the model-parallel devices of a tensor-parallel
  layout -- run in their **own** program, the same for every schedule;
  only data movement and exactly-rounded adds happen in SPMD programs.
* Chunk sums are added in one binary tree over the *global* chunk index
  (:mod:`unsplit._src.bitwise.reduce`), so no schedule changes the order of any add.

The four programs are in :mod:`unsplit._src.bitwise.programs`; this module
places the inputs, dispatches the programs and caches them. Host work per
step is a few calls per device group, whatever the number of parameters (they
travel as one flat vector per dtype).

The guarantee holds on the same hardware and software (JAX, jaxlib, XLA
flags), the same ``chunk_size``, and the same model-parallel layout; on CPU,
whatever the process's thread count (chunk programs get canonical dots:
:mod:`unsplit._src.bitwise.canonical_dots`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import sys
import warnings
import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import partition
from unsplit._src.bitwise import accelerators, coupled, placement, programs, reduce, relocate
from unsplit._src.bitwise import plan as bitwise_plan
from unsplit._src.step import memory, sums
from unsplit._src.step.layout import Layout, move_onto, named_spec

default_chunk_size = bitwise_plan.default_chunk_size

# Compiled chunk programs, shared by every step built from the same loss function for
# as long as that function lives: a compiled executable does not keep the function
# alive, so dropping the function (and the steps) frees its programs too; a loop that
# builds steps from one function compiles once.
_EXECUTABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shared(spec: sums.LossSpec) -> dict:
    try:
        return _EXECUTABLES.setdefault(spec.loss_fn, {})
    except TypeError:  # a loss that cannot be weakly referenced: no sharing across steps
        return {}


class BitwiseStep:
    """Runs a :class:`~unsplit._src.front.value_and_grad.Step` in bitwise mode."""

    def __init__(self, spec: sums.LossSpec, layout: Layout, options: Any):
        self.spec = spec
        self.chunk_size = options.chunk_size  # validated by unsplit.Bitwise
        mesh_axes = tuple(layout.mesh.axis_names) if layout.mesh is not None else ()
        self.chunk_axes = bitwise_plan.check_chunk_axes(
            options.chunk_axes, layout.batch_axes, mesh_axes
        )
        if layout.mesh is None:  # one device: a one-device mesh, the same programs
            device = jax.local_devices()[0]
            layout = Layout(Mesh(np.array([device]), ("batch",)), ("batch",))
            self.single = True
        else:
            self.single = False
        self.layout = layout
        accelerators.warn_once_without_gpu_flags(layout.mesh.devices.flat)
        self._plans: dict[Any, Any] = {}
        self._warned: set[str] = set()

    @property
    def chunk_split(self) -> int:
        """How many devices compute each chunk together (the chunk axes'; 1 without)."""
        return math.prod(self.layout.mesh.shape[a] for a in self.chunk_axes)

    def chunk(self, batch: int) -> int:
        """The chunk size: given, else the default for ``batch`` made a multiple of the
        chunk axes' devices (a function of the batch size and the group size only)."""
        if self.chunk_size:
            return self.chunk_size
        chunk = default_chunk_size(batch)
        return math.lcm(chunk, self.chunk_split)

    def __call__(self, params, batch, key, ids, *, memo: dict | None = None) -> sums.Result:
        """Runs the step.

        ``memo``: a caller's own dict, kept while it passes the params this step
        last returned to it (a train step's own): the programs found for them
        are kept there, so their layout is not looked at again for a batch of the
        same shapes. The caller empties it when its params are new.
        """
        signature = _batch_signature(batch, key)
        if memo and memo.get("signature") == signature:
            state = memo["state"]
        else:
            state, params = self.prepare(params, batch, key)
            if memo is not None:
                memo.update(signature=signature, state=state)
        loss, grads, aux, weight = state.run(params, self.place_batch(batch), key, ids)
        return sums.Result(loss, grads, aux, weight, params)

    def place_batch(self, batch):
        """A batch committed outside the step's mesh, moved onto it (warned once), as default
        mode does; a batch already there, or on the host, is returned as it is."""
        layout = self.layout
        return move_onto(batch, layout, lambda x: P(layout.batch_entry), "batch", self._warned)

    def prepare(self, params, batch, key) -> tuple[_Compiled, Any]:
        """The compiled programs for these inputs, and the params placed on the mesh.

        This is the per-call work that looks at every params leaf (their
        shardings and placement); :func:`unsplit.bitwise_train_step` skips it
        when it gets back the params it returned.
        """
        layout = self.layout
        params = move_onto(
            params, layout, lambda x: named_spec(x, layout.mesh), "params", self._warned
        )
        size = np.shape(jax.tree.leaves(batch)[0])[0]  # checked by the step
        chunk = self.chunk(size)
        return self._state(params, batch, key, size, chunk), params

    def _state(self, params, batch, key, size, chunk) -> _Compiled:
        structure, arrays = sums.Params.split(params)
        specs = tuple(getattr(getattr(a, "sharding", None), "spec", None) for a in arrays)
        # Everything the compiled programs were built for: a call that differs in any of
        # these (params of other dtypes or shapes, a raw key after a typed one) compiles anew.
        params_types = tuple((np.shape(a), _dtype(a)) for a in arrays)
        shapes = tuple((np.shape(x), _dtype(x)) for x in jax.tree.leaves(batch))
        key_type = (np.shape(key), _dtype(key))
        signature = (
            structure, specs, params_types, shapes, jax.tree.structure(batch), key_type, size,
            chunk,
        )  # fmt: skip
        try:
            state = self._plans.get(signature)
        except TypeError:
            raise TypeError(
                "params has a leaf that is neither an array nor hashable. Fix: make it an array, "
                "or mark it static in your module (eqx.field(static=True))."
            ) from None
        if state is None:
            self._check_schedule(size, chunk)
            plan, _ = bitwise_plan.make_plan(
                self.spec, self.layout, params, batch, key, size, chunk, self.chunk_axes
            )
            self._warn_gathered(plan)
            state = (_CoupledCompiled if self.spec.coupled else _Compiled)(self, plan)
            self._plans[signature] = state
        return state

    def _check_schedule(self, size: int, chunk: int) -> None:
        split = self.chunk_split
        groups = self.layout.shards // split
        share = size // groups  # the step has checked that the batch axes divide the batch
        # The chunk sizes that would work here: multiples of the group's devices that divide
        # a group's share.
        fits = [c for c in range(split, share + 1, split) if share % c == 0]
        choices = _choices(fits)
        if chunk % split:
            raise ValueError(
                f"bitwise mode with chunk_axes={self.chunk_axes} splits each chunk's rows over "
                f"the {split} devices of those axes: expected chunk_size a multiple of {split}, "
                f"got chunk_size={chunk}. Fix: pass chunk_size={choices} here (a multiple of "
                f"{split} that divides each group's {share} examples; the same one for every "
                "schedule you compare)."
            )
        if share % chunk and split > 1:
            raise ValueError(
                f"bitwise mode needs each device group's share of the batch to be a whole "
                f"number of chunks: batch {size} over {groups} group(s) of {split} device(s) "
                f"(chunk_axes={self.chunk_axes}) is {share} examples each, not a multiple of "
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

    def _warn_gathered(self, plan: bitwise_plan.Plan) -> None:
        """Once: params sharded over batch axes gathered whole on each device, and large."""
        if "gathered" in self._warned:
            return
        outer = [a for a in self.layout.batch_axes if a not in self.chunk_axes]
        if not any(partition.spec_axes(s) & set(outer) for s in plan.specs):
            return
        size = sum(
            n * np.dtype(d).itemsize
            for n, d in zip(plan.params_flat.lengths, plan.params_flat.vectors, strict=True)
        )
        if size <= GATHERED_WARN_BYTES:
            return
        self._warned.add("gathered")
        warnings.warn(
            f"bitwise mode gathers the params sharded over the batch axes {tuple(outer)} whole "
            f"on every device: {size / 2**30:.1f} GiB per device (plus as much again for the "
            "partial sums). Fix: chunk_axes= names batch axes whose devices compute each chunk "
            "together with the params kept sharded over them (FSDP groups), e.g. "
            f"value_and_grad(..., bitwise=True, batch_axes=('data', 'fsdp'), "
            "chunk_axes='fsdp'); see docs/bitwise.md.",
            stacklevel=4,
        )


def _choices(sizes: list[int]) -> str:
    """``[4, 8, 16]`` as ``"4, 8 or 16"`` (the largest few: larger chunks run faster)."""
    shown = [str(c) for c in sizes[-4:]]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def _batch_signature(batch: Any, key: Any) -> tuple:
    """What of the batch and key the compiled programs were built for (cheap: no params)."""
    leaves = jax.tree.leaves(batch)
    return (
        jax.tree.structure(batch),
        tuple((np.shape(x), _dtype(x)) for x in leaves),
        (np.shape(key), _dtype(key)),
    )


def _dtype(x: Any) -> Any:
    """``x``'s dtype, key dtypes included (``np.dtype`` refuses those)."""
    dtype = getattr(x, "dtype", None)
    return dtype if dtype is not None else np.asarray(x).dtype


# Bitwise mode warns once when params gathered over the batch axes exceed this, per device.
GATHERED_WARN_BYTES = 2**30


class _Compiled:
    """The programs of one plan, compiled on first use, and the per-call placement of inputs."""

    def __init__(self, owner: BitwiseStep, plan: bitwise_plan.Plan):
        self.owner = owner
        self.plan = plan
        mesh = owner.layout.mesh
        self.shared = _shared(owner.spec)
        self.pack = self._program(("pack", plan), lambda: programs.pack_program(plan))
        self.combine = self._program(("combine", plan), lambda: programs.combine_program(plan))
        if owner.single:
            device = mesh.devices.flat[0]
            grad_shardings = [jax.sharding.SingleDeviceSharding(device)] * sum(plan.structure.diff)
            loss_sharding = jax.sharding.SingleDeviceSharding(device)
        else:
            specs = [s for s, d in zip(plan.given, plan.structure.diff, strict=True) if d]
            grad_shardings = [NamedSharding(mesh, s) for s in specs]
            loss_sharding = NamedSharding(mesh, P())
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
        self.chunk_fns = {g: programs.chunk_program(plan, owner.spec, g) for g in self.local_groups}
        self.executables: dict[int, Any] = {}
        gentry = partition.entry(plan.group_axes)
        self.slots_sharding = NamedSharding(plan.compute, P(plan.outer_entry, None, gentry))
        self.total_sharding = NamedSharding(mesh, P(gentry))

    def combine_slots(self) -> list[jax.ShapeDtypeStruct]:
        """The combine program's inputs: every group's blocks of packed sums, stacked."""
        plan = self.plan
        return [
            jax.ShapeDtypeStruct(
                (plan.groups, plan.slots, n * plan.group_size), dtype, sharding=self.slots_sharding
            )
            for n, dtype in zip(plan.sums_flat.lengths, plan.sums_flat.vectors, strict=True)
        ]

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

        def chunk_sums(g):  # every call is asynchronous: the groups run at once
            group_vectors, chunks, group_key = inputs[g]
            for chunk in chunks:
                sums, aux = self.executables[g](group_vectors, *chunk, group_key)
                aux_parts[g].append(aux)
                yield sums

        totals = self._total({g: chunk_sums(g) for g in self.local_groups})
        loss, grads, weight = self.unpack(totals)
        aux = None
        if self.owner.spec.has_aux:
            aux = self._aux({g: self._concat(aux_parts[g], g) for g in self.local_groups})
        return loss, grads, aux, weight

    def _concat(self, parts, g: int):
        """A group's chunks' aux in row order (FSDP groups: each device its block of rows)."""
        if not self.plan.chunk_axes:
            return programs.concat_rows(parts)
        entry = partition.entry(self.plan.chunk_axes)
        return programs.row_concat(NamedSharding(self.plan.group_mesh(g), P(entry)))(parts)

    def _inputs(self, params, batch, ids, key) -> dict:
        """Each local group's (params vectors, chunks of (rows, hi, lo), key) on its devices."""
        plan = self.plan
        vectors = self.pack(params)
        by_device = [{s.device: s.data for s in v.addressable_shards} for v in vectors]
        rows = plan.per_group * plan.chunk
        hi, lo = keys_lib.step_words(ids, plan.chunks * plan.chunk, on_host=True)
        inputs = {}
        for g in self.local_groups:
            gmesh = plan.group_mesh(g)
            devices = list(plan.group_devices(g).flat)
            place = _Placer(gmesh, devices, g * rows, rows, plan.chunk_axes)
            group_vectors = [place.flat(v, by_device[i]) for i, v in enumerate(vectors)]
            group_rows = (jax.tree.map(place.rows, batch), place.rows(hi), place.rows(lo))
            if plan.chunk_axes:
                chunks = programs.chunk_splitter(plan.chunk, place.split)(group_rows)
            else:
                chunks = programs.split_chunks(group_rows, plan.chunk)
            inputs[g] = (group_vectors, chunks, place.whole(key))
        return inputs

    def _total(self, outs: dict) -> Any:
        """The groups' per-chunk packed sums added in the canonical tree, on the user's mesh.

        ``outs[g]`` yields group ``g``'s chunk sums in order; each is added as soon as its
        sibling in the tree is there, so a group holds O(log chunks) of them, not all.
        """
        plan = self.plan
        blocks = {}
        for g in self.local_groups:
            acc = reduce.Accumulator(add=programs.add_blocks)
            for i, chunk_sums in enumerate(outs[g]):
                acc.push(g * plan.per_group + i, chunk_sums)
                del chunk_sums  # the accumulator holds it (or its sum) from here
            blocks[g] = list(acc.blocks.values())  # left to right
        stacked = {g: programs.stack_blocks(blocks[g], plan.slots) for g in self.local_groups}
        slots = [
            jax.make_array_from_single_device_arrays(
                (plan.groups, *stacked[self.local_groups[0]][i].shape[1:]),
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
        totals = self.combine(*slots)
        # On the user's mesh: the same buffers when its devices are the compute mesh's (in
        # any axis order), else copied to the devices of the axes no param uses.
        return placement.rename_tree(totals, self.total_sharding)

    def _compile(self, inputs) -> None:
        """Compiles the chunk program for the local groups (see :meth:`_compiled`)."""
        args = {g: (v, *chunks[0], k) for g, (v, chunks, k) in inputs.items()}
        self.executables.update(self._compiled(self.chunk_fns, args, "sums"))

    def _compiled(self, fns: dict, args: dict, tag: str) -> dict:
        """Each local group's program ``fns[g]`` for ``args[g]``, compiled once per distinct one.

        Traces here (the caller's JAX settings apply). Groups of the same size all
        run the same program: it is compiled for the first such group's devices and
        loaded onto the others' (:mod:`.relocate`), the same machine code.
        """
        keys = {g: (tag, self._key(g, args[g])) for g in self.local_groups}
        todo = [g for g in self.local_groups if keys[g] not in self.shared]
        by_size: dict[Any, list[int]] = {}  # groups of the same size run the same program
        for g in todo:
            devices = self.plan.group_devices(g)
            # A group spread over processes is compiled for its own devices, by every process
            # it spans (the same call in each; an executable cannot be loaded onto devices
            # another process drives).
            spread = placement.spans_processes(devices)
            by_size.setdefault(("spread", g) if spread else devices.size, []).append(g)
        first = [groups[0] for groups in by_size.values()]
        lowered = {
            g: programs.lower_chunk(fns[g], args[g], self.plan.group_devices(g).flat) for g in first
        }
        if lowered:
            with _compiling(len(todo)), concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
                compiled = pool.map(
                    lambda low: low[0].compile(compiler_options=low[1]), lowered.values()
                )
                done = dict(zip(lowered, compiled, strict=True))
                for g, compiled in done.items():
                    programs.check_chunk(compiled, lowered[g][1])
                    memory.check(compiled, memory.bitwise_fix(self.plan.chunk))
                    self.shared[keys[g]] = compiled
                for head, *rest in by_size.values():
                    for g in rest:
                        self.shared[keys[g]] = self._relocated(
                            fns[g], done[head], g, lowered[head][1], args[g]
                        )
        return {g: self.shared[keys[g]] for g in self.local_groups}

    def _relocated(self, fn, compiled, g: int, options, args) -> Any:
        """Group ``g``'s program: ``compiled`` loaded onto its devices, else compiled for them."""
        devices = self.plan.group_devices(g)
        try:
            if devices.size == 1:
                return relocate.Relocated(compiled, devices.flat[0], options)
            return relocate.Relocated(compiled, options=options, mesh=self.plan.group_mesh(g))
        except Exception:  # a runtime that cannot load it there: compile it for the devices
            low = programs.lower_chunk(fn, args, list(devices.flat))
            return low[0].compile(compiler_options=low[1])

    def _key(self, g: int, args) -> Any:
        """What group ``g``'s chunk program depends on: the params' and sums' flat layouts,
        its devices and the inputs' shapes -- not the schedule, so a step on 4 devices reuses
        the programs a step on 8 devices compiled for the same devices."""
        leaves, treedef = jax.tree.flatten(args)
        avals = tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)
        devices = self.plan.group_devices(g)
        plan, spec = self.plan, self.owner.spec
        return (
            programs.CANONICAL_DOTS,
            spec.weighted,
            spec.has_aux,
            plan.structure,
            plan.params_flat,
            plan.sums_flat,
            plan.local_specs,
            plan.group_axes,
            plan.chunk_axes,
            devices.shape,
            tuple(d.id for d in devices.flat),
            treedef,
            avals,
        )

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


class _CoupledCompiled(_Compiled):
    """A coupled loss's passes (:mod:`unsplit._src.bitwise.coupled`), in the same placement.

    Pass 1 runs a features chunk program per chunk on its group's devices; the
    features are gathered whole onto one group per process (its first) in
    global order; pass 2 runs the batch loss there, one program over the
    global batch; pass 3 runs a pullback chunk program per chunk with its rows
    of the features' cotangents, and the chunks' grads are added in the
    canonical tree.
    """

    def __init__(self, owner: BitwiseStep, plan: bitwise_plan.Plan):
        super().__init__(owner, plan)
        spec = owner.spec
        self.features_fns = {g: coupled.features_program(plan, spec, g) for g in self.local_groups}
        self.pullback_fns = {g: coupled.pullback_program(plan, spec, g) for g in self.local_groups}
        # Pass 2 runs on one group per process (its first): every process gets the global
        # features (an all-gather, exact) and runs the same program.
        self.head = self.local_groups[0]
        # Groups spread over processes: pass 3's cotangents travel through each process's
        # own copy (the processes of a spread head group all take it as their head).
        self.spread = any(
            placement.spans_processes(plan.group_devices(g)) for g in self.local_groups
        )
        self.loss_fn = coupled.loss_program(plan, spec, self.head)
        self.whole = NamedSharding(plan.compute, P())
        self.finish = self._program(
            ("finish", plan, owner.single),
            lambda: coupled.finish_program(plan, self.grad_shardings),
        )
        self.stages: dict[str, Any] = {}

    def _run(self, params, batch, key, ids):
        plan = self.plan
        inputs = self._inputs(params, batch, ids, key)
        args = {g: (v, *chunks[0], k) for g, (v, chunks, k) in inputs.items()}
        if "features" not in self.stages:
            self.stages["features"] = self._compiled(self.features_fns, args, "features")
        per_group = {}
        for g in self.local_groups:  # pass 1: each group's chunks, in global order
            group_vectors, chunks, group_key = inputs[g]
            run_chunk = self.stages["features"][g]
            per_group[g] = self._concat(
                [run_chunk(group_vectors, *chunk, group_key) for chunk in chunks], g
            )
        features = self._on_head(self._aux(per_group))  # every group's, on the head group
        vectors = inputs[self.head][0]
        loss, aux, direct, g_features = self._loss_program(vectors, features)(vectors, features)
        if self.spread:  # whole on each head device: every process then has its own copy
            g_features = placement.gathered(g_features, self.plan.group_mesh(self.head))
        cotangents = programs.split_chunks(g_features, plan.chunk)  # pass 3's inputs

        def cotangent(g, i):
            return self._onto_group(cotangents[g * plan.per_group + i], g)

        if "pullback" not in self.stages:
            pargs = {g: (*args[g], cotangent(g, 0)) for g in self.local_groups}
            self.stages["pullback"] = self._compiled(self.pullback_fns, pargs, "pullback")

        def chunk_sums(g):
            group_vectors, chunks, group_key = inputs[g]
            run_chunk = self.stages["pullback"][g]
            for i, chunk in enumerate(chunks):
                yield run_chunk(group_vectors, *chunk, group_key, cotangent(g, i))

        totals = self._total({g: chunk_sums(g) for g in self.local_groups})
        direct = [self._spread(d, t.sharding) for d, t in zip(direct, totals, strict=True)]
        grads = self.finish(totals, direct)

        def everywhere(x):  # replicated on the head group: one device's copy, everywhere
            return _everywhere(x.addressable_data(0), self.loss_sharding)

        loss, aux = everywhere(loss), jax.tree.map(everywhere, aux)
        return loss, grads, aux, jax.device_put(np.float32(1), self.loss_sharding)

    def _on_head(self, tree):
        """A global tree gathered whole (exact), on every device of this process's head group."""
        whole = jax.jit(lambda t: t, out_shardings=self.whole)(tree)
        devices = list(self.plan.group_devices(self.head).flat)

        def local(x):
            by_device = {s.device: s.data for s in x.addressable_shards}
            if len(devices) == 1:
                return by_device[devices[0]]
            sharding = NamedSharding(self.plan.group_mesh(self.head), P())
            return jax.make_array_from_single_device_arrays(
                x.shape, sharding, [by_device[d] for d in devices if d in by_device]
            )

        return jax.tree.map(local, whole)

    def _onto_group(self, tree, g: int):
        """Rows on the head group -> on group ``g``'s devices, placed as its chunk rows."""
        plan = self.plan
        devices = plan.group_devices(g)
        if devices.size == 1:
            (device,) = devices.flat
            return jax.tree.map(lambda x: jax.device_put(x, device).addressable_data(0), tree)
        spec = P(partition.entry(plan.chunk_axes)) if plan.chunk_axes else P()
        sharding = NamedSharding(plan.group_mesh(g), spec)
        if self.spread:  # device_put cannot move arrays between device sets across processes
            return placement.from_local_copy(tree, sharding)
        return jax.device_put(tree, sharding)

    def _spread(self, x, sharding):
        """The head group's packed ``x`` (sharded over the group axes) on ``sharding``'s
        devices: each device gets the block of the head group's device at its position."""
        plan = self.plan
        head = plan.group_devices(self.head)
        if head.size == 1:
            return _everywhere(x.addressable_data(0), sharding)
        blocks = {s.device: s.data for s in x.addressable_shards}
        position = {}
        for g in self.local_groups:
            for where, device in np.ndenumerate(plan.group_devices(g)):
                position[device] = head[where]
        shards = [
            jax.device_put(blocks[position[d]], d)
            for d in sharding.addressable_devices_indices_map(np.shape(x))
        ]
        return jax.make_array_from_single_device_arrays(np.shape(x), sharding, shards)

    def _loss_program(self, vectors, features) -> Any:
        """Pass 2's program on the head group: compiled once per inputs' shapes, shared."""
        plan, spec = self.plan, self.owner.spec
        devices = plan.group_devices(self.head)
        leaves, treedef = jax.tree.flatten((vectors, features))
        avals = tuple((np.shape(x), str(x.dtype)) for x in leaves)
        key = (
            "loss",
            programs.CANONICAL_DOTS,
            spec.batch_loss,
            spec.has_aux,
            plan.structure,
            plan.params_flat,
            plan.sums_flat,
            plan.local_specs,
            plan.group_axes,
            plan.chunk_axes,
            treedef,
            avals,
            devices.shape,
            tuple(d.id for d in devices.flat),
        )
        if key not in self.shared:
            low, options = programs.lower_chunk(self.loss_fn, (vectors, features), devices.flat)
            compiled = low.compile(compiler_options=options)
            programs.check_chunk(compiled, options)
            self.shared[key] = compiled
        return self.shared[key]


def _everywhere(x, sharding):
    """``x`` (one device, the same value in every process) as a replicated global array."""
    if not isinstance(sharding, NamedSharding):
        return jax.device_put(x, sharding)
    copies = [jax.device_put(x, d) for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(np.shape(x), sharding, copies)


class _Placer:
    """Puts a group's inputs on its devices: its rows of the batch, the whole key, its params."""

    def __init__(self, gmesh: Mesh, devices: list, start: int, rows: int, chunk_axes=()):
        self.gmesh, self.start, self.rows_n = gmesh, start, rows
        # A group may span processes (an FSDP group of 64 over 8 hosts): each process puts
        # only its own devices' pieces; ``size`` counts every device of the group.
        self.size = len(devices)
        self.devices = placement.addressable(devices)
        self.replicated = NamedSharding(gmesh, P())
        self.chunk_axes = tuple(chunk_axes)
        # FSDP groups: the group's rows split over the chunk axes in order (as the batch
        # comes), and each chunk split the same way (``split``).
        self.split = NamedSharding(gmesh, P(partition.entry(self.chunk_axes)))
        pieces = math.prod(gmesh.shape[a] for a in self.chunk_axes) if self.chunk_axes else 1
        self.piece = rows // pieces
        if self.chunk_axes:
            index = self.split.devices_indices_map((rows,))
            self.starts = {d: start + (index[d][0].start or 0) for d in devices}
        else:
            self.starts = {d: start for d in devices}

    def flat(self, vector, by_device):
        shards = [by_device[d] for d in self.devices]
        if self.size == 1:
            return self.one_device(shards[0])
        axes = tuple(self.gmesh.axis_names)
        sharding = NamedSharding(self.gmesh, P(axes if len(axes) > 1 else axes[0]))
        length = shards[0].shape[0] * self.size
        return jax.make_array_from_single_device_arrays((length,), sharding, shards)

    def rows(self, x):
        stop = self.start + self.rows_n
        if isinstance(x, jax.Array):
            found = {}
            for s in x.addressable_shards:
                lo = s.index[0].start or 0
                here = s.device in self.starts and lo == self.starts[s.device]
                if here and s.data.shape[0] == self.piece:
                    found[s.device] = s.data
            if all(d in found for d in self.devices):
                pieces = [found[d] for d in self.devices]
                if self.size == 1:
                    return self.one_device(pieces[0])
                sharding = self.split if self.chunk_axes else self.replicated
                return jax.make_array_from_single_device_arrays(
                    (self.rows_n, *pieces[0].shape[1:]), sharding, pieces
                )
            if not x.is_fully_addressable:
                raise ValueError(
                    "a batch leaf is a global jax.Array whose rows for a local device group live "
                    "in another process. Fix: build the batch with unsplit.global_batch("
                    "local_rows, mesh) on the step's mesh."
                )
        host = np.asarray(x[self.start : stop])
        if self.size == 1:
            return jax.device_put(host, self.devices[0])
        return jax.device_put(host, self.split if self.chunk_axes else self.replicated)

    def one_device(self, x):
        """``x`` as a plain one-device array: a one-device mesh's shard can still be typed by
        that mesh (Explicit axes), and the one-device chunk program takes no mesh types.
        ``device_put`` onto the device keeps that type; the array's one buffer does not."""
        if x.devices() != {self.devices[0]}:
            x = jax.device_put(x, self.devices[0])
        return x.addressable_data(0)

    def whole(self, x):
        if self.size == 1:
            return self.one_device(jax.device_put(x, self.devices[0]))
        return placement.replicate(x, self.replicated)


@contextlib.contextmanager
def _compiling(groups: int):
    """A spinner on an interactive terminal while the first call compiles (it can take a while)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    message = f"unsplit: compiling the bitwise step's chunk program ({groups} device group(s))"
    with Console(stderr=True).status(message):
        yield
