"""Default mode: one jitted SPMD program, the way a plain jitted step with the same shardings runs.

The program vmaps the one-example loss over each microbatch (keys by global id),
runs the microbatches in a ``lax.scan`` (activation memory of one microbatch),
and divides the global sums once by the global weight (with one microbatch, the
division seeds the backward pass, as ``jnp.mean``'s does: no pass over the grads
after it, so the program is the plain step's). The batch is sharded
over the layout's batch axes; params keep whatever sharding they have (replicated,
FSDP over the batch axes, tensor parallel over model axes) and XLA inserts the
collectives, exactly as for ``jax.jit(jax.value_and_grad(batched_loss))``. The
grads are constrained to the params' shardings, the aux to the batch's.

Because every example's key is a function of its global id, the result does
not depend on how the batch is partitioned or cut into microbatches (up to
float rounding: XLA picks the order of the sums).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src.processes import agreement, fingerprint
from unsplit._src.step import constraints, coupled, memory, sums, validate
from unsplit._src.step.layout import Layout, move_onto, named_spec


# Long: one compiled SPMD program per params layout -- placing its inputs, building the
# program (vmap, microbatch scan, sums over the batch axes) and its on-device agreement
# guard -- each method a stage of that one program, sharing its cache.
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
        self._programs: dict[Any, Any] = {}
        self._warned: set[str] = set()

    def __call__(self, params, batch, key, ids, *, memo: dict | None = None) -> sums.Result:
        """Runs the step (``memo`` is bitwise mode's: one jit looks at the params anyway)."""
        structure, program, args = self._prepare(params, batch, key, ids)
        loss, grads, aux, weight = program(*args)
        return sums.Result(loss, structure.grads_tree(grads), aux, weight, params)

    def lower(self, params, batch, key, ids) -> jax.stages.Lowered:
        """The program this call would run, lowered (``.compile().memory_analysis()``...)."""
        _, program, args = self._prepare(params, batch, key, ids)
        return program.lower(*args)

    def _prepare(self, params, batch, key, ids):
        layout = self.layout
        mesh = layout.mesh
        if mesh is not None:
            params = move_onto(
                params, layout, lambda x: named_spec(x, mesh), "params", self._warned
            )
            batch = move_onto(batch, layout, lambda x: P(layout.batch_entry), "batch", self._warned)
            key = move_onto(key, layout, lambda x: P(), "key", self._warned)
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
                compiled = program.lower(arrays, batch, key, ids).compile()
                memory.check(compiled, memory.default_fix(self.microbatches))
            self._programs[(structure, shardings)] = program
        return structure, program, (arrays, batch, key, ids)

    def _compile(self, structure: sums.Params, signature: tuple):
        *shardings, check = signature
        run = self._program(structure, tuple(shardings))
        if check:
            run = self._agreeing(run, structure)
        layout = self.layout
        if layout.mesh is None or any(s is None for s in shardings):
            return jax.jit(run)
        # Outputs get exactly the params' shardings (and the batch's for aux).
        mesh = layout.mesh
        diff = [s for s, d in zip(shardings, structure.diff, strict=True) if d]
        grads = [NamedSharding(mesh, s) for s in diff]
        replicated = NamedSharding(mesh, P())
        out = (replicated, grads, NamedSharding(mesh, self._aux_spec()), replicated)
        return jax.jit(run, out_shardings=out)

    def _agreeing(self, run, structure: sums.Params):
        """``run`` guarded by an on-device comparison of key, params and settings across devices.

        Inside a caller's jit, a host exchange is not safe. Each device
        fingerprints its copies of the key, the params and the traced program's
        settings; one small all_gather compares them. On a mismatch the outputs
        are nan and the step raises when its results are read, on every process.
        """
        mesh = self.layout.required_mesh()  # a check runs only on a mesh
        sig = agreement.signature({**self.settings, "params": str(structure.treedef)})

        def guarded(arrays, batch, key, ids):
            out = run(arrays, batch, key, ids)
            ok = fingerprint.replicas_agree(
                (key, jnp.asarray(sig), structure.diff_of(arrays)), mesh
            )
            fingerprint.raise_unless(
                ok,
                "the processes disagree on the step key, the params or the step's settings "
                "(compared on device inside jit). Fix: derive the key from a shared seed and "
                "step number, initialize the params identically (or broadcast process 0's), "
                "and build the step with the same options on every process.",
            )
            return fingerprint.poison_unless(ok, out)

        return guarded

    def _program(self, structure: sums.Params, shardings: tuple):
        """The step as one function of ``(arrays, batch, key, ids)``, for ``jax.jit``."""
        layout = self.layout
        diff_specs = [s for s, d in zip(shardings, structure.diff, strict=True) if d]

        def run(arrays, batch, key, ids):
            diff = structure.diff_of(arrays)
            grad_specs = [
                s if s is not None else _type_spec(a) for s, a in zip(diff_specs, diff, strict=True)
            ]
            core = functools.partial(self._core, structure, grad_specs)
            if layout.mesh is None:
                return core(arrays, batch, key, ids)
            # Place the batch on the concrete mesh first: inside the caller's jit this also
            # tells their program which devices it runs on (like a shard_map's mesh would).
            batch = jax.tree.map(lambda x: _place(x, layout), batch)
            with jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh):
                if not layout.is_explicit(layout.batch_axes):
                    return core(arrays, batch, key, ids)
                # The batch axes become Auto inside the step: the per-example vmap is
                # unsplit's business, so the user's loss (written for one example) never
                # sees them, and XLA partitions the batch (and FSDP params) itself.
                # Explicit model axes stay Explicit, as in the user's own code.
                out_sharding = (P(), [s or P() for s in grad_specs], self._aux_spec(), P())
                # cast: auto_axes' inferred type keeps only part of the partial's signature.
                program = cast(
                    Callable[..., Any],
                    jax.sharding.auto_axes(core, axes=layout.batch_axes, out_sharding=out_sharding),
                )
                return program(arrays, batch, key, ids)

        return run

    def _aux_spec(self) -> P:
        """The aux's sharding: per-example aux is split like the batch; a coupled loss's
        aux (whatever ``batch_loss`` returns) is replicated."""
        return P() if self.spec.coupled else P(self.layout.batch_entry)

    def _core(self, structure: sums.Params, grad_specs: list, arrays, batch, key, ids):
        """``(loss, grads, aux, weight)`` of the global batch, inside the step's program."""
        layout = self.layout

        def constrain_grads(grads):
            return [
                g if s is None else layout.constrain(g, s)
                for g, s in zip(grads, grad_specs, strict=True)
            ]

        batch = jax.tree.map(lambda x: layout.constrain(x, P(layout.batch_entry)), batch)
        ids = _id_words(ids, jax.tree.leaves(batch)[0].shape[0], layout)
        if self.spec.coupled:
            loss, grads, aux = coupled.global_value_and_grads(
                self.spec,
                structure,
                arrays,
                batch,
                key,
                ids,
                microbatches=self.microbatches,
                microbatched=lambda x: layout.microbatched(x, self.microbatches),
                unmicrobatched=layout.unmicrobatched,
                constrain_grads=constrain_grads,
            )
            return loss, grads, aux, jnp.ones((), jnp.float32)
        dtypes = [jnp.result_type(a) for a in structure.diff_of(arrays)]
        if self.microbatches == 1:  # one pass: the division by the weight seeds the backward
            (loss, weight, grads), aux = sums.example_sums(
                self.spec, structure, arrays, batch, key, ids, constrain_grads, normalized=True
            )
            grads = [g.astype(d) for g, d in zip(grads, dtypes, strict=True)]
        else:
            (loss_sum, weight, grad_sums), aux = self._accumulated(
                structure, constrain_grads, arrays, batch, key, ids
            )
            loss, grads = sums.normalize(loss_sum, weight, grad_sums, dtypes)
        aux = jax.tree.map(lambda x: layout.constrain(x, P(layout.batch_entry)), aux)
        return loss, constrain_grads(grads), aux, weight

    def _accumulated(self, structure: sums.Params, constrain_grads, arrays, batch, key, ids):
        """The global sums over the microbatches, one at a time (a ``lax.scan``), and the aux."""
        layout, k = self.layout, self.microbatches
        xs = jax.tree.map(lambda x: layout.microbatched(x, k), (batch, ids))

        def one(x):
            return sums.example_sums(self.spec, structure, arrays, x[0], key, x[1], constrain_grads)

        def body(carry, x):
            totals, aux = one(x)
            return jax.tree.map(jnp.add, carry, totals), aux

        # The carry has the grads' types, i.e. the params' (Explicit axes included).
        grad_zeros = [
            jnp.zeros_like(a, dtype=sums.wide_float(a.dtype)) for a in structure.diff_of(arrays)
        ]
        (loss_s, weight_s, _), _ = jax.eval_shape(one, jax.tree.map(lambda a: a[0], xs))
        zeros = (jnp.zeros((), loss_s.dtype), jnp.zeros((), weight_s.dtype))
        totals, aux = jax.lax.scan(body, (*zeros, constrain_grads(grad_zeros)), xs)
        return totals, jax.tree.map(layout.unmicrobatched, aux)


def _place(x: jax.Array, layout: Layout) -> jax.Array:
    # device_put (not reshard) inside jit carries the concrete devices into the program.
    return jax.device_put(x, NamedSharding(layout.required_mesh(), P(layout.batch_entry)))


def _type_spec(x: Any) -> P | None:
    """The PartitionSpec in ``x``'s type (Explicit axes), if any."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec if spec is not None and any(e is not None for e in spec) else None


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


def _id_words(ids, size: int, layout: Layout) -> keys_lib.Ids64:
    hi, lo = keys_lib.step_words(ids, size)
    hi, lo = (layout.constrain(w, P(layout.batch_entry)) for w in (hi, lo))
    return keys_lib.Ids64(hi=hi, lo=lo)
