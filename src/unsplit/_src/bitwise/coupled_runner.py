"""Bitwise mode's runner for losses that couple examples (``batch_loss=``): three passes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise import cache, coupled, placement, programs
from unsplit._src.bitwise.plan import Plan
from unsplit._src.bitwise.runner import ChunkParams, Runner


class CoupledRunner(Runner):
    """A coupled loss's passes (:mod:`unsplit._src.bitwise.coupled`), in the same placement.

    Pass 1 runs a features chunk program per chunk on its group's devices; the
    features are gathered whole onto one group per process (its first) in
    global order; pass 2 runs the batch loss there, one program over the
    global batch; pass 3 runs a pullback chunk program per chunk with its rows
    of the features' cotangents, and the chunks' grads are added in the
    canonical tree.
    """

    def __init__(self, owner: Any, plan: Plan):
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
        # Its passes' programs take the flat vectors (an FSDP group's gather inside each).
        self.chunk_params = ChunkParams(dict.fromkeys(self.local_groups))

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
                [self.launched(run_chunk(group_vectors, *chunk, group_key)) for chunk in chunks],
                g,
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
                yield self.launched(run_chunk(group_vectors, *chunk, group_key, cotangent(g, i)))

        totals = self._total({g: chunk_sums(g) for g in self.local_groups})
        direct = [self._spread(d, t.sharding) for d, t in zip(direct, totals, strict=True)]
        grads = self.finish(totals, direct)

        def everywhere(x):  # replicated on the head group: one device's copy, everywhere
            return placement.everywhere(x.addressable_data(0), self.loss_sharding)

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
            return placement.everywhere(x.addressable_data(0), sharding)
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
        key = cache.program_key("loss", plan, spec, devices, (vectors, features), spec.batch_loss)
        if key not in self.shared:
            low, options = programs.lower_chunk(self.loss_fn, (vectors, features), devices.flat)
            compiled = low.compile(compiler_options=options)
            programs.check_chunk(compiled, options)
            self.shared[key] = compiled
        return self.shared[key]
