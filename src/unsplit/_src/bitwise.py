"""Bitwise mode: loss and grads bit-identical for every schedule of the same global batch.

What was measured (DESIGN.md) and what this module does about it:

* XLA's matmuls are not batch-invariant, so the unit of work is a **chunk**
  of ``chunk_size`` examples, always computed by the same program.
* Inside a multi-device SPMD program XLA picks other layouts than in a
  one-device program, so the chunk program is its **own** one-device
  ``jax.jit``, dispatched on each device (in each process) for that device's
  chunks. Its executable is the same wherever it runs.
* Elementwise adds are exactly rounded, so chunk sums are combined by pairwise
  adds in the canonical tree of :mod:`unsplit._src.reduce` over the *global*
  chunk index: each device builds the aligned blocks of its share (a binary
  counter, O(log chunks) partial sums). When every share is one aligned
  subtree over a power-of-two device count (the usual case), the top of the
  tree is recursive doubling with ``ppermute``: one extra block per device at a
  time. Otherwise every device gathers all blocks (an ``all_gather``: data
  movement, exact) and adds them in tree order. Never a ``psum``, whose order
  the backend picks.

The guarantee holds on the same hardware and software (JAX, jaxlib, XLA
flags) and for the same ``chunk_size``; see docs/bitwise.md.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import reduce, sums, validate

DEFAULT_CHUNK = 8


def default_chunk_size(batch: int) -> int:
    """``min(8, the largest power of two dividing batch)``: depends on the batch only.

    The chunk size must not depend on the schedule (it fixes the bits), so
    the default is a function of the global batch size alone.
    """
    return min(DEFAULT_CHUNK, batch & -batch)


@functools.cache
def _chunk_program(spec: sums.LossSpec):
    """The one-device chunk program, shared by every Step with the same loss."""

    def chunk_sums(params, chunk, key, hi, lo):
        ids = keys_lib.Ids64(hi=hi, lo=lo)
        structure, arrays = sums.Params.split(params)
        (loss_sum, weight, grads), _ = sums.example_sums(spec, structure, arrays, chunk, key, ids)
        return loss_sum, weight, grads

    return jax.jit(chunk_sums)


_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
_unstack = jax.jit(lambda x, n: tuple(x.reshape(n, -1, *x.shape[1:])), static_argnums=1)


class BitwiseStep:
    """Runs a :class:`~unsplit._src.step.Step` in bitwise mode."""

    def __init__(self, step):
        self.step = step
        if step.chunk_size is not None:
            c = step.chunk_size
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(
                    f"chunk_size must be a positive int (examples per chunk); got {c!r}. "
                    f"Fix: omit it for the default, or pass e.g. chunk_size={DEFAULT_CHUNK}."
                )
        self.chunk_program = _chunk_program(step.spec)
        self._finishers: dict[Any, Any] = {}
        self._pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}

    def _pool(self, workers: int) -> concurrent.futures.ThreadPoolExecutor:
        """A dispatch pool kept across calls (starting threads every step costs ~ms)."""
        if workers not in self._pools:
            self._pools[workers] = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="unsplit-bitwise"
            )
        return self._pools[workers]

    def chunk_size(self, batch: int) -> int:
        return self.step.chunk_size or default_chunk_size(batch)

    def __call__(self, params, batch, key, ids):
        step = self.step
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, batch, key))):
            raise TypeError(
                "bitwise=True cannot run inside jax.jit (or another transformation): it "
                "dispatches one fixed chunk program per device and combines the results in a "
                "fixed order, which needs concrete arrays. Fix: call the step outside jit "
                "(jit your optimizer update separately), or use bitwise=False inside jit."
            )
        size = validate.batch_size(batch)
        chunk = self.chunk_size(size)
        per_microbatch = size // (step.num_devices * step.microbatches)
        if per_microbatch % chunk:
            raise ValueError(
                f"bitwise mode needs a whole number of chunks per microbatch: batch {size} / "
                f"(devices {step.num_devices} x microbatches {step.microbatches}) = "
                f"{per_microbatch} examples per microbatch, not a multiple of "
                f"chunk_size={chunk}. Fix: pass a chunk_size that divides {per_microbatch} "
                "(the same one for every schedule you compare), or use fewer microbatches."
            )
        n_chunks = size // chunk
        devices = _batch_devices(step.mesh)
        per_device = n_chunks // len(devices)
        hi, lo = _id_words(ids, size, step.mesh)
        local = [
            (d, dev) for d, dev in enumerate(devices) if dev.process_index == jax.process_index()
        ]
        shares = _local_shares((batch, hi, lo), step.mesh, devices, local, per_device)
        param_copies = _replicas(params, [dev for _, dev in local])

        def device_blocks(d, dev):
            acc = reduce.Accumulator(_add)
            p, k = param_copies[dev], jax.device_put(key, dev)
            leaves, treedef = jax.tree.flatten(shares[d])
            parts = [_unstack(x, per_device) for x in leaves]
            for i in range(per_device):
                b, hi_i, lo_i = jax.tree.unflatten(treedef, [part[i] for part in parts])
                acc.push(d * per_device + i, self.chunk_program(p, b, k, hi_i, lo_i))
            return d, acc.blocks

        # One dispatching thread per device: devices run (and, on the first call, compile
        # the same chunk program) in parallel. Always the pool's threads, even for one
        # device, so every schedule dispatches under the same (thread-local) jax config.
        pool = self._pool(len(local))
        all_blocks = dict(pool.map(lambda item: device_blocks(*item), local))
        loss, grads, _ = self._finish(params, all_blocks, devices, per_device, n_chunks)
        structure, _ = sums.Params.split(params)
        return loss, structure.grads_tree(grads), None

    def _finish(self, params, all_blocks, devices, per_device, n_chunks):
        """Gathers every device's blocks and adds them in the canonical tree order."""
        layout = [
            reduce.aligned_blocks(d * per_device, (d + 1) * per_device) for d in range(len(devices))
        ]
        slots = max(len(b) for b in layout)
        user = self.step.mesh
        # Combine on the user's mesh when it is 1-D, so grads land where the params live.
        mesh = user if user is not None and user.devices.ndim == 1 else _line_mesh(devices)
        stacked = []
        for d, blocks in all_blocks.items():
            values = [_to(blocks[b], devices[d]) for b in layout[d]]
            if len(values) < slots:  # pad to the same number of slots on every device
                values += [_zeros_like(values[0])] * (slots - len(values))
            stacked.append(_stack_slots(*values))
        global_blocks = jax.tree.map(
            lambda *parts: jax.make_array_from_single_device_arrays(
                (len(devices), *parts[0].shape[1:]),
                NamedSharding(mesh, P(mesh.axis_names[0])),
                list(parts),
            ),
            *stacked,
        )
        structure, arrays = sums.Params.split(params)
        dtypes = [jnp.dtype(jnp.result_type(a)) for a in structure.diff_of(arrays)]
        finish = self._finisher(mesh, tuple(map(tuple, layout)), slots, n_chunks, dtypes)
        loss, grads, weight = finish(global_blocks)
        if user is None:  # plain single-device arrays, like the default mode's
            return jax.tree.map(lambda x: x.addressable_data(0), (loss, grads, weight))
        if mesh is not user:
            loss, grads, weight = jax.device_put((loss, grads, weight), NamedSharding(user, P()))
        return loss, grads, weight

    def _finisher(self, mesh, layout, slots, n_chunks, dtypes):
        cache_key = (tuple(mesh.devices.flat), layout, slots, n_chunks, tuple(dtypes))
        if cache_key in self._finishers:
            return self._finishers[cache_key]

        axis = mesh.axis_names[0]

        devices = len(layout)
        doubling = (
            devices & (devices - 1) == 0
            and all(len(blocks) == 1 for blocks in layout)
            and n_chunks & (n_chunks - 1) == 0
        )

        def doubled(blocks):
            # Every share is one aligned subtree and the device count a power of two: the
            # top of the tree is recursive doubling. Round r adds partners d and d ^ 2**r
            # (IEEE addition is commutative, so both get left + right, bit for bit);
            # each device holds one extra block at a time, not one per device.
            x = jax.tree.map(lambda a: a[0, 0], blocks)
            for r in range(devices.bit_length() - 1):
                perm = [(d, d ^ (1 << r)) for d in range(devices)]
                x = jax.tree.map(jnp.add, x, jax.lax.ppermute(x, axis, perm))
            return x

        def gathered(blocks):
            everyone = jax.tree.map(lambda x: jax.lax.all_gather(x, axis, tiled=True), blocks)
            named = {}
            for d, device_blocks in enumerate(layout):
                for j, b in enumerate(device_blocks):
                    named[b] = jax.tree.map(lambda x, d=d, j=j: x[d, j], everyone)
            return reduce.combine(named, n_chunks, lambda a, b: jax.tree.map(jnp.add, a, b))

        def finish(blocks):
            # Every device adds the same gathered blocks in the same order: truly replicated.
            total = jax.shard_map(
                doubled if doubling else gathered,
                mesh=mesh,
                in_specs=P(axis),
                out_specs=P(),
                check_vma=False,
            )(blocks)
            loss_sum, weight, grad_sum = total
            loss, grads = sums.normalize(loss_sum, weight, grad_sum, dtypes)
            return loss, grads, weight

        replicated = NamedSharding(mesh, P())
        program = jax.jit(
            finish, in_shardings=NamedSharding(mesh, P(axis)), out_shardings=replicated
        )
        self._finishers[cache_key] = program
        return program


