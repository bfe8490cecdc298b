"""Global arrays moved between meshes of the same devices, and across processes.

Bitwise mode runs its programs on several meshes built from the user's: the
*compute mesh* (outer batch axes, then group axes, whatever order the user's
mesh has them in) and one mesh per group. An array that holds, on every device,
the block it would hold on another mesh needs no copy, only a new name:
:func:`rename` puts the same buffers together as a global array of that other
sharding. This works in every process (each names only its addressable
shards), where ``jax.device_put`` between two meshes of the same devices in
another order would run a program (and across processes may not run at all).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import partition
from unsplit._src.bitwise import relocate


def rename(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` as a global array of ``sharding``, each device keeping its buffer.

    Every device of ``sharding`` must hold the block ``sharding`` gives it
    (checked: otherwise the array is copied with ``jax.device_put``, which
    needs ``x`` fully addressable).

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> d = jax.devices()[:4]
        >>> a = Mesh(np.array(d).reshape(2, 2), ("x", "y"))
        >>> b = Mesh(np.array(d).reshape(2, 2).T, ("y", "x"))  # the same devices, transposed
        >>> x = jax.device_put(np.arange(4.0), NamedSharding(a, P("y")))
        >>> rename(x, NamedSharding(b, P("y"))).sharding.mesh.axis_names
        ('y', 'x')
    """
    if x.sharding == sharding:
        return x
    shape = np.shape(x)
    # A NamedSharding gives every device an index (the stubs allow None).
    want = cast(Mapping[Any, tuple], sharding.addressable_devices_indices_map(shape))
    have = {s.device: s for s in x.addressable_shards}
    if set(want) <= set(have) and all(_same(have[d].index, want[d], shape) for d in want):
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [have[d].data for d in want]
        )
    return jax.device_put(x, sharding)


