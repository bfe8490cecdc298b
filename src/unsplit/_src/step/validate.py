"""Input checks for the step: each error says what was expected, what arrived, and the fix.

All checks here look at shapes, dtypes and Python values only, so they cost no
device work and never wait for the device (NumPy ids are checked for negative
values on the host; a total weight that is not positive and finite gives nan
on device, see :func:`unsplit._src.step.sums.normalize`).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import jax.numpy as jnp
import numpy as np

from unsplit._src import keys as keys_lib
from unsplit._src import links


def is_traced(*trees: Any) -> bool:
    """Whether the call is being traced (inside the caller's jit or another transformation).

    Looks at each argument's first leaf only, so it costs nothing per parameter.
    """
    return any(isinstance(leaf, jax.core.Tracer) for t in trees for leaf in jax.tree.leaves(t)[:1])


def refuse_bitwise_in_jit(*trees: Any) -> None:
    """A bitwise step called on traced values (inside ``jax.jit``): a clear error, whichever
    argument is traced (params, batch, key or ids)."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees)):
        raise TypeError(
            "bitwise=True cannot run inside jax.jit (or another transformation): its "
            "chunk programs must be compiled on their own, because XLA compiles the same "
            "computation inside a multi-device program into other bits ("
            + links.doc_ref("bitwise")
            + "). "
            "Fix: use train = unsplit.train_step(step, optimizer), which runs the step and "
            "the optimizer update in one call; or call the step outside jit."
        )


def check_callable(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a function loss_fn(params, example, key); got "
            f"{type(loss_fn).__name__}. Fix: pass the one-example loss function itself."
        )


def check_positive_int(
    name: str, value: Any, *, meaning: str, allow_none: bool = False
) -> int | None:
    """``value`` as an int >= 1 (``None`` passes when ``allow_none``): the one check of
    ``microbatches``, ``group_size`` and ``chunk_size``. A non-int (a float, a bool, a
    string) raises TypeError, an int below 1 ValueError."""
    if value is None and allow_none:
        return None
    none = f", or {name}=None for the default" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an int >= 1 ({meaning}); got {name}={value!r} of type "
            f"{type(value).__name__}. Fix: pass e.g. {name}=4{none}."
        )
    if value < 1:
        raise ValueError(
            f"{name} must be >= 1 ({meaning}); got {name}={value}. Fix: pass {name}=1 or "
            f"more{none}."
        )
    return int(value)


def check_microbatches(microbatches: Any) -> None:
    check_positive_int(
        "microbatches", microbatches, meaning="sequential accumulation steps per device"
    )


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool; anything but True/False (e.g. the string "False") is refused."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise TypeError(
        f"{name} must be True or False; got {value!r} of type {type(value).__name__}. "
        f"Fix: pass {name}=True or {name}=False (a non-empty string such as 'False' would "
        "count as true)."
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


def _jax_dtype(dtype: Any) -> bool:
    """Whether JAX arrays can hold ``dtype``: not strings, bytes, objects or datetimes."""
    return getattr(dtype, "kind", None) not in ("U", "S", "O", "M", "m")


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
        name = jax.tree_util.keystr(path) or "batch"
        if (
            isinstance(leaf, bool | int | float | complex)
            and path
            and any(isinstance(k, jax.tree_util.SequenceKey) for k in path)
        ):
            raise TypeError(
                f"batch leaf {name} is a Python number inside nested Python lists or tuples; "
                "JAX treats every number of a list as its own leaf. Fix: convert the batch "
                "to arrays first, e.g. jax.tree.map(np.asarray, batch, is_leaf=lambda x: "
                "isinstance(x, list)) or np.asarray(rows)."
            )
        if not hasattr(leaf, "shape") and not isinstance(leaf, bool | int | float | complex):
            raise TypeError(
                f"batch leaf {name} is a {type(leaf).__name__}, not an array. Fix: pass "
                "arrays (np.asarray / jnp.asarray) whose leading axis is the global batch."
            )
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and not _jax_dtype(dtype):
            raise TypeError(
                f"batch leaf {name} has dtype {dtype}, which JAX arrays cannot hold (strings, "
                "Python objects). Fix: turn it into numbers before the step (e.g. token ids, "
                "or a np.int32 label index), or keep it out of the batch."
            )
        shape = np.shape(leaf)
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
    size = distinct.pop()
    if size == 0:
        raise ValueError(
            "the global batch has 0 examples (every leaf's leading axis is 0), so there is "
            "no loss to normalize. Fix: skip empty batches, or pass at least one example "
            "(padding examples get weight 0 with weighted=True)."
        )
    return size


