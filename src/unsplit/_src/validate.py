"""Input checks for the step: each error says what was expected, what arrived, and the fix.

All checks here look at shapes, dtypes and Python values only, so they cost no
device work, with two documented exceptions: concrete signed ids are checked
for negative values, and a weighted step checks that the total weight is not 0.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src import keys as keys_lib


def check_callable(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a function loss_fn(params, example, key); got "
            f"{type(loss_fn).__name__}. Fix: pass the one-example loss function itself."
        )


def check_microbatches(microbatches: Any) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, numbers.Integral):
        raise TypeError(
            f"microbatches must be an int >= 1; got {microbatches=!r} of type "
            f"{type(microbatches).__name__}. Fix: pass e.g. microbatches=4."
        )
    if microbatches < 1:
        raise ValueError(
            f"microbatches must be >= 1 (the number of sequential accumulation steps per "
            f"device); got {microbatches=}. Fix: use microbatches=1 for no accumulation."
        )


def check_mesh(mesh: Any) -> None:
    if mesh is None:
        return
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh or None; got {type(mesh).__name__}. "
            "Fix: mesh = jax.make_mesh((jax.device_count(),), ('data',))."
        )
    if not mesh.axis_names:
        raise ValueError(
            "mesh has no axes; the batch is split over the mesh's first axis. "
            "Fix: mesh = jax.make_mesh((jax.device_count(),), ('data',))."
        )


def batch_size(batch: Any) -> int:
    """The global batch size: the common leading size of every leaf."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(batch)
    if not leaves:
        raise ValueError(
            f"batch has no array leaves; got {batch!r}. Fix: pass a pytree of arrays whose "
            "leading axis is the global batch, e.g. {'tokens': tokens}."
        )
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        name = jax.tree_util.keystr(path) or "batch"
        if len(shape) == 0:
            raise ValueError(
                f"batch leaf {name} is a scalar; every leaf needs the global batch as its "
                "leading axis. Fix: give it a leading axis of size B (e.g. jnp.broadcast_to), "
                "or close over it in loss_fn if it is shared by all examples."
            )
        sizes[name] = shape[0]
    distinct = set(sizes.values())
    if len(distinct) != 1:
        detail = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise ValueError(
            f"batch leaves have different leading sizes ({detail}); every leaf must have the "
            "global batch size as its leading axis. Fix: give all leaves the same first "
            "dimension, or close over shared (non-per-example) arrays in loss_fn."
        )
    return distinct.pop()


def check_schedule(batch: int, devices: int, microbatches: int, mesh: Any) -> None:
    if mesh is not None and batch % devices:
        axis = mesh.axis_names[0]
        raise ValueError(
            f"the mesh's first axis {axis!r} has {devices} devices, which does not divide the "
            f"batch size {batch}. Fix: use a global batch that is a multiple of {devices}, or "
            "a mesh whose first axis divides the batch."
        )
    if batch % (devices * microbatches):
        raise ValueError(
            f"batch size {batch} is not divisible by devices x microbatches = {devices} x "
            f"{microbatches} = {devices * microbatches}. Fix: pick microbatches that divide "
            f"the per-device batch {batch // devices}, or pad the global batch (padded "
            "examples with weight 0 under weighted=True)."
        )


def ids_words(ids: Any, batch: int) -> keys_lib.Ids64 | None:
    """The ids as validated uint32 words of shape (B,), or None for arange(B)."""
    if ids is None:
        return None
    shape = tuple(ids.shape) if isinstance(ids, keys_lib.Ids64) else np.shape(ids)
    if shape != (batch,):
        raise ValueError(
            f"ids must have shape (B,) = ({batch},), one global id per example; got shape "
            f"{shape}. Fix: pass ids=None for arange(B), or one integer id per example."
        )
    hi, lo = keys_lib.id_words(ids)
    return keys_lib.Ids64(hi=hi, lo=lo)


def loss_output(out: Any, weighted: bool) -> tuple[jax.Array, jax.Array]:
    """The user's per-example output as (float32 loss_sum, float32 weight)."""
    if weighted:
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise TypeError(
                "with weighted=True, loss_fn must return a pair (loss_sum, weight) for one "
                f"example; got {_describe(out)}. Fix: return e.g. (jnp.sum(token_losses * "
                "mask), jnp.sum(mask)), or use weighted=False for a plain scalar loss."
            )
        loss_sum, weight = out
        loss_sum = _scalar(loss_sum, "loss_sum (the first element of loss_fn's pair)")
        weight = _scalar(weight, "weight (the second element of loss_fn's pair)", floating=False)
        return _float32(loss_sum), jax.lax.stop_gradient(weight.astype(jnp.float32))
    if isinstance(out, tuple | list):
        raise TypeError(
            f"loss_fn returned {_describe(out)}; with weighted=False it must return the scalar "
            "loss of one example. Fix: pass weighted=True if it returns (loss_sum, weight)."
        )
    loss = _scalar(out, "loss_fn's output")
    return _float32(loss), jnp.ones((), jnp.float32)


def check_total_weight(weight: jax.Array) -> None:
    if isinstance(weight, jax.core.Tracer):
        return  # inside the caller's jit: 0 / 0 gives nan, it cannot raise here
    if float(weight) == 0.0:
        raise ValueError(
            "the total weight of the global batch is 0, so the normalized loss "
            "sum(loss_sum) / sum(weight) is undefined. Fix: make sure at least one example "
            "has a positive weight (e.g. a non-empty token mask), or skip this batch."
        )


def _scalar(x: Any, what: str, floating: bool = True) -> jax.Array:
    shape = np.shape(x)
    if shape != ():
        raise ValueError(
            f"{what} must be a scalar for ONE example; got shape {shape}. unsplit vmaps "
            "loss_fn over the batch itself, so loss_fn sees one example without a batch "
            "axis. Fix: reduce inside loss_fn (jnp.mean / jnp.sum), or with token losses "
            "return (jnp.sum(losses), num_tokens) with weighted=True."
        )
    x = jnp.asarray(x)
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{what} must be a floating-point scalar to be differentiated; got "
            f"dtype={x.dtype}. Fix: compute the loss in float32 (e.g. x.astype(jnp.float32))."
        )
    if not floating and not (jnp.issubdtype(x.dtype, jnp.number)):
        raise TypeError(f"{what} must be a number; got dtype={x.dtype}.")
    return x


def _float32(x: jax.Array) -> jax.Array:
    narrow = x.dtype.itemsize < 4
    return x.astype(jnp.float32) if narrow else x


def _describe(out: Any) -> str:
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of length {len(out)}"
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"an array of shape {tuple(out.shape)} and dtype {out.dtype}"
    return f"{type(out).__name__} of shape {np.shape(out)}"