_zeros_like = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))


@jax.jit
def _stack_slots(*values):
    return jax.tree.map(lambda *xs: jnp.stack(xs)[None], *values)


def _to(tree, device):
    return jax.tree.map(lambda x: x if x.devices() == {device} else jax.device_put(x, device), tree)


def _line_mesh(devices) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(devices), ("chunks",), axis_types=(AxisType.Explicit,))


def _batch_devices(mesh) -> list:
    """The devices that each own one share of the batch: the mesh's first axis."""
    if mesh is None:
        return [jax.devices()[0]]
    grid = np.asarray(mesh.devices)
    return list(grid.reshape(grid.shape[0], -1)[:, 0])


def _id_words(ids, size, mesh):
    if isinstance(ids, keys_lib.Ids64):
        return ids.hi, ids.lo
    if ids is not None:
        return keys_lib.id_words(ids)
    if mesh is not None and jax.process_count() > 1:
        sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
        lo = jax.make_array_from_callback(
            (size,), sharding, lambda idx: np.arange(size, dtype=np.uint32)[idx]
        )
        hi = jax.make_array_from_callback(
            (size,), sharding, lambda idx: np.zeros(size, np.uint32)[idx]
        )
        return hi, lo
    return np.zeros(size, np.uint32), np.arange(size, dtype=np.uint32)