def check_single_device_batch(batch: Any) -> None:
    """With ``mesh=None`` the step runs on one device: a batch sharded over several is refused."""
    flat, _ = jax.tree_util.tree_flatten_with_path(batch)
    for path, leaf in flat:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            devices = leaf.sharding.device_set
            if len(devices) > 1:
                mesh = getattr(leaf.sharding, "mesh", None)
                shape = dict(mesh.shape) if mesh is not None else f"{len(devices)} devices"
                raise ValueError(
                    f"batch leaf {jax.tree_util.keystr(path) or 'batch'} is sharded over "
                    f"{len(devices)} devices (mesh {shape}), but the step was built with "
                    "mesh=None, which runs on one device. Fix: build the step on that mesh, "
                    "unsplit.value_and_grad(..., mesh=mesh), or put the batch on one device "
                    "(jax.device_put(batch, jax.devices()[0]))."
                )


def check_schedule(batch: int, devices: int, microbatches: int, batch_axes: tuple) -> None:
    if batch_axes and batch % devices:
        axes = batch_axes[0] if len(batch_axes) == 1 else batch_axes
        raise ValueError(
            f"the batch axes {axes!r} of the mesh have {devices} devices, which does not "
            f"divide the batch size {batch}. Fix: use a global batch that is a multiple of "
            f"{devices}, or batch_axes / a mesh whose batch axes divide the batch."
        )
    if batch % (devices * microbatches):
        raise ValueError(
            f"batch size {batch} is not divisible by devices x microbatches = {devices} x "
            f"{microbatches} = {devices * microbatches}. Fix: pick microbatches that divide "
            f"the per-device batch {batch // devices}, or pad the global batch (padded "
            "examples with weight 0 under weighted=True)."
        )


def ids_words(ids: Any, batch: int) -> Any:
    """The ids, validated without touching the device: ``None`` (for ``arange(B)``),
    an :class:`~unsplit.Ids64`, or an integer JAX array of shape ``(B,)`` (split into
    words inside the compiled program).

    Host ids (NumPy, lists) are split exactly on the host (64-bit values too) and
    checked for negative values; JAX arrays are only checked for dtype and shape,
    since reading their values would wait for the device.
    """
    if ids is None:
        return None
    shape = tuple(ids.shape) if isinstance(ids, keys_lib.Ids64) else np.shape(ids)
    if shape != (batch,):
        raise ValueError(
            f"ids must have shape (B,) = ({batch},), one global id per example; got shape "
            f"{shape}. Fix: pass ids=None for arange(B), or one integer id per example."
        )
    if isinstance(ids, keys_lib.Ids64):
        return ids
    if isinstance(ids, jax.Array):  # also a tracer inside the caller's jit
        if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.dtype == jnp.bool_:
            raise TypeError(
                f"ids must be an integer array (the examples' global ids); got "
                f"dtype={ids.dtype}. Fix: pass integer ids, e.g. jnp.arange(batch_size); "
                "never float ids, which would silently round distinct ids together."
            )
        return ids
    hi, lo = keys_lib.id_words(ids)
    return keys_lib.Ids64(hi=hi, lo=lo)


def aux_pair(
    out: Any, weighted: bool, fn: str = "loss_fn", of: str = "one example"
) -> tuple[Any, Any]:
    """With ``has_aux=True``: the user's ``(value, aux)`` pair, checked.

    ``fn`` returned it for ``of``: ``loss_fn`` for one example, ``batch_loss`` for
    the global batch.
    """
    value = "(loss_sum, weight)" if weighted else "loss"
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise TypeError(
            f"with has_aux=True, {fn} must return a pair ({value}, aux) for {of}; "
            f"got {describe(out, fn)}. Fix: return e.g. ({value}, {{'accuracy': acc}}), or use "
            "has_aux=False."
        )
    return out[0], out[1]


