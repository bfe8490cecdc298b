"""The optimizer update inside the bitwise guarantee: one program, on whole arrays.

``jax.jit(optimizer.update)`` on sharded params is a different program for every
sharding: XLA compiles the elementwise math for other shard shapes (other
vector tails, other fusions) and reduces norms (``clip_by_global_norm``,
Adafactor's factored statistics, LAMB's trust ratios) in an order that depends
on the layout (the Bitwise mode guide has the measurement: https://unsplit.readthedocs.io/en/latest/bitwise/). :class:`CanonicalUpdate`
runs the update as one program whose inputs do not depend on the schedule: the
whole params, grads
and optimizer state (gathered: exact data movement), on one device per
process, compiled for one device; then each result goes back to the sharding
its input had (exact slicing). The same program on the same values gives the
same bits, whatever the data-parallel degree, the params' layout or the
process count.

It costs, per step, a copy of params, grads and optimizer state onto one device
per process (one process: only that device holds them whole; several: an
all-gather) and the whole update there (O(params) memory on that device); the
results go back shard by shard. The Bitwise mode guide has the numbers and what keeps
the bits in an update you write yourself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import partition
from unsplit._src.bitwise import relocate
from unsplit._src.bitwise.fsdp import fixed_order_update, group_reduce


class CanonicalUpdate:
    """``fn(*trees)`` run on whole arrays on one device per process; results resharded.

    ``fn`` returns trees shaped like its first ``len(targets)`` arguments (e.g.
    ``update(params, opt_state, grads) -> (params, opt_state)``); each output
    leaf gets the sharding of the input leaf it replaces.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mesh = jax.make_mesh((2,), ("data",))
        >>> w = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, jax.P("data")))
        >>> double = CanonicalUpdate(lambda w: (w * 2,), mesh, outputs=1)
        >>> (out,) = double(w)
        >>> out.tolist(), out.sharding == w.sharding
        ([0.0, 2.0, 4.0, 6.0], True)
    """

    def __init__(self, fn: Callable[..., tuple], mesh: jax.sharding.Mesh, *, outputs: int):
        self.mesh = mesh
        self.outputs = outputs
        self.replicated = NamedSharding(mesh, P())
        self.device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
        self.local_devices = [
            d for d in mesh.devices.flat if d.process_index == jax.process_index()
        ]
        self.fn = jax.jit(fn)
        self.gather = jax.jit(lambda tree: tree, out_shardings=self.replicated)
        self._reshard: dict[Any, _Slicer] = {}
        self.everywhere = relocate.OnEveryDevice(self.fn, mesh, self.device)

    def __call__(self, *trees: Any) -> tuple:
        # A Python number (TrainState.create's step=0) as a NumPy scalar: not weakly typed,
        # so the update sees the same types on the first call as on the next ones.
        trees = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, int | float) else x, trees)
        if self.everywhere.accepts(trees):  # every leaf whole on every device: no gather
            return self.everywhere(trees, like=trees[: self.outputs])
        targets = jax.tree.map(self._target, trees[: self.outputs])
        # On one device per process, not on the mesh of the caller's jax.set_mesh.
        with jax.set_mesh(None):
            out = self.fn(*self._gathered(trees))
            return self._scatter(out, targets)

    def _gathered(self, trees: tuple) -> tuple:
        """Every leaf whole on this process's update device (exact data movement).

        One process: each leaf's shards are copied onto that device, and no
        other device holds more than it did. Several processes: every leaf is
        all-gathered (replicated on the mesh), and this process takes its copy.
        """
        if jax.process_count() == 1:
            whole = jax.device_put(trees, self.device)
        else:
            whole = jax.tree.map(self._local, self.gather(trees))
        # The device's plain buffer: an array moved off a one-device Explicit mesh keeps
        # that mesh's type, and the one-device program takes none.
        return jax.tree.map(lambda x: x.addressable_data(0), whole)

    def _target(self, x: Any) -> jax.sharding.Sharding:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
            return sharding
        return self.replicated  # a Python number or an array off the mesh (a step count)

    def _local(self, x: jax.Array) -> jax.Array:
        return next(s.data for s in x.addressable_shards if s.device == self.device)

    def _scatter(self, out: tuple, targets: tuple) -> tuple:
        """Each output leaf cut into its target sharding's local pieces and sent to their
        devices: a device receives only its shard; the update device holds each distinct
        piece once (a leaf replicated on the mesh is sent as it is)."""
        leaves, treedef = jax.tree.flatten(out)
        shardings = jax.tree.leaves(targets, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        key = (treedef, tuple(shardings), tuple((x.shape, x.dtype) for x in leaves))
        if key not in self._reshard:
            self._reshard[key] = _Slicer(leaves, shardings)
        return jax.tree.unflatten(treedef, self._reshard[key](leaves))


class _Slicer:
    """Cuts whole arrays on one device into the local shards of their target shardings.

    Each distinct local piece of a leaf is cut once (one program for all leaves)
    and sent to every device that holds it; a piece that is the whole leaf is
    sent as it is.
    """

    def __init__(self, leaves: list, shardings: list):
        self.shardings = shardings
        self.pieces = []  # per leaf: [(bounds or None for the whole leaf, [devices])]
        for x, sharding in zip(leaves, shardings, strict=True):
            by_bounds: dict[Any, list] = {}
            for device, index in sharding.addressable_devices_indices_map(x.shape).items():
                by_bounds.setdefault(_bounds(index, x.shape), []).append(device)
            self.pieces.append(list(by_bounds.items()))
        cuts = [[b for b, _ in pieces if b is not None] for pieces in self.pieces]

        def cut(xs):
            return [[_cut(x, b) for b in bounds] for x, bounds in zip(xs, cuts, strict=True)]

        self.cut = jax.jit(cut)

    def __call__(self, leaves: list) -> list:
        arrays = []
        for x, sharding, pieces, parts in zip(
            leaves, self.shardings, self.pieces, self.cut(leaves), strict=True
        ):
            parts = iter(parts)
            sources, devices = [], []
            for bounds, holders in pieces:
                source = x if bounds is None else next(parts)
                sources += [source] * len(holders)
                devices += holders
            shards = jax.device_put(sources, devices)
            arrays.append(jax.make_array_from_single_device_arrays(x.shape, sharding, shards))
        return arrays


def _cut(x: jax.Array, bounds: tuple) -> jax.Array:
    return x[tuple(slice(start, stop) for start, stop in bounds)]


def _bounds(index: tuple, shape: tuple) -> Any:
    """A shard's index as ((start, stop), ...), or None when it is the whole array."""
    bounds = tuple(
        (s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True)
    )
    return None if all(b == (0, n) for b, n in zip(bounds, shape, strict=True)) else bounds


