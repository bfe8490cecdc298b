"""Bitwise mode: loss and grads bit-identical for every schedule of the same global batch.

What was measured (the Bitwise mode guide,
https://unsplit.readthedocs.io/en/latest/bitwise/) and how bitwise mode answers it:

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

One call, in order: :class:`BitwiseStep` (this module) finds the plan for the
inputs' layout (:mod:`~unsplit._src.bitwise.plan`, checked by
:mod:`~unsplit._src.bitwise.schedule`) and its :class:`~unsplit._src.bitwise.runner.Runner`,
which places the inputs on each group's devices (:mod:`~unsplit._src.bitwise.placement`),
runs the compiled programs (:mod:`~unsplit._src.bitwise.programs`, compiled once and
shared: :mod:`~unsplit._src.bitwise.cache`) and adds the chunk sums in the canonical
tree; a coupled loss runs its three passes in
:class:`~unsplit._src.bitwise.coupled_runner.CoupledRunner`. Host work per step is a
few calls per device group, whatever the number of parameters (they travel as one
flat vector per dtype).

The guarantee holds on the same hardware and software (JAX, jaxlib, XLA
flags), the same ``chunk_size``, and the same model-parallel layout; on CPU,
whatever the process's thread count (chunk programs get canonical dots:
:mod:`unsplit._src.bitwise.canonical_dots`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src.bitwise import accelerators, schedule
from unsplit._src.bitwise import plan as bitwise_plan
from unsplit._src.bitwise.blocked import chunk as blocked_chunk
from unsplit._src.bitwise.blocked import paired
from unsplit._src.bitwise.coupled_runner import CoupledRunner
from unsplit._src.bitwise.runner import Runner
from unsplit._src.step import sums
from unsplit._src.step.layout import Layout, move_onto, named_spec

default_chunk_size = schedule.default_chunk_size


class BitwiseStep:
    """Runs a :class:`~unsplit._src.front.value_and_grad.Step` in bitwise mode."""

    def __init__(self, spec: sums.LossSpec, layout: Layout, options: Any):
        self.spec = spec
        self.options = options
        self.chunk_size = options.chunk_size  # validated by unsplit.Bitwise
        self.blocks = options.blocks
        self._twin: BitwiseStep | None = None  # degree-1 model layouts run on it at degree 2
        mesh_axes = tuple(layout.mesh.axis_names) if layout.mesh is not None else ()
        self.chunk_axes = schedule.check_chunk_axes(
            options.chunk_axes, layout.batch_axes, mesh_axes
        )
        if layout.mesh is None:  # one device: a one-device mesh, the same programs
            device = jax.local_devices()[0]
            layout = Layout(Mesh(np.array([device]), ("batch",)), ("batch",))
            self.single = True
        else:
            self.single = False
        self.layout = layout
        # How many devices compute each chunk together: the chunk size is a multiple of it.
        self.chunk_split = schedule.chunk_split(layout.required_mesh(), self.chunk_axes)
        accelerators.warn_once_without_gpu_flags(layout.required_mesh().devices.flat)
        accelerators.warn_once_with_compilation_cache(layout.required_mesh().devices.flat)
        self._plans: dict[Any, Any] = {}
        self._warned: set[str] = set()

    def chunk(self, batch: int) -> int:
        """The chunk size: given, else the default for ``batch`` made a multiple of the
        chunk axes' devices (a function of the batch size and those devices only)."""
        if self.chunk_size:
            return self.chunk_size
        chunk = default_chunk_size(batch)
        return math.lcm(chunk, self.chunk_split)

    def __call__(
        self, params, batch, key, ids, *, memo: dict | None = None, step=None
    ) -> sums.Result:
        """Runs the step (``step``: a step number, folded into the key first: one small
        program, the same bits as the caller's ``fold_in``).

        ``memo``: a caller's own dict, kept while it passes the params this step
        last returned to it (a train step's own): the programs found for them
        are kept there, so their layout is not looked at again for a batch of the
        same shapes. The caller empties it when its params are new.
        """
        if step is not None:
            key = _step_key(key, step)
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

    def prepare(self, params, batch, key) -> tuple[Runner, Any]:
        """The compiled programs for these inputs, and the params placed on the mesh.

        This is the per-call work that looks at every params leaf (their
        shardings and placement); :func:`unsplit.bitwise_train_step` skips it
        when it gets back the params it returned.
        """
        layout = self.layout
        mesh = layout.required_mesh()
        params = move_onto(params, layout, lambda x: named_spec(x, mesh), "params", self._warned)
        size = np.shape(jax.tree.leaves(batch)[0])[0]  # checked by the step
        chunk = self.chunk(size)
        return self._state(params, batch, key, size, chunk), params

    def _state(self, params, batch, key, size, chunk) -> Runner:
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
            schedule.check_schedule(
                size, chunk, self.layout.shards, self.chunk_split, self.chunk_axes
            )
            plan, _ = bitwise_plan.make_plan(
                self.spec,
                self.layout,
                params,
                batch,
                key,
                size,
                chunk,
                self.chunk_axes,
                blocks=self.blocks,
            )
            schedule.warn_gathered(plan, self.layout.batch_axes, self.chunk_axes, self._warned)
            schedule.warn_group_size(plan, self._warned)
            state = self._paired(plan) or (CoupledRunner if self.spec.coupled else Runner)(
                self, plan
            )
            self._plans[signature] = state
        return state

    def _paired(self, plan) -> Any:
        """A degree-1 model-parallel plan's runner at degree 2 (:mod:`.blocked.paired`), or
        None (no model axes, several devices per group already, or no second device)."""
        if not (plan.model_axes and blocked_chunk.ENABLED) or plan.chunk_axes or self.spec.coupled:
            return None
        if plan.devices_per_group > 1:
            return None
        if plan.region_axes:  # its shard_map is declared on the user's mesh: not moved
            paired.warn_unpaired(plan.model_axes, self._warned, region=True)
            return None
        mesh = self.layout.required_mesh()
        twin = paired.paired_mesh(mesh, self.layout.batch_axes, plan.model_axes[0])
        if twin is None:
            paired.warn_unpaired(plan.model_axes, self._warned)
            return None
        if self._twin is None:
            self._twin = BitwiseStep(self.spec, Layout(twin, self.layout.batch_axes), self.options)
        return paired.Paired(self._twin, mesh, self.single, plan.given, plan.structure.diff)


_step_key = jax.jit(keys_lib.step_key)


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
