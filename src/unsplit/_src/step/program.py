"""Default mode's step as one function for ``jax.jit``: the global batch's loss and grads.

:class:`Program` is what :class:`~unsplit._src.step.default.DefaultStep` compiles:
``run(arrays, batch, key, ids, step)`` folds the step number into the key,
places the batch on the mesh, vmaps the one-example
loss over each microbatch (keys by global id), runs the microbatches in a
``lax.scan`` (activation memory of one microbatch), and divides the global sums once
by the global weight (with one microbatch, the division seeds the backward pass, as
``jnp.mean``'s does: no pass over the grads after it, so the program is the plain
step's). On Explicit batch axes the loss runs inside ``auto_axes``: the per-example
vmap is unsplit's business, so the loss (written for one example) never sees them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src.step import coupled, sums
from unsplit._src.step.layout import Layout


class Program:
    """The step of ``spec`` on ``layout`` as one function of ``(arrays, batch, key, ids)``.

    Args:
        spec: the loss (its shardings already on the layout's mesh).
        layout: the mesh and batch axes.
        microbatches: sequential microbatches per device.
    """

    def __init__(self, spec: sums.LossSpec, layout: Layout, microbatches: int):
        self.spec, self.layout, self.microbatches = spec, layout, microbatches

    def aux_spec(self) -> P:
        """The aux's sharding: per-example aux is split like the batch; a coupled loss's
        aux (whatever ``batch_loss`` returns) is replicated."""
        return P() if self.spec.coupled else P(self.layout.batch_entry)

    def function(self, structure: sums.Params, diff_specs: list) -> Callable:
        """``run(arrays, batch, key, ids, step) -> (loss, grads, aux, weight)`` for
        ``jax.jit``; ``diff_specs``: each differentiated leaf's grad sharding (``None``: its
        type's); ``step``: a step number folded into the key here (``None``: the key as is)."""
        layout = self.layout

        def run(arrays, batch, key, ids, step=None):
            key = keys_lib.step_key(key, step)
            diff = structure.diff_of(arrays)
            grad_specs = [
                s if s is not None else _type_spec(a) for s, a in zip(diff_specs, diff, strict=True)
            ]
            core = functools.partial(self.core, structure, grad_specs)
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
                out_sharding = (P(), [s or P() for s in grad_specs], self.aux_spec(), P())
                # cast: auto_axes' inferred type keeps only part of the partial's signature.
                program = cast(
                    Callable[..., Any],
                    jax.sharding.auto_axes(core, axes=layout.batch_axes, out_sharding=out_sharding),
                )
                return program(arrays, batch, key, ids)

        return run

    def core(self, structure: sums.Params, grad_specs: list, arrays, batch, key, ids):
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
            (loss_sum, weight, grad_sums), aux = self.accumulated(
                structure, constrain_grads, arrays, batch, key, ids
            )
            loss, grads = sums.normalize(loss_sum, weight, grad_sums, dtypes)
        aux = jax.tree.map(lambda x: layout.constrain(x, P(layout.batch_entry)), aux)
        return loss, constrain_grads(grads), aux, weight

    def accumulated(self, structure: sums.Params, constrain_grads, arrays, batch, key, ids):
        """The global sums over the microbatches, one at a time (a ``lax.scan``), and the aux."""
        layout, k = self.layout, self.microbatches
        xs = jax.tree.map(lambda x: layout.microbatched(x, k), (batch, ids))

        def one(x):
            return sums.example_sums(self.spec, structure, arrays, x[0], key, x[1], constrain_grads)

        def body(carry, x):
            (loss_s, weight_s, grads), aux = one(x)
            return jax.tree.map(jnp.add, carry, grads), (loss_s, weight_s, aux)

        # The carry has the grads' types, i.e. the params' (Explicit axes included). The loss
        # and weight sums leave the scan per microbatch and are added after it in the same
        # order: a carry for them would need their dtypes (the loss's) before the scan, i.e.
        # a second trace of the loss's forward and backward.
        grad_zeros = [
            jnp.zeros_like(a, dtype=sums.wide_float(a.dtype)) for a in structure.diff_of(arrays)
        ]
        grads, (loss_s, weight_s, aux) = jax.lax.scan(body, constrain_grads(grad_zeros), xs)
        totals = (_sum_in_order(loss_s), _sum_in_order(weight_s), grads)
        return totals, jax.tree.map(layout.unmicrobatched, aux)


def _sum_in_order(values: jax.Array) -> jax.Array:
    """``((values[0] + values[1]) + values[2]) + ...``: a carried sum's order."""
    total, _ = jax.lax.scan(lambda t, v: (t + v, None), values[0], values[1:])
    return total


def _place(x: jax.Array, layout: Layout) -> jax.Array:
    # device_put (not reshard) inside jit carries the concrete devices into the program.
    return jax.device_put(x, NamedSharding(layout.required_mesh(), P(layout.batch_entry)))


def _type_spec(x: Any) -> P | None:
    """The PartitionSpec in ``x``'s type (Explicit axes), if any."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec if spec is not None and any(e is not None for e in spec) else None


def _id_words(ids, size: int, layout: Layout) -> keys_lib.Ids64:
    hi, lo = keys_lib.step_words(ids, size)
    hi, lo = (layout.constrain(w, P(layout.batch_entry)) for w in (hi, lo))
    return keys_lib.Ids64(hi=hi, lo=lo)