class GroupedUpdate:
    """``fn(*trees)`` run by every FSDP group, each leaf sharded over the group's axes only.

    The update of a bitwise step with ``chunk_axes``: its bits are fixed by the
    group (the chunk axes' sizes and the leaves' specs over them), not by the
    other batch axes, as the step's are. Every leaf keeps only the ``axes`` of
    its sharding (gathered over the others first, exactly, if it had any); each
    group of devices along ``axes`` runs ``fn`` on its own shards, manual over
    the group with every float sum across its devices in unsplit's fixed order
    (:mod:`~unsplit._src.bitwise.fsdp.fixed_order_update`), all groups in one
    program over the mesh (manual over every axis: each device runs the code one
    group's program would, its collectives inside its group; an update that rewrite
    cannot run is XLA's SPMD program instead, with a :class:`FixedOrderFallback`
    warning and the reason in :attr:`fallback`); each output gets the sharding of
    the input leaf it replaces. Memory per device: the leaves' shards
    over the group, as default mode's FSDP update holds them (not the whole
    arrays on one device, as :class:`CanonicalUpdate` does).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mesh = jax.make_mesh((2, 2), ("data", "fsdp"))
        >>> w = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, jax.P("fsdp")))
        >>> double = GroupedUpdate(lambda w: (w * 2,), mesh, outputs=1, axes=("fsdp",))
        >>> (out,) = double(w)
        >>> out.tolist(), out.sharding == w.sharding
        ([0.0, 2.0, 4.0, 6.0], True)
    """

    def __init__(
        self, fn: Callable[..., tuple], mesh: jax.sharding.Mesh, *, outputs: int, axes: tuple
    ):
        self.fn, self.mesh, self.outputs, self.axes = fn, mesh, outputs, tuple(axes)
        names = list(mesh.axis_names)
        order = [names.index(a) for a in names if a not in self.axes]
        order += [names.index(a) for a in self.axes]
        grid = np.transpose(np.asarray(mesh.devices), order)
        grid = grid.reshape(-1, *(mesh.shape[a] for a in self.axes))
        me = jax.process_index()
        types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        # This process's groups (one group's mesh gives the rewrite the group axes' sizes).
        self.groups = [
            jax.sharding.Mesh(g, self.axes, axis_types=tuple(types[a] for a in self.axes))
            for g in grid
            if any(d.process_index == me for d in g.flat)
        ]
        self.replicated = NamedSharding(mesh, P())
        self._programs: dict[Any, Any] = {}
        self._gathers: dict[Any, Callable] = {}
        self.fallback: str | None = None  # why the update's group sums are XLA's, if they are

    def __call__(self, *trees: Any) -> tuple:
        trees = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, int | float) else x, trees)
        targets = jax.tree.map(self._target, trees[: self.outputs])
        local_specs = jax.tree.map(lambda x: partition.keep_axes(self._spec(x), self.axes), trees)
        trees = self._gathered(trees, local_specs)
        return self._resharded(self._run(trees, local_specs, targets), targets)

    def _spec(self, x: Any) -> P:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
            return P(*sharding.spec, *([None] * (np.ndim(x) - len(sharding.spec))))
        return P(*([None] * np.ndim(x)))

    def _target(self, x: Any) -> jax.sharding.Sharding:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
            return sharding
        return self.replicated

    def _gathered(self, trees: tuple, local_specs: tuple) -> tuple:
        """Every leaf on the mesh with only the group axes in its spec (exact data movement).

        Leaves already so (the usual FSDP layout) are used as they are: no copy.
        """
        leaves, treedef = jax.tree.flatten(trees)
        specs = jax.tree.leaves(local_specs, is_leaf=_is_spec)
        todo = [
            i for i, (x, s) in enumerate(zip(leaves, specs, strict=True)) if not self._has(x, s)
        ]
        if todo:
            shardings = [NamedSharding(self.mesh, specs[i]) for i in todo]
            key = ("gather", tuple(shardings))
            if key not in self._gathers:
                self._gathers[key] = jax.jit(lambda xs: xs, out_shardings=shardings)
            for i, x in zip(todo, self._gathers[key]([leaves[i] for i in todo]), strict=True):
                leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def _has(self, x: Any, spec: P) -> bool:
        """Whether ``x`` is already on the mesh with sharding ``spec``."""
        return isinstance(x, jax.Array) and x.sharding.is_equivalent_to(
            NamedSharding(self.mesh, spec), np.ndim(x)
        )

    def _run(self, trees: tuple, local_specs: tuple, targets: tuple) -> Any:
        """``fn`` on every group's shards: one program over the whole mesh, each group of
        devices along the group axes on its own shards (no per-leaf, per-group arrays built
        in Python on every step: with many leaves and groups that cost more than the update)."""
        leaves = jax.tree.leaves(trees)
        key = (
            jax.tree.structure(trees),
            tuple((np.shape(x), str(x.dtype)) for x in leaves),
            tuple(jax.tree.leaves(local_specs, is_leaf=_is_spec)),
            tuple(jax.tree.leaves(targets, is_leaf=_is_sharding)),
        )
        if key not in self._programs:
            outs = tuple(local_specs[: self.outputs])

            def out_sharding(spec, target, x):
                sharding = NamedSharding(self.mesh, spec)
                # The input's own sharding object where it is the same layout (the next
                # step's programs then see the shardings they were traced with).
                return target if target.is_equivalent_to(sharding, np.ndim(x)) else sharding

            out_shardings = jax.tree.map(
                out_sharding, outs, targets, tuple(trees[: self.outputs]), is_leaf=_is_spec
            )
            self._programs[key], fallback = _group_program(
                self.fn, self.groups[0], self.mesh, trees, local_specs, outs, out_shardings
            )
            self.fallback = self.fallback or fallback
        return self._programs[key](*trees)

    def _resharded(self, out: Any, targets: Any) -> Any:
        """Each output with its input's sharding (a slice, exact); those already so as they are."""
        leaves, treedef = jax.tree.flatten(out)
        targets = jax.tree.leaves(targets, is_leaf=_is_sharding)
        todo = [
            i
            for i, (x, t) in enumerate(zip(leaves, targets, strict=True))
            if not x.sharding.is_equivalent_to(t, x.ndim)
        ]
        if todo:
            key = ("reshard", tuple(targets[i] for i in todo))
            if key not in self._gathers:
                self._gathers[key] = jax.jit(lambda xs: xs, out_shardings=list(key[1]))
            for i, x in zip(todo, self._gathers[key]([leaves[i] for i in todo]), strict=True):
                leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _is_sharding(x: Any) -> bool:
    return isinstance(x, jax.sharding.Sharding)


