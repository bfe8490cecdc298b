"""Many processes: each process's local rows as one global batch, with their global ids.

In a multi-process program every process loads its own rows. ``global_batch``
assembles them into global ``jax.Array``\\ s sharded over the batch axes of the
mesh (``jax.make_array_from_process_local_data``) and returns the global ids
that go with them, so the step sees one global batch whatever the topology.

Before building anything, the processes agree (:mod:`unsplit._src.processes.agreement`)
on their local row counts, leaf shapes and dtypes and ids: rows of different
counts on different processes would otherwise give each process a different
"global" batch, and silently different results.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src.processes import agreement

_CHECKS = ("first", "always", "never")
_calls = 0  # global_batch calls in this process: "first" agrees on call 0 only

_FIXES = {
    "local rows": "every process must pass the same number of rows (global batch / number "
    "of processes); drop or pad the last, smaller batch on every process alike",
    "leaves": "every process must pass the same pytree of arrays",
    "shapes and dtypes": "every process's rows must have the same shape after the leading "
    "(row) axis and the same dtype, e.g. pad sequences to one length on every process",
    "ids": "pass local_ids on every process or on none, with the same dtype",
    "mesh": "every process must pass the same mesh, e.g. jax.make_mesh((jax.device_count(),), "
    "('data',)) on every process",
}


def global_batch(
    local_batch: Any,
    mesh: jax.sharding.Mesh,
    local_ids: Any = None,
    *,
    batch_axes: str | tuple[str, ...] | None = None,
    check: str = "first",
) -> tuple[Any, jax.Array | keys_lib.Ids64]:
    """Turns this process's rows into the global batch and its global ids.

    Args:
        local_batch: pytree of host arrays whose leading axis is this process's
            rows (the same count in every process).
        mesh: the step's mesh.
        local_ids: optional record ids of the local rows (shape ``(rows,)``).
            By default a row's id is its position in the global batch, the
            same id a single process would give it.
        batch_axes: the mesh axis name (or tuple of names) the batch is split
            over; default: the mesh's first axis.
        check: when the processes agree on their row counts, shapes, dtypes
            and ids (one small collective, and a host sync): ``"first"`` (this
            process's first call; later calls cost nothing), ``"always"`` (every
            call) or ``"never"``. Every process must pass the same value.

    Returns:
        ``(batch, ids)``: global ``jax.Array``\\ s sharded over the batch axes.
        ``ids`` is an :class:`Ids64` (two ``uint32`` words) when ``local_ids``
        has a 64-bit dtype (NumPy ``int64``/``uint64``, or a Python list), so
        ids ``>= 2**31`` pass through a jitted train step exactly; otherwise a
        ``uint32`` array. Pass both to the step: ``step(params, batch, key, ids=ids)``.

    Raises:
        ValueError: on every process at once when a process's rows are bad
            (leaves of different row counts, rows not divisible by its devices
            on the batch axes, nested Python lists) or the processes disagree.

    Example:
        >>> import jax, numpy as np, unsplit
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> rows = {"x": np.ones((8, 3), np.float32)}
        >>> batch, ids = unsplit.global_batch(rows, mesh)
        >>> batch["x"].shape, ids.tolist()
        ((8, 3), [0, 1, 2, 3, 4, 5, 6, 7])
    """
    global _calls
    if check not in _CHECKS:
        raise ValueError(
            f"check must be one of {_CHECKS}; got {check=!r}. Fix: check='first' (the default)."
        )
    agree_now = check == "always" or (check == "first" and _calls == 0)
    _calls += 1
    if agree_now:
        with agreement.agreeing("unsplit.global_batch", fixes=_FIXES) as items:
            axes, rows, blocks_here, blocks_total, local_ids = _prepare(
                local_batch, mesh, local_ids, batch_axes, items
            )
    else:
        axes, rows, blocks_here, blocks_total, local_ids = _prepare(
            local_batch, mesh, local_ids, batch_axes, None
        )
    sharding = NamedSharding(mesh, P(axes[0] if len(axes) == 1 else axes))
    global_rows = rows // blocks_here * blocks_total
    batch = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x), (global_rows, *np.shape(x)[1:])
        ),
        local_batch,
    )
    if local_ids is None:
        ids = local_positions(sharding, global_rows)
    elif local_ids.dtype.itemsize == 8:  # 64-bit record ids: both words, exactly
        split = keys_lib.ids64(local_ids)
        words = [
            jax.make_array_from_process_local_data(sharding, np.asarray(w), (global_rows,))
            for w in (split.hi, split.lo)
        ]
        return batch, keys_lib.Ids64(hi=words[0], lo=words[1])
    else:
        ids = local_ids.astype(np.uint32)
    return batch, jax.make_array_from_process_local_data(sharding, ids, (global_rows,))


def _prepare(local_batch, mesh, local_ids, batch_axes, items: dict[str, Any] | None):
    """This process's local checks; fills ``items`` (what the processes must agree on)."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}. "
            "Fix: mesh = jax.make_mesh((jax.device_count(),), ('data',))."
        )
    axes = _batch_axes(mesh, batch_axes)
    leaves, rows = _local_rows(local_batch)
    blocks_here, blocks_total = _blocks(mesh, axes)
    if rows % blocks_here:
        raise ValueError(
            f"this process has {rows=}, not divisible by its {blocks_here} devices along the "
            f"batch axes {axes} of the mesh: each device must get the same number of rows. "
            f"Fix: pass a multiple of {blocks_here} rows on every process "
            f"(e.g. {max(blocks_here, rows - rows % blocks_here)})."
        )
    if local_ids is not None:
        local_ids = _checked_ids(local_ids, rows)
    if items is not None:
        items["mesh"] = mesh
        items["local rows"] = rows
        items["leaves"] = [path for path, _ in leaves]
        items["shapes and dtypes"] = {
            path: f"{np.asarray(x).dtype}{list(np.shape(x)[1:])}" for path, x in leaves
        }
        items["ids"] = None if local_ids is None else f"local_ids of dtype {local_ids.dtype}"
    return axes, rows, blocks_here, blocks_total, local_ids