def rename_tree(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """:func:`rename` on every leaf."""
    return jax.tree.map(lambda x: rename(x, sharding), tree)


def _same(a: tuple, b: tuple, shape: tuple) -> bool:
    """Whether two index tuples (of slices) select the same block of ``shape``."""
    return all(x.indices(n) == y.indices(n) for x, y, n in zip(a, b, shape, strict=True)) and len(
        a
    ) == len(b)


def addressable(devices: Any) -> list:
    """Those of ``devices`` (any iterable, e.g. a group's grid) this process drives, in order."""
    me = jax.process_index()
    return [d for d in np.asarray(devices, dtype=object).flat if d.process_index == me]


def spans_processes(devices: Any) -> bool:
    """Whether ``devices`` belong to more than one process (a group spread over hosts)."""
    return len({d.process_index for d in np.asarray(devices, dtype=object).flat}) > 1


def replicate(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` (a value every process holds the same) whole on every device of ``sharding``.

    ``jax.device_put`` of a one-device array onto devices of other processes is
    refused, as is a copy of an array over every process's devices (a key made
    under the user's ``jax.set_mesh``) onto a group of this process's devices;
    each process instead copies its own value to its own devices.
    """
    if isinstance(x, jax.Array) and not (x.is_fully_addressable and sharding.is_fully_addressable):
        x = x.addressable_data(0)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    # In the sharding's device order: key arrays are not rearranged by device.
    copies = [jax.device_put(x, d) for d in sharding.addressable_devices_indices_map(np.shape(x))]
    return jax.make_array_from_single_device_arrays(np.shape(x), sharding, copies)


def gathered(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """``tree`` (arrays on ``mesh``'s devices) whole on every device of ``mesh`` (exact)."""
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return _identity(whole)(tree)


def from_local_copy(tree: Any, sharding: jax.sharding.NamedSharding) -> Any:
    """``tree`` (whole on a device of this process, the same value in every process) placed
    with ``sharding``: copied whole to this process's devices of it, then sliced there."""
    whole = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    copies = jax.tree.map(lambda x: replicate(x.addressable_data(0), whole), tree)
    return _identity(sharding)(copies)


_IDENTITIES: dict = {}


def _identity(sharding: jax.sharding.Sharding):
    """A jitted identity whose outputs have ``sharding`` (a gather or a slice: exact)."""
    if sharding not in _IDENTITIES:
        _IDENTITIES[sharding] = jax.jit(lambda t: t, out_shardings=sharding)
    return _IDENTITIES[sharding]


def everywhere(x, sharding):
    """``x`` (one device, the same value in every process) as a replicated global array."""
    if not isinstance(sharding, NamedSharding):
        return jax.device_put(x, sharding)
    copies = [jax.device_put(x, d) for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(np.shape(x), sharding, copies)


def shards_by_device(x: Any) -> dict:
    """``x``'s addressable shards by device (``{}`` for a host array)."""
    if not isinstance(x, jax.Array):
        return {}
    return {s.device: s for s in x.addressable_shards}


class Placer:
    """Puts a group's inputs on its devices: its rows of the batch, the whole key, its params."""

    def __init__(self, gmesh: Mesh, devices: list, start: int, rows: int, chunk_axes=()):
        self.gmesh, self.start, self.rows_n = gmesh, start, rows
        # A group may span processes (an FSDP group of 64 over 8 hosts): each process puts
        # only its own devices' pieces; ``size`` counts every device of the group.
        self.size = len(devices)
        self.devices = addressable(devices)
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
        sharding = NamedSharding(self.gmesh, P(partition.entry(axes)))
        length = shards[0].shape[0] * self.size
        return jax.make_array_from_single_device_arrays((length,), sharding, shards)

    def rows(self, x, shards: dict | None = None):
        """The group's rows of ``x`` on its devices (``shards``: ``x``'s
        :func:`shards_by_device`, when the caller looked them up once for every group)."""
        stop = self.start + self.rows_n
        if isinstance(x, jax.Array):
            found = {}
            shards = shards if shards is not None else shards_by_device(x)
            for s in (shards[d] for d in self.devices if d in shards):
                lo = s.index[0].start or 0
                if lo == self.starts[s.device] and s.data.shape[0] == self.piece:
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
        return replicate(x, self.replicated)

    def held(self, x: jax.Array, spec: P) -> jax.Array:
        """``x``, whose every device already holds the block ``spec`` gives it on the group's
        mesh (a replicated frozen base), as the group's array: its buffers, no copy. A host
        value (NumPy) is copied to the group's devices whole."""
        if not isinstance(x, jax.Array):
            return self.whole(x)
        if self.size == 1:
            return self.one_device(shards_by_device(x)[self.devices[0]].data)
        return rename(x, NamedSharding(self.gmesh, spec))


class Held:
    """Each group's frozen inputs (``plan.params_flat.direct``) as the chunk programs take them,
    never copied into the flat params.

    A leaf every device holds as its group computes with it (replicated, or sharded over
    group axes only) is taken as it is: the caller's buffers, no copy (:meth:`Placer.held`).
    One sharded over outer batch axes is gathered over them first, in one exact program,
    as default mode's program gathers it. Both are looked up again only when other arrays
    come (compared by identity; with several processes the gather runs on every call, so
    every process runs the same collectives). ``placer(g)``: group ``g``'s :class:`Placer`.
    """

    def __init__(self, placer, groups: list[int], plan: Any):
        self.placer, self.groups = placer, groups
        flat = plan.params_flat
        direct = iter(flat.direct)
        self.mask = [m and next(direct) for m in plan.structure.array_mask]  # per params leaf
        self.specs = flat.directs(plan.local_specs)
        # The leaves to gather: sharded over an outer batch axis (their spec on the user's
        # mesh is not their spec in the group), gathered to their group's spec.
        self.gather = [
            partition.spec_axes(s) != partition.spec_axes(ls)
            for s, ls in zip(flat.directs(plan.specs), self.specs, strict=True)
        ]
        mesh = plan.layout.required_mesh()
        targets = [
            NamedSharding(mesh, s) for s, g in zip(self.specs, self.gather, strict=True) if g
        ]
        self._gathered = jax.jit(lambda xs: xs, out_shardings=targets) if targets else None
        self._leaves: list = []  # the arrays looked up last (compared by identity)
        self._held: dict[int, list] = {g: [] for g in groups}

    def __call__(self, params: Any) -> dict[int, list]:
        leaves = [x for x, m in zip(jax.tree.leaves(params), self.mask, strict=True) if m]
        same = len(leaves) == len(self._leaves) and all(
            a is b for a, b in zip(leaves, self._leaves, strict=True)
        )
        if same and (self._gathered is None or jax.process_count() == 1):
            return self._held
        self._leaves = leaves
        if self._gathered is not None:
            gathered = iter(
                self._gathered([x for x, g in zip(leaves, self.gather, strict=True) if g])
            )
            leaves = [next(gathered) if g else x for x, g in zip(leaves, self.gather, strict=True)]
        self._held = {
            g: [self.placer(g).held(x, s) for x, s in zip(leaves, self.specs, strict=True)]
            for g in self.groups
        }
        return self._held


def gathered_blocks(blocks: list, gathers: list, sizes: dict) -> list:
    """Inside ``shard_map``: each block gathered over its batch axes, with **one** all-gather.

    ``gathers[i]``: block ``i``'s gather axes per dimension (a tuple of axis names per
    dimension; empty: kept as it is); ``sizes``: each mesh axis's size. The result is
    what ``jax.lax.all_gather(x, axes, axis=dim, tiled=True)`` per dimension gives
    (exact data movement), but the blocks travel in one collective: on CPU a step's
    pack program with one all-gather per FSDP leaf (30 on the test transformer) cost
    about 3 ms more than with none, most of it in the collectives' rendezvous.
    """
    todo = [i for i, g in enumerate(gathers) if any(g)]
    if not todo:
        return list(blocks)
    used = {a for i in todo for dim in gathers[i] for a in dim}
    axes = tuple(a for a in sizes if a in used)  # in the mesh's order
    flat = jnp.concatenate([jnp.ravel(blocks[i]) for i in todo])
    everyone = jax.lax.all_gather(flat, partition.entry(axes), tiled=False)
    everyone = everyone.reshape(*(sizes[a] for a in axes), -1)  # one row per device
    out, offset = list(blocks), 0
    for i in todo:
        x = blocks[i]
        n = x.size
        part = everyone[..., offset : offset + n].reshape(*everyone.shape[:-1], *x.shape)
        offset += n
        mine = {a for dim in gathers[i] for a in dim}
        for a in reversed([a for a in axes if a not in mine]):  # this device's copy there
            k = axes.index(a)
            part = jax.lax.dynamic_index_in_dim(part, jax.lax.axis_index(a), k, keepdims=False)
        kept = [a for a in axes if a in mine]
        order = []  # each dimension preceded by its gather axes, major first
        for dim, names in enumerate(gathers[i]):
            order += [kept.index(a) for a in names] + [len(kept) + dim]
        shape = [x.shape[d] * math.prod(sizes[a] for a in g) for d, g in enumerate(gathers[i])]
        out[i] = part.transpose(order).reshape(shape)
    return out


def output_shardings(plan: Any, mesh: Mesh, single: bool) -> tuple[list, Any]:
    """The grads' shardings (the params' as given) and the loss's, on the user's mesh (one
    device's for a step without a mesh)."""
    if single:
        device = jax.sharding.make_single_device_sharding(mesh.devices.flat[0])
        return [device] * sum(plan.structure.diff), device
    specs = [s for s, d in zip(plan.given, plan.structure.diff, strict=True) if d]
    return [NamedSharding(mesh, s) for s in specs], NamedSharding(mesh, P())


class GroupInputs:
    """A plan's per-call placement of each local group's inputs on its devices: the flat
    params (and held frozen leaves), the rows with their ids' words, the key."""

    def __init__(self, plan: Any, local_groups: list[int]):
        self.plan = plan
        self.local_groups = local_groups
        self._placers: dict[int, Placer] = {}
        # Frozen leaves each device holds as its group computes with them: not packed.
        self.held = Held(self.placer, local_groups, plan)
        self._default_words: dict | None = None
        # One device: the key on it alone (on a one-device Explicit mesh: another program).
        one = plan.compute.devices.flat[0] if plan.compute.devices.size == 1 else None
        whole = NamedSharding(plan.compute, P())
        self.key_sharding = whole if one is None else jax.sharding.make_single_device_sharding(one)

    def __call__(self, vectors, params, batch, ids, key, executables) -> dict:
        """Each local group's (params vectors, rows (rows, hi, lo), key) on its devices
        (``vectors``: the pack program's output; ``executables``: the groups' chunk programs).

        Host work per call is kept to a few calls per group (measured on a loaded 2-core
        CPU, where it competes with the chunk programs for the cores): the key is copied to
        every device at once, the ids' words of ``ids=None`` are placed once per plan, each
        batch leaf's shards are looked up once.
        """
        by_device = [{s.device: s.data for s in v.addressable_shards} for v in vectors]
        held = self.held(params)
        words = self._words(ids)
        keys = self._keys(key, executables)
        leaves, tree = jax.tree.flatten(batch)
        shards = [shards_by_device(x) for x in leaves]
        inputs = {}
        for g in self.local_groups:
            place = self.placer(g)
            group_vectors = [place.flat(v, by_device[i]) for i, v in enumerate(vectors)] + held[g]
            group_batch = [place.rows(x, s) for x, s in zip(leaves, shards, strict=True)]
            group_rows = (jax.tree.unflatten(tree, group_batch), *words[g])
            inputs[g] = (group_vectors, group_rows, keys[g])
        return inputs

    def placer(self, g: int) -> Placer:
        """Group ``g``'s :class:`~.placement.Placer` (a function of the plan: built once)."""
        if g not in self._placers:
            plan = self.plan
            rows = plan.per_group * plan.chunk
            devices = list(plan.group_devices(g).flat)
            self._placers[g] = Placer(plan.group_mesh(g), devices, g * rows, rows, plan.chunk_axes)
        return self._placers[g]

    def _words(self, ids) -> dict:
        """Each local group's rows of the ids' (hi, lo) words, on its devices; those of
        ``ids=None`` (the row indices) are the same every call: placed once."""
        if ids is None and self._default_words is not None:
            return self._default_words
        hi, lo = keys_lib.step_words(ids, self.plan.chunks * self.plan.chunk, on_host=True)
        words = {g: (self.placer(g).rows(hi), self.placer(g).rows(lo)) for g in self.local_groups}
        if ids is None:
            self._default_words = words
        return words

    def _keys(self, key, executables) -> dict:
        """The key whole on each local group's devices: copied to every device in one call
        (a typed key as its data, wrapped again per device: no program runs)."""
        typed = keys_lib.is_typed_key(key)
        data = jax.random.key_data(key) if typed else key
        if not all(self.placer(g).size == 1 for g in self.local_groups):
            return {g: self.placer(g).whole(key) for g in self.local_groups}
        whole = replicate(data, self.key_sharding)
        here = shards_by_device(whole)
        impl = jax.random.key_impl(key) if typed else None
        out = {}
        for g in self.local_groups:
            x = here[self.placer(g).devices[0]].data
            # A loaded program takes the key's data as it is: wrapping it here only for
            # the program to unwrap it again cost two dispatched ops per group.
            wrap = typed and not isinstance(executables.get(g), relocate.Relocated)
            out[g] = jax.random.wrap_key_data(x, impl=impl) if wrap else x
        return out