def _local_shares(tree, mesh, devices, local, per_device):
    """For each local batch device ``d``: its rows of every leaf, on that device."""
    n = len(devices)
    shares = {d: [] for d, _ in local}
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        size = leaf.shape[0]
        rows = size // n
        by_start = {}
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                start = shard.index[0].start or 0
                if shard.data.shape[0] == rows:
                    by_start.setdefault((start, shard.device), shard.data)
        for d, dev in local:
            piece = by_start.get((d * rows, dev))
            if piece is None:
                piece = jax.device_put(
                    _host_rows(leaf, d * rows, (d + 1) * rows, by_start, rows), dev
                )
            shares[d].append(piece)
    return {d: jax.tree.unflatten(treedef, parts) for d, parts in shares.items()}


def _host_rows(leaf, start, stop, by_start, rows):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        for (s, _), data in by_start.items():
            if s == start:
                return data
        raise ValueError(
            "a batch leaf is a global jax.Array whose rows for a local device live in another "
            "process. Fix: build the batch with unsplit.global_batch(local_rows, mesh) on the "
            "step's mesh."
        )
    return np.asarray(leaf[start:stop])


def _replicas(params, devices) -> dict:
    """A copy of ``params`` on each device, reusing replicated shards already there."""
    leaves, treedef = jax.tree.flatten(params)
    per_leaf = []
    for leaf in leaves:
        here = {}
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                if shard.data.shape == leaf.shape:
                    here[shard.device] = shard.data
        per_leaf.append(here)
    out = {}
    for dev in devices:
        parts = [
            here.get(dev) if dev in here else jax.device_put(_host(leaf), dev)
            for leaf, here in zip(leaves, per_leaf, strict=True)
        ]
        out[dev] = jax.tree.unflatten(treedef, parts)
    return out


def _host(leaf):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        raise ValueError(
            "bitwise mode needs the params replicated on every batch device; got a params leaf "
            f"sharded as {leaf.sharding}. Fix: pass replicated params (host arrays, or "
            "jax.device_put(params, NamedSharding(mesh, P())))."
        )
    return leaf