def _batch_axes(mesh: jax.sharding.Mesh, batch_axes: Any) -> tuple[str, ...]:
    if batch_axes is None:
        return (mesh.axis_names[0],)
    axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if not axes or unknown:
        raise ValueError(
            f"batch_axes must name axes of the mesh {tuple(mesh.axis_names)}; got "
            f"{batch_axes=!r}. Fix: pass one of {tuple(mesh.axis_names)}, or None for the first."
        )
    return axes


def _local_rows(local_batch: Any) -> tuple[list[tuple[str, Any]], int]:
    """(path, leaf) pairs and the common row count, with a clear error for each bad case."""
    flat, _ = jax.tree_util.tree_flatten_with_path(local_batch)
    if not flat:
        raise ValueError(
            f"local_batch has no array leaves; got {local_batch!r}. Fix: pass a pytree of "
            "host arrays whose leading axis is this process's rows, e.g. {'x': np.ones((8, 3))}."
        )
    leaves = [(jax.tree_util.keystr(path) or "local_batch", x) for path, x in flat]
    for path, x in leaves:
        if isinstance(x, numbers.Number | str) or np.ndim(x) == 0:
            raise TypeError(
                f"local_batch leaf {path} is a scalar ({type(x).__name__}); every leaf needs "
                "the rows as its leading axis. A nested Python list is a pytree to JAX, so "
                "each of its numbers becomes a separate scalar leaf. Fix: convert it to an "
                "array, e.g. np.asarray(rows), or give the leaf a leading row axis."
            )
    counts = {path: int(np.shape(x)[0]) for path, x in leaves}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{path}: {n}" for path, n in counts.items())
        raise ValueError(
            f"local_batch leaves have different row counts ({detail}); every leaf's leading "
            "axis is this process's rows. Fix: give every leaf the same number of rows, or "
            "close over shared (non-per-row) arrays in loss_fn."
        )
    return leaves, next(iter(counts.values()))


def _blocks(mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> tuple[int, int]:
    """(batch blocks this process's devices hold, batch blocks in all): positions on ``axes``."""
    names = list(mesh.axis_names)
    order = [names.index(a) for a in axes] + [i for i in range(len(names)) if names[i] not in axes]
    devices = np.transpose(mesh.devices, order)
    total = int(np.prod([mesh.shape[a] for a in axes]))
    devices = devices.reshape(total, -1)
    me = jax.process_index()
    here = sum(any(d.process_index == me for d in row) for row in devices)
    return max(here, 1), total


def _checked_ids(local_ids: Any, rows: int) -> np.ndarray:
    ids = np.asarray(local_ids)
    if ids.shape != (rows,):
        raise ValueError(
            f"local_ids must have shape ({rows},), one id per local row; got shape "
            f"{ids.shape}. Fix: pass the record ids of this process's rows."
        )
    keys_lib.id_words(ids)  # validates dtype and range (exactly, on the host)
    return ids


def local_positions(sharding: NamedSharding, global_rows: int) -> np.ndarray:
    """Global row positions of this process's rows, in the order they are laid out."""
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    slices = [s[0] for s in index_map.values() if s is not None]  # None: the whole array
    starts = sorted({(s.start or 0, s.stop or global_rows) for s in slices})
    return np.concatenate([np.arange(a, b, dtype=np.uint32) for a, b in starts])
