"""Many processes: each process's local rows as one global batch, with their global ids.

In a multi-process program every process loads its own rows. ``global_batch``
assembles them into global ``jax.Array``\\ s sharded over the mesh's first axis
(``jax.make_array_from_process_local_data``) and returns the global ids that
go with them, so the step sees one global batch whatever the topology.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib


def global_batch(local_batch: Any, mesh: jax.sharding.Mesh, local_ids: Any = None):
    """Turns this process's rows into the global batch and its global ids.

    Args:
        local_batch: pytree of host arrays whose leading axis is this process's
            rows (the same count in every process).
        mesh: the step's mesh; the batch is split over its first axis.
        local_ids: optional record ids of the local rows (shape ``(rows,)``).
            By default a row's id is its position in the global batch, the
            same id a single process would give it.

    Returns:
        ``(batch, ids)``: global ``jax.Array``\\ s sharded over the mesh's first
        axis (``ids`` is an :class:`Ids64` of two such arrays when a record id
        exceeds ``2**32 - 1``). Pass both to the step:
        ``step(params, batch, key, ids=ids)``.

    Example:
        >>> import jax, numpy as np, unsplit
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> rows = {"x": np.ones((8, 3), np.float32)}
        >>> batch, ids = unsplit.global_batch(rows, mesh)
        >>> batch["x"].shape, ids.tolist()
        ((8, 3), [0, 1, 2, 3, 4, 5, 6, 7])
    """
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    leaves = jax.tree.leaves(local_batch)
    if not leaves:
        raise ValueError("local_batch has no array leaves. Fix: pass a pytree of host arrays.")
    rows = int(np.shape(leaves[0])[0])
    global_rows = rows * jax.process_count()
    batch = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x), (global_rows, *np.shape(x)[1:])
        ),
        local_batch,
    )
    if local_ids is None:
        local_ids = local_positions(sharding, global_rows)
    else:
        local_ids = np.asarray(local_ids)
        if local_ids.shape != (rows,):
            raise ValueError(
                f"local_ids must have shape ({rows},), one id per local row; got shape "
                f"{local_ids.shape}. Fix: pass the record ids of this process's rows."
            )
        hi, lo = keys_lib.id_words(local_ids)  # validates dtype and range
        hi, lo = np.asarray(hi), np.asarray(lo)
        if hi.any():  # 64-bit record ids: keep both words, exactly
            words = [
                jax.make_array_from_process_local_data(sharding, w, (global_rows,))
                for w in (hi, lo)
            ]
            return batch, keys_lib.Ids64(hi=words[0], lo=words[1])
        local_ids = lo
    ids = jax.make_array_from_process_local_data(
        sharding, local_ids.astype(np.uint32), (global_rows,)
    )
    return batch, ids


def local_positions(sharding: NamedSharding, global_rows: int) -> np.ndarray:
    """Global row positions of this process's rows, in the order they are laid out."""
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    starts = sorted({(s[0].start or 0, s[0].stop or global_rows) for s in index_map.values()})
    return np.concatenate([np.arange(a, b, dtype=np.uint32) for a, b in starts])


def check_same_key(key: jax.Array) -> None:
    """In a multi-process run, raises unless every process passed the same key.

    A step key that differs between processes (a seed or step counter that is
    not shared) would silently train on inconsistent noise.
    """
    if jax.process_count() == 1:
        return
    data = np.asarray(jax.random.key_data(key) if keys_lib.is_typed_key(key) else key)
    everyone = np.asarray(multihost_utils.process_allgather(data))
    if not (everyone == everyone[0]).all():
        differing = [p for p in range(everyone.shape[0]) if not (everyone[p] == everyone[0]).all()]
        raise ValueError(
            f"processes disagree on the step key: process 0 has key data {everyone[0].tolist()}, "
            f"process(es) {differing} have {[everyone[p].tolist() for p in differing]}. Every "
            "process must pass the same step key, or the noise is inconsistent across hosts. "
            "Fix: derive it from a shared seed and the shared step number, e.g. "
            "jax.random.fold_in(jax.random.key(seed), step), on every process."
        )