class FixedOrderFallback(UserWarning):
    """A grouped update whose sums across an FSDP group are left to XLA (see its message)."""


def _group_program(
    fn, gmesh, mesh, args, in_specs, out_specs, out_shardings
) -> tuple[Callable, Any]:
    """The groups' update program over ``mesh`` and why it falls back (None where it does
    not): manual, each group (``gmesh``'s axes) on its shards with its float sums across the
    group in unsplit's order (:mod:`~unsplit._src.bitwise.fsdp.fixed_order_update`), or XLA's
    SPMD program where the update holds an equation that rewrite does not run on split
    dimensions (warned)."""
    if not group_reduce.fixed_order():  # the benchmarks' measuring switch
        return jax.jit(fn, out_shardings=out_shardings), None
    try:
        program = fixed_order_update.program(
            fn, gmesh, args, in_specs, out_specs, mesh=mesh, out_shardings=out_shardings
        )
        return program, None
    except fixed_order_update.BlockError as e:
        warnings.warn(
            f"bitwise: in the optimizer update, {e} It runs as XLA partitions it: its sums "
            "across the group's devices are XLA's.",
            FixedOrderFallback,
            stacklevel=4,
        )
        return jax.jit(fn, out_shardings=out_shardings), str(e)
    except fixed_order_update.Unsupported as e:
        warnings.warn(
            f"bitwise: the optimizer update has {e}, which unsplit does not run in a fixed "
            "order across an FSDP group; this update's sums across the group's devices are "
            "XLA's (their bits may differ between a plain process, jax.distributed and a group "
            "spread over hosts). Fix: keep that computation off the sharded dimensions (e.g. "
            "replicate that leaf), or accept it.",
            FixedOrderFallback,
            stacklevel=4,
        )
        return jax.jit(fn, out_shardings=out_shardings), str(e)
