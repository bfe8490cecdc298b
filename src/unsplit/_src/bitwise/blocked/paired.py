"""A model-parallel layout of degree 1 computed at degree 2, so its bits are every degree's.

XLA compiles a one-device program differently from a multi-device one: the same
canonical-block chunk program gave other bits on one device than on 2, 4 or 8
(which agree with each other; measured on CPU, the test transformer's Megatron
layout), because the two pipelines simplify the same ops differently. So a step
whose params name model axes that all have one device (``model=1`` on the mesh,
a replay of a tensor-parallel run on one host) runs on a copy of its mesh whose
first such axis has two devices, taken from the batch axes (or, for a one-device
mesh, the process's next device): its params, batch and key are moved there
(exact), the step runs at degree 2, and the loss, grads and aux come back with
the shardings they would have had (exact). The bits are then those of every
degree that divides the canonical blocks.

Without a second device (a process with one device) the step runs at degree 1,
with a warning that its bits may differ from the other degrees'.

Example:
    >>> import jax
    >>> from unsplit._src.bitwise.blocked import paired
    >>> mesh = jax.make_mesh((8, 1), ("data", "model"))
    >>> dict(paired.paired_mesh(mesh, ("data",), "model").shape)
    {'data': 4, 'model': 2}
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import links


def paired_mesh(mesh: Mesh, batch_axes: tuple[str, ...], axis: str) -> Mesh | None:
    """``mesh`` with ``axis`` (of size 1) made of two devices: the first batch axis of even
    size gives them (its size halves), else the process's next unused device for a
    one-device mesh. ``None`` when neither is possible."""
    shape = dict(mesh.shape)
    names = list(mesh.axis_names)
    grid = np.asarray(mesh.devices)
    source = next((b for b in batch_axes if shape[b] % 2 == 0), None)
    if source is not None:
        b, a = names.index(source), names.index(axis)
        split = grid.reshape(*grid.shape[:b], shape[source] // 2, 2, *grid.shape[b + 1 :])
        moved = np.moveaxis(split, b + 1, a + (1 if a > b else 0))
        devices = moved.reshape(
            [shape[n] // 2 if n == source else 2 if n == axis else shape[n] for n in names]
        )
    elif grid.size == 1:
        spare = [d for d in jax.local_devices() if d != grid.flat[0]]
        if not spare:
            return None
        devices = np.array([grid.flat[0], spare[0]]).reshape([2 if n == axis else 1 for n in names])
    else:
        return None
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


class Paired:
    """A plan's runner at degree 2: the inputs moved to the paired mesh and the outputs back.

    ``inner`` is a bitwise step on the paired mesh; ``plan`` the degree-1 plan (its
    shardings are the outputs').
    """

    def __init__(self, inner: Any, outer_mesh: Mesh, single: bool, given: tuple, diff: tuple):
        self.inner = inner
        mesh = inner.layout.required_mesh()
        self.batch = NamedSharding(mesh, P(inner.layout.batch_entry))
        self.mesh = mesh
        if single:
            device = outer_mesh.devices.flat[0]
            self.back = jax.sharding.make_single_device_sharding(device)
            self.grads_back = [self.back] * sum(diff)
            self.rows_back = self.back
        else:
            self.back = NamedSharding(outer_mesh, P())
            specs = [s for s, d in zip(given, diff, strict=True) if d]
            self.grads_back = [NamedSharding(outer_mesh, s) for s in specs]
            self.rows_back = NamedSharding(outer_mesh, P(inner.layout.batch_entry))

    def moved(self, params, batch) -> tuple[Any, Any]:
        """The params and the batch on the paired mesh (exact: device_put)."""
        params = jax.tree.map(self._moved, params)
        return params, jax.device_put(batch, self.batch)

    def run(self, params, batch, key, ids):
        params, batch = self.moved(params, batch)
        state, params = self.inner.prepare(params, batch, key)
        loss, grads, aux, weight = state.run(params, batch, key, ids)
        leaves, tree = jax.tree.flatten(grads)
        back = [jax.device_put(g, s) for g, s in zip(leaves, self.grads_back, strict=True)]
        aux = None if aux is None else jax.device_put(aux, self.rows_back)
        loss, weight = jax.device_put((loss, weight), self.back)
        return loss, jax.tree.unflatten(tree, back), aux, weight

    def _moved(self, x: Any) -> Any:
        """A params leaf on the paired mesh with its spec (a host value: replicated)."""
        if not isinstance(x, jax.Array | np.ndarray):
            return x  # a static leaf
        sharding = getattr(x, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
        return jax.device_put(x, NamedSharding(self.mesh, spec))


def warn_unpaired(axes: tuple[str, ...], warned: set, region: bool = False) -> None:
    """Once per step: a degree-1 layout that could not be paired (one device, or a loss whose
    own ``shard_map`` is declared on the user's mesh)."""
    if "unpaired" in warned:
        return
    warned.add("unpaired")
    if region:
        warnings.warn(
            f"bitwise mode: the loss's own shard_map runs over {axes}, all of one device: this "
            "step runs at degree 1, and its bits may differ from the same step at degrees 2, "
            "4 and 8 (XLA compiles a one-device program differently; a region declared on "
            "your mesh cannot move to a paired mesh). Fix: a sequence axis of 2 or more "
            f"devices to compare degrees. See {links.doc_ref('bitwise')}.",
            stacklevel=5,
        )
        return
    warnings.warn(
        f"bitwise mode: the params are sharded over model axes {axes} of one device each, and "
        "no second device is there to compute them at degree 2: this step's bits may differ "
        "from the same step at model-parallel degrees 2, 4 and 8 (XLA compiles a one-device "
        "program differently). Fix: give the process a second device (on CPU: "
        "XLA_FLAGS=--xla_force_host_platform_device_count=2) and a mesh whose batch axis has "
        f"an even size, or a model axis of 2 or more devices. See {links.doc_ref('bitwise')}.",
        stacklevel=5,
    )