def loss_output(out: Any, weighted: bool) -> tuple[jax.Array, jax.Array]:
    """The user's per-example output as (float32 loss_sum, float32 weight)."""
    if weighted:
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise TypeError(
                "with weighted=True, loss_fn must return a pair (loss_sum, weight) for one "
                f"example; got {describe(out)}. Fix: return e.g. (jnp.sum(token_losses * "
                "mask), jnp.sum(mask)), or use weighted=False for a plain scalar loss."
            )
        loss_sum, weight = out
        loss_sum = _scalar(loss_sum, "loss_sum (the first element of loss_fn's pair)")
        weight = _scalar(weight, "weight (the second element of loss_fn's pair)", floating=False)
        return _float32(loss_sum), jax.lax.stop_gradient(weight.astype(jnp.float32))
    if isinstance(out, tuple | list):
        raise TypeError(
            f"loss_fn returned {describe(out)}; with weighted=False it must return the scalar "
            "loss of one example. Fix: pass weighted=True if it returns (loss_sum, weight), "
            "or has_aux=True if it returns (loss, aux)."
        )
    loss = _scalar(out, "loss_fn's output")
    return _float32(loss), jnp.ones((), jnp.float32)


def check_result(loss: jax.Array, weight: jax.Array) -> None:
    """``checked=True``: raise, with the cause and the fix, instead of returning nan."""
    if isinstance(loss, jax.core.Tracer):
        from unsplit._src.processes import fingerprint  # inside the caller's jit: on device

        ok = jnp.isfinite(loss)
        fingerprint.raise_unless(ok, _bad_result_message(None, None))
        return
    value, total = float(np.asarray(loss)), float(np.asarray(weight))
    if not np.isfinite(value):
        raise FloatingPointError(_bad_result_message(value, total))


def _bad_result_message(value: float | None, total: float | None) -> str:
    if total is not None and not (np.isfinite(total) and total > 0):
        return (
            f"the total weight of the global batch is {total} (expected a positive finite "
            "number: the sum of the examples' weights), so the step loss sum(loss_sum) / "
            "sum(weight) is undefined and the loss and grads are nan. Fix: make sure at least "
            "one example has a positive weight (e.g. a non-empty token mask), skip such "
            "batches, and keep weights finite and non-negative."
        )
    return (
        f"the step loss is {value if value is not None else 'not finite'} although the total "
        f"weight{' ' + str(total) if total is not None else ''} is fine: loss_fn itself "
        "returned inf or nan for some example (log of 0, overflow, a nan input). Fix: find "
        "it with jax.config.update('jax_debug_nans', True) on one device, or "
        "unsplit.audit; clip or mask the offending values."
    )


def _scalar(x: Any, what: str, floating: bool = True) -> jax.Array:
    if (
        x is None
        or isinstance(x, dict | str)
        or not (hasattr(x, "shape") or isinstance(x, int | float))
    ):
        raise TypeError(
            f"{what} must be a scalar array; got {describe(x)}. Fix: return a scalar "
            "such as jnp.sum(losses); put extra outputs in aux with has_aux=True."
        )
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
    if not floating and (x.dtype == jnp.bool_ or not jnp.issubdtype(x.dtype, jnp.number)):
        raise TypeError(
            f"{what} must be a number (e.g. a token count); got dtype={x.dtype}. Fix: cast "
            "it, e.g. jnp.sum(mask.astype(jnp.float32))."
        )
    return x


def _float32(x: jax.Array) -> jax.Array:
    narrow = x.dtype.itemsize < 4
    return x.astype(jnp.float32) if narrow else x


def describe(out: Any, who: str = "loss_fn") -> str:
    """What a user's function returned, in words, for an error message."""
    if out is None:
        return f"None (did {who} forget to return?)"
    if isinstance(out, dict):
        return f"a dict with keys {sorted(map(str, out))}"
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of length {len(out)}"
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"an array of shape {tuple(out.shape)} and dtype {out.dtype}"
    return f"{type(out).__name__} of shape {np.shape(out)}"
