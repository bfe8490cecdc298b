"""Examples made of fixed groups of rows: ``value_and_grad(..., group_size=G)``.

Ghost batch normalization (BatchNorm over each group of ``G`` rows) and other
layers that couple a few rows need those rows to stay together whatever the
schedule. With ``group_size=G`` the batch's rows ``g*G ... g*G+G-1`` (global
ids) are ONE example: the loss (or ``features_fn``) gets them as arrays of
shape ``(G, ...)`` and the key ``example_keys(key, g)``. This module checks
that no microbatch or device share would split a group and turns the row
batch and row ids into the group batch and group ids.

Example:
    >>> import numpy as np
    >>> from unsplit._src.step import groups
    >>> batch, ids = groups.group_rows({"x": np.zeros((8, 3))}, np.arange(8, 16), 4, shares=2)
    >>> batch["x"].shape, ids.tolist()
    ((2, 4, 3), [2, 3])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src import keys as keys_lib
from unsplit._src.step import validate


def check_group_size(group_size: Any) -> int | None:
    """``group_size`` as an int >= 1, or None."""
    return validate.check_positive_int(
        "group_size", group_size, meaning="rows per example", allow_none=True
    )


def group_rows(batch: Any, ids: Any, group_size: int, *, shares: int) -> tuple[Any, Any]:
    """Rows ``(B, ...)`` -> groups ``(B/G, G, ...)``, and row ids -> group ids.

    ``shares`` is how many pieces the schedule cuts the batch into (devices
    times microbatches): each piece must hold whole groups.
    """
    leaves = jax.tree.leaves(batch)
    rows = leaves[0].shape[0] if leaves and np.ndim(leaves[0]) else None
    if rows is None or rows % group_size:
        raise ValueError(
            f"group_size={group_size} makes every {group_size} consecutive rows one example; "
            f"got a batch of {rows} rows, not a whole number of groups. Fix: pass a batch "
            f"of a multiple of {group_size} rows."
        )
    if (rows // shares) % group_size or rows % shares:
        raise ValueError(
            f"group_size={group_size}: a microbatch or a device's share would split a group: "
            f"{rows} rows cut into {shares} pieces (devices x microbatches) is "
            f"{rows / shares:g} rows each, not a multiple of {group_size}. Fix: use a batch "
            f"of a multiple of {shares * group_size} rows, or fewer devices or microbatches."
        )
    grouped = jax.tree.map(lambda x: _split_rows(x, group_size), batch)
    return grouped, _group_ids(ids, rows, group_size)


def _split_rows(x: Any, group_size: int) -> Any:
    shape = (x.shape[0] // group_size, group_size, *x.shape[1:])
    if isinstance(x, jax.Array):
        return jnp.reshape(x, shape)  # the groups stay on the devices their rows were on
    return np.reshape(np.asarray(x), shape)


def _divided(hi: Any, lo: Any, d: int) -> tuple[Any, Any]:
    """The 64-bit values ``hi * 2**32 + lo``, divided by ``d <= 2**16`` (32-bit words only:
    long division in 16-bit digits, so nothing needs 64-bit integers)."""
    xp = jnp if isinstance(lo, jax.Array) or isinstance(hi, jax.Array) else np
    hi, lo = xp.asarray(hi, xp.uint32), xp.asarray(lo, xp.uint32)
    d32 = xp.uint32(d)
    q_hi, r = hi // d32, hi % d32
    t = (r << 16) | (lo >> 16)
    q1, r = t // d32, t % d32
    t = (r << 16) | (lo & xp.uint32(0xFFFF))
    return q_hi, (q1 << 16) | (t // d32)


def _group_ids(ids: Any, rows: int, group_size: int) -> Any:
    """Group ``g`` for rows ``g*G ... g*G+G-1``; host ids are checked to be exactly those."""
    if ids is None:
        return None
    if isinstance(ids, keys_lib.Ids64):  # 64-bit ids as words (unsplit.global_batch)
        if tuple(ids.shape) != (rows,):
            raise ValueError(
                f"ids must have shape (B,) = ({rows},), one global id per row with group_size; "
                f"got shape {tuple(ids.shape)}. Fix: pass one id per row, or ids=None."
            )
        if group_size > 2**16:
            raise ValueError(
                f"group_size={group_size} with 64-bit ids (unsplit.Ids64) must be at most "
                "65536. Fix: use smaller groups."
            )
        hi, lo = _divided(ids.hi[::group_size], ids.lo[::group_size], group_size)
        return keys_lib.Ids64(hi=hi, lo=lo)
    if np.shape(ids) != (rows,):
        raise ValueError(
            f"ids must have shape (B,) = ({rows},), one global id per row with group_size; "
            f"got shape {np.shape(ids)}. Fix: pass one integer id per row, or ids=None."
        )
    if isinstance(ids, jax.Array):  # values not read (no wait for the device)
        return ids[::group_size] // group_size
    host = np.asarray(ids)
    if not np.issubdtype(host.dtype, np.integer):
        raise TypeError(
            f"ids must be integers (the rows' global ids); got dtype={host.dtype}. Fix: pass "
            "integer ids."
        )
    first = host[::group_size]
    expected = first[:, None] + np.arange(group_size, dtype=host.dtype)
    bad = np.nonzero(
        (first % group_size != 0) | np.any(host.reshape(-1, group_size) != expected, 1)
    )
    if bad[0].size:
        g = int(bad[0][0])
        got = host[g * group_size : (g + 1) * group_size].tolist()
        raise ValueError(
            f"group_size={group_size} needs each group's rows to be global ids g*{group_size} "
            f"... g*{group_size}+{group_size - 1} in order; rows {g * group_size}-"
            f"{(g + 1) * group_size - 1} have ids {got}. Fix: keep each group's rows together "
            "and in order when shuffling (shuffle whole groups), or pass ids=None."
        )
    return first // group_size
