"""What the processes agree on: canonical forms of values, and the items of trees and steps.

:func:`canonical` turns a value into a JSON-able form that is equal across
processes exactly when the values are (arrays small enough by value, larger
ones by a hash, typed keys by their key data). :func:`tree_items` and
:func:`step_items` name the items :func:`unsplit._src.processes.agreement.agree`
compares, and :data:`STEP_FIXES` says how to fix each one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from unsplit._src import keys as keys_lib
from unsplit._src import links
from unsplit._src.processes import fingerprint

_SMALL = 64  # arrays up to this many elements are shown by value in messages


def canonical(value: Any) -> Any:
    """A JSON-able description of ``value`` that is equal across processes iff the values are."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, np.generic):
        return canonical(value.item())
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return str(np.dtype(value))
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [canonical(v) for v in value]
    if isinstance(value, jax.sharding.Mesh):
        return {"mesh": {str(k): int(v) for k, v in value.shape.items()},
                "axis types": [str(t) for t in value.axis_types],
                "device ids": np.asarray(value.device_ids).ravel().tolist()}  # fmt: skip
    if isinstance(value, jax.sharding.PartitionSpec):
        return str(value)
    if isinstance(value, jax.Array | np.ndarray):
        return _canonical_array(value)
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return repr(value)


def _canonical_array(x: Any) -> str:
    if keys_lib.is_typed_key(x):
        data = _canonical_array(jax.random.key_data(x)).split(" ", 1)[1]
        return f"key<{jax.random.key_impl(x)}>{list(x.shape)} data {data}"
    local = local_copy(x)
    kind = f"{x.dtype}{list(x.shape)}"
    if local is None:
        return f"{kind} (split over processes: its values are not compared on the host)"
    host = np.asarray(local)
    if host.size <= _SMALL:
        return f"{kind} {canonical(host.tolist())}"
    digest = hashlib.sha256(np.ascontiguousarray(host).tobytes()).hexdigest()[:16]
    return f"{kind} sha256 {digest}"


