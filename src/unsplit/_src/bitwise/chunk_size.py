"""Choosing bitwise mode's chunk size for every schedule a run may use: ``chunk_size_for``.

The chunk size fixes a bitwise step's bits, so the schedules whose results
should agree must share it, and each of them must accept it:

* the batch axes' devices ``d`` divide the global batch (as in default mode);
* with FSDP groups (``chunk_axes``, groups of ``G`` devices) each group's rows
  are split over its ``G`` devices, so ``d`` is a multiple of ``G`` and the
  chunk a multiple of ``G``; groups of another size run another program, so
  ``G`` is the same for every schedule;
* each group's share, ``global_batch // (d // G)`` examples, is a whole number
  of chunks.

The valid chunks are then the multiples of ``G`` dividing the greatest common
divisor of the shares; :func:`chunk_size_for` returns the largest (or the
largest not above ``at_most``).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any


def chunk_size_for(
    global_batch: int,
    batch_devices: int | Sequence[int] = (1, 8, 64),
    *,
    group_devices: int = 1,
    at_most: int | None = None,
) -> int:
    """The largest bitwise ``chunk_size`` that every listed schedule accepts.

    Pass the result as ``unsplit.value_and_grad(..., bitwise=True,
    chunk_size=...)`` on every schedule: the runs then agree bit for bit
    whichever of these device counts (and any ``microbatches``) computes them.
    A larger chunk means fewer, larger chunk programs (faster) but more
    activation memory per device; ``at_most`` caps it.

    Args:
        global_batch: examples per step (with ``group_size=G``, rows // G).
        batch_devices: the numbers of devices the batch axes may span (the
            product of the ``batch_axes`` sizes), one int or several.
        group_devices: with ``chunk_axes`` (FSDP groups), the devices of the
            chunk axes: every chunk is split over them. The same for every
            schedule (another number runs another program, other bits).
        at_most: the largest chunk size to consider (activation memory).

    Returns:
        The largest chunk size, a multiple of ``group_devices`` dividing every
        group's share of the batch, not above ``at_most``.

    Raises:
        ValueError: a device count does not divide the batch or is not a
            multiple of ``group_devices``, or ``at_most < group_devices``.
        TypeError: an argument is not a positive int.

    Example:
        >>> import unsplit
        >>> unsplit.chunk_size_for(512, (1, 8, 64))  # shares 512, 64 and 8 examples
        8
        >>> unsplit.chunk_size_for(512, (1, 8)), unsplit.chunk_size_for(512, (1, 8), at_most=16)
        (64, 16)
        >>> unsplit.chunk_size_for(96, (4, 8), group_devices=4)  # 1 or 2 groups of 4
        48
    """
    batch = _positive("global_batch", global_batch)
    group = _positive("group_devices", group_devices)
    devices = _device_counts(batch_devices)
    cap = None if at_most is None else _positive("at_most", at_most)
    shares = []
    for d in devices:
        if d % group:
            raise ValueError(
                f"with FSDP groups of group_devices={group} every batch device count must be "
                f"a multiple of {group} (the batch axes include the chunk axes); got "
                f"batch_devices={devices}, {d} is not. Fix: drop {d}, or list counts like "
                f"{tuple(group * k for k in (1, 2, 4))}."
            )
        if batch % d:
            raise ValueError(
                f"every batch device count must divide the global batch (each device gets "
                f"whole examples); got global_batch={batch}, batch_devices={devices}: {d} does "
                f"not divide {batch}. Fix: drop {d}, or use a global batch that is a multiple "
                f"of {math.lcm(*devices)}."
            )
        shares.append(batch // (d // group))
    # Every share is group * (batch // d), so the multiples of group dividing their gcd
    # always include group itself: only at_most can leave no chunk.
    common = functools.reduce(math.gcd, shares)
    fits = [c for c in range(group, common + 1, group) if common % c == 0]
    if cap is not None and cap < group:
        raise ValueError(
            f"no chunk size fits: with FSDP groups of group_devices={group} a chunk is split "
            f"over its {group} devices, so expected a multiple of {group}, at most "
            f"at_most={cap}; got none. Fix: at_most >= {group} (or smaller groups)."
        )
    fits = [c for c in fits if cap is None or c <= cap]
    return fits[-1]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise TypeError(
            f"{name} must be a positive int; got {name}={value!r}. Fix: pass e.g. {name}=8."
        )
    return int(value)


def _device_counts(batch_devices: Any) -> tuple[int, ...]:
    if isinstance(batch_devices, numbers.Integral) and not isinstance(batch_devices, bool):
        batch_devices = (batch_devices,)
    try:
        counts = tuple(batch_devices)
    except TypeError:
        counts = ()
    if not counts:
        raise TypeError(
            f"batch_devices must be a device count or a non-empty sequence of them; got "
            f"batch_devices={batch_devices!r}. Fix: pass e.g. batch_devices=(1, 8, 64)."
        )
    bad = [d for d in counts if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1]
    if bad:
        raise TypeError(
            f"batch_devices must hold positive ints (device counts); got "
            f"batch_devices={batch_devices!r}, with {bad}. Fix: pass e.g. batch_devices=(1, 8, 64)."
        )
    return tuple(int(d) for d in counts)
