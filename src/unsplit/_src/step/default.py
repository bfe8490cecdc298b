"""Default mode: one jitted SPMD program, the way a plain jitted step with the same shardings runs.

The program (:mod:`unsplit._src.step.program`) vmaps the one-example loss over
each microbatch (keys by global id), runs the microbatches in a ``lax.scan``, and
divides the global sums once by the global weight. The batch is sharded over the
layout's batch axes; params keep whatever sharding they have (replicated, FSDP over
the batch axes, tensor parallel over model axes) and XLA inserts the collectives,
exactly as for ``jax.jit(jax.value_and_grad(batched_loss))``. The grads are
constrained to the params' shardings, the aux to the batch's.

Because every example's key is a function of its global id, the result does
not depend on how the batch is partitioned or cut into microbatches (up to
float rounding: XLA picks the order of the sums).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src.processes import agreement, fingerprint
from unsplit._src.step import constraints, memory, sums, validate
from unsplit._src.step.layout import Layout, move_onto, named_spec
from unsplit._src.step.program import Program


class DefaultStep:
    """Runs a step in default mode; one compiled program per params layout and input shapes."""

    def __init__(self, spec: sums.LossSpec, layout: Layout, microbatches: int, settings=None):
        # The loss's shardings (constraints, out_sharding) name the user's mesh; inside the
        # program the batch axes are Auto and the vmap's: moved there (step/constraints).
        loss_fn = constraints.retargeted(spec.loss_fn, layout.mesh, keep=layout.model_axes)
        self.spec = dataclasses.replace(spec, loss_fn=loss_fn)
        self.layout = layout
        self.microbatches = microbatches
        self.settings = settings or {}
        self.program = Program(self.spec, layout, microbatches)
        self._programs: dict[Any, Any] = {}
        self._warned: set[str] = set()

    def __call__(
        self, params, batch, key, ids, *, memo: dict | None = None, step=None
    ) -> sums.Result:
        """Runs the step (``memo`` is bitwise mode's: one jit looks at the params anyway;
        ``step``: the step number, folded into the key inside the program)."""
        structure, program, args = self._prepare(params, batch, key, ids, step)
        loss, grads, aux, weight = program(*args)
        return sums.Result(loss, structure.grads_tree(grads), aux, weight, params)

    def lower(self, params, batch, key, ids, *, step=None) -> jax.stages.Lowered:
        """The program this call would run, lowered (``.compile().memory_analysis()``...)."""
        _, program, args = self._prepare(params, batch, key, ids, step)
        return program.lower(*args)

    def _prepare(self, params, batch, key, ids, step=None):
        """The inputs on the step's mesh, and the compiled program for their layout."""
        layout = self.layout
        mesh = layout.mesh
        if mesh is not None:
            params = move_onto(
                params, layout, lambda x: named_spec(x, mesh), "params", self._warned
            )
            batch = move_onto(batch, layout, lambda x: P(layout.batch_entry), "batch", self._warned)
            key = move_onto(key, layout, lambda x: P(), "key", self._warned)
            step = move_onto(step, layout, lambda x: P(), "step", self._warned)
            ids = move_onto(ids, layout, lambda x: P(layout.batch_entry), "ids", self._warned)
        structure, arrays = sums.Params.split(params)
        shardings = tuple(_concrete_sharding(a, layout) for a in arrays)
        # Several processes tracing this step inside their own jit: compare on device.
        check = (
            layout.mesh is not None
            and agreement.needed()
            and validate.is_traced(arrays, batch, key)
        )
        shardings = (*shardings, check)
        try:
            program = self._programs.get((structure, shardings))
        except TypeError:
            raise TypeError(
                "params has a leaf that is neither an array nor hashable (non-array leaves "
                "are compiled into the program as constants, so they must be hashable). "
                "Fix: make it an array, or mark it static in your module (e.g. "
                "eqx.field(static=True) or flax.struct.field(pytree_node=False))."
            ) from None
        if program is None:
            program = self._compile(structure, shardings)
            if not validate.is_traced(arrays, batch, key, ids):
                # Compiled here, once (the call below reuses it), to refuse a program too big
                # for the devices before it runs rather than fail in block_until_ready.
                compiled = program.lower(arrays, batch, key, ids, step).compile()
                memory.check(compiled, memory.default_fix(self.microbatches))
            self._programs[(structure, shardings)] = program
        return structure, program, (arrays, batch, key, ids, step)

    def _compile(self, structure: sums.Params, signature: tuple):
        """The jitted program for a params layout (``signature``: each array leaf's spec,
        then whether processes compare their inputs on device)."""
        *shardings, check = signature
        diff_specs = [s for s, d in zip(shardings, structure.diff, strict=True) if d]
        run = self.program.function(structure, diff_specs)
        layout = self.layout
        if check:
            mesh = layout.required_mesh()  # a check runs only on a mesh
            sig = agreement.signature({**self.settings, "params": str(structure.treedef)})
            run = agreeing(run, structure, mesh, sig)
        if layout.mesh is None or any(s is None for s in shardings):
            return jax.jit(run)
        # Outputs get exactly the params' shardings (and the batch's for aux).
        mesh = layout.mesh
        grads = [NamedSharding(mesh, s) for s in diff_specs]
        replicated = NamedSharding(mesh, P())
        aux = NamedSharding(mesh, self.program.aux_spec())
        return jax.jit(run, out_shardings=(replicated, grads, aux, replicated))


def agreeing(run, structure: sums.Params, mesh: jax.sharding.Mesh, sig: Any):
    """``run`` guarded by an on-device comparison of key, params, frozen inputs and settings.

    Inside a caller's jit, a host exchange is not safe. Each device fingerprints
    its copies of the step key, the params, the frozen inputs and the traced program's
    settings (``sig``); one small all_gather compares them. On a mismatch the
    outputs are nan and the step raises when its results are read, on every process.
    """

    def guarded(arrays, batch, key, ids, step):
        out = run(arrays, batch, key, ids, step)
        frozen = [a for a, f in zip(arrays, structure.frozen, strict=True) if f]
        ok = fingerprint.replicas_agree(
            (keys_lib.step_key(key, step), jnp.asarray(sig), structure.diff_of(arrays), frozen),
            mesh,
        )
        fingerprint.raise_unless(
            ok,
            "the processes disagree on the step key, the params, the frozen inputs or the "
            "step's settings (compared on device inside jit). Fix: derive the key from a "
            "shared seed and step number, initialize the params identically (or broadcast "
            "process 0's), load the same frozen inputs, and build the step with the same "
            "options on every process.",
        )
        return fingerprint.poison_unless(ok, out)

    return guarded


def _concrete_sharding(x: Any, layout: Layout) -> P | None:
    """The PartitionSpec a param's grad must get: its own on the mesh, replicated for host arrays.

    ``None`` inside the caller's jit (a tracer): there the Explicit types, or
    XLA, decide, as for a plain jitted step.
    """
    if layout.mesh is None or isinstance(x, jax.core.Tracer):
        return None
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == layout.mesh:
        return sharding.spec
    return P()