def local_copy(x: Any) -> Any:
    """A copy of ``x`` this process holds whole, or None if ``x`` is split over processes."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    if x.is_fully_replicated:
        return x.addressable_data(0)
    return None


def tree_items(name: str, tree: Any, *, values: bool = True) -> dict[str, Any]:
    """Items that pin down a pytree for :func:`agree`, each named after ``name``.

    ``"<name> structure"`` (the leaves' paths), ``"<name> shapes and dtypes"``,
    ``"<name> shardings"`` and, with ``values=True``, ``"<name> values"``: a
    64-bit fingerprint of each leaf this process holds whole (host values and
    replicated arrays; see :func:`unsplit._src.processes.fingerprint.host_fingerprints`).
    Only this last item touches the values: one jitted pass, one small read-back.

    Example:
        >>> import numpy as np
        >>> from unsplit._src.processes.items import tree_items
        >>> items = tree_items("params", {"w": np.ones((2, 3), np.float32)})
        >>> items["params shapes and dtypes"]
        {"['w']": 'float32[2, 3]'}
        >>> len(items["params values"]["['w']"])  # 64 bits in hex
        16
    """
    from unsplit._src.processes import fingerprint as fingerprint_lib

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(path) or "(the whole tree)" for path, _ in flat]
    leaves = [leaf for _, leaf in flat]
    items: dict[str, Any] = {
        f"{name} structure": paths,
        f"{name} shapes and dtypes": {
            p: _shape_dtype(x) for p, x in zip(paths, leaves, strict=True)
        },
        f"{name} shardings": {p: _sharding(x) for p, x in zip(paths, leaves, strict=True)},
    }
    if values:
        prints = fingerprint_lib.host_fingerprints(leaves)
        items[f"{name} values"] = {
            p: fp or "sharded over processes: not compared on the host"
            for p, fp in zip(paths, prints, strict=True)
        }
    return items


def _shape_dtype(x: Any) -> str:
    if keys_lib.is_typed_key(x):
        return f"key<{jax.random.key_impl(x)}>{list(x.shape)}"
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x).__name__
    return f"{np.dtype(dtype) if not keys_lib.is_typed_key(x) else dtype}{list(np.shape(x))}"


def _sharding(x: Any) -> str:
    if not isinstance(x, jax.Array):
        return "host"
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return f"{sharding.spec} over {dict(sharding.mesh.shape)}"
    if len(sharding.device_set) == 1:
        return "one device"
    return type(sharding).__name__


KEY_FIX = (
    "derive the key from a shared seed and the shared step number, e.g. "
    "jax.random.fold_in(jax.random.key(seed), step), on every process"
)
_SAME_MODEL = "build the params with the same model code and config on every process"
_GLOBAL = "build the global batch with unsplit.global_batch(local_rows, mesh) on every process"
#: The fix printed for each item of :func:`step_items` that differs.
STEP_FIXES = {
    **{s: f"build the step with the same {s}= on every process"
       for s in ("bitwise", "microbatches", "chunk_size", "weighted", "batch_axes")},
    "mesh": "pass the same mesh on every process, e.g. jax.make_mesh((jax.device_count(),), "
    "('data',)) everywhere",
    "step key": KEY_FIX,
    "step number": "pass the same step number on every process (the loop's counter, or the "
    "restored state.step)",
    "process settings": "run every process with the same JAX and jaxlib, backend, accelerator "
    "model, XLA_FLAGS and collectives (jax_cpu_collectives_implementation on CPU; NCCL_ALGO, "
    "NCCL_PROTO and the NCCL channels on GPU) "
    f"({links.doc_ref('bitwise', 'process-settings-what-must-match')})",
    "params structure": _SAME_MODEL,
    "params shapes and dtypes": _SAME_MODEL,
    "params shardings": "place the params with the same shardings on every process",
    **{f"frozen {s}": "load the same frozen inputs (e.g. the same base model checkpoint) "
       "with the same shardings on every process"
       for s in ("structure", "shapes and dtypes", "shardings", "values")},
    "params values": "initialize the params from the same seed on every process, load the same "
    "checkpoint, or take process 0's: jax.experimental.multihost_utils.broadcast_one_to_all",
    **{f"batch {s}": _GLOBAL for s in ("structure", "shapes and dtypes", "shardings")},
    "batch values": "a host (NumPy) batch is the whole global batch, the same on every "
    f"process; to give each process its own rows, {_GLOBAL}",
    **{f"ids {s}": "pass the same ids on every process (or ids=None), e.g. from global_batch"
       for s in ("structure", "shapes and dtypes", "shardings", "values")},
}  # fmt: skip


def step_items(
    settings: Mapping[str, Any], params, batch, key, ids=None, *, frozen=None, step=None
) -> dict[str, Any]:
    """What a step's first call agrees on: ``settings``, the key (and step number), params,
    frozen inputs, batch and ids.

    ``settings`` holds the step's options by name (``bitwise``, ``microbatches``,
    ``chunk_size``, ``weighted``, ``batch_axes``, ``mesh``); use with
    ``fixes=STEP_FIXES``.
    """
    items = {**settings, "step key": key, **tree_items("params", params)}
    if step is not None:  # folded into the key inside the step: the same on every process
        items["step number"] = step
    if frozen is not None:  # frozen inputs: the same structure, shardings and values as params
        items.update(tree_items("frozen", frozen))
    # What the bits depend on besides the inputs (versions, backend, XLA flags): every mode,
    # so processes that disagree only on bitwise= are told just that.
    items["process settings"] = fingerprint.bits_settings()
    items.update(tree_items("batch", batch))
    items.update(tree_items("ids", ids) if ids is not None else {"ids": "positions (ids=None)"})
    return items
