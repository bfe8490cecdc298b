"""A batch mesh over the same number of devices in every process."""

from __future__ import annotations

import jax


def mesh_over(devices_per_process: int, axis_name: str = "data") -> jax.sharding.Mesh:
    """A 1-D mesh over the first ``devices_per_process`` devices of every process (Auto axis).

    For runs that use fewer devices than each host has: the same topology on
    one machine or many, e.g. 2 processes x 2 devices.

    Args:
        devices_per_process: devices each process contributes, its first ones.
        axis_name: the mesh axis (the batch axis of the step).

    Raises:
        RuntimeError: a process has fewer devices than asked for, naming the fix.

    Example:
        >>> import unsplit
        >>> mesh = unsplit.mesh_over(2)
        >>> dict(mesh.shape)
        {'data': 2}
    """
    chosen = []
    for p in range(jax.process_count()):
        mine = [d for d in jax.devices() if d.process_index == p]
        if len(mine) < devices_per_process:
            raise RuntimeError(
                f"process {p} has {len(mine)} devices; the run asked for {devices_per_process} "
                "per process. Fix: fewer devices, or on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={devices_per_process} "
                "before jax starts."
            )
        chosen += mine[:devices_per_process]
    return jax.make_mesh(
        (len(chosen),), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,), devices=chosen
    )
