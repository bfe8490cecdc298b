"""Bytes a compiled program's collectives send per device, read from its HLO.

Counted as the bandwidth-optimal (ring) algorithms send them, per device, for a
collective over a group of ``G`` devices whose result holds ``R`` bytes:

===================== =============================
all-reduce            ``2 (G - 1) / G * R``
all-gather            ``(G - 1) / G * R``
reduce-scatter        ``(G - 1) * R``
all-to-all            ``(G - 1) / G * R``
collective-permute    ``R``
===================== =============================

The figure compares programs (bitwise mode's combine against a ring
all-reduce of the same sums); it is not a measurement of a network.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from unsplit._src.bitwise import traffic
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> traffic.bytes_sent(compiled)
    0.0
"""

from __future__ import annotations

import re
from typing import Any

_ITEM_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(
    r"=\s*(?P<result>.*?)\s+(?P<kind>" + "|".join(_KINDS) + r")(?P<async>-start|-done)?\("
)
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]fn)?)\[([0-9,]*)\]")


def bytes_sent(program: Any) -> float:
    """Bytes one device sends in ``program``'s collectives (a compiled program or HLO text)."""
    text = program if isinstance(program, str) else program.as_text()
    partitions = re.search(r"num_partitions=(\d+)", text)
    everyone = int(partitions.group(1)) if partitions else 1
    total = 0.0
    for line in text.splitlines():
        found = _OP.search(line)
        if not found or found.group("async") == "-start":
            continue  # an async collective is counted once, at its -done
        kind, result = found.group("kind"), _result_bytes(found.group("result"))
        if kind == "collective-permute":
            total += result
            continue
        g = _devices_per_replica_group(line, everyone)
        share = {
            "all-reduce": 2 * (g - 1) / g,
            "all-gather": (g - 1) / g,
            "reduce-scatter": g - 1,
            "all-to-all": (g - 1) / g,
        }[kind]
        total += share * result
    return total


def _result_bytes(result: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(result):
        if dtype not in _ITEM_BYTES:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _ITEM_BYTES[dtype]
    return total


def _devices_per_replica_group(line: str, everyone: int) -> int:
    """The devices in each of the instruction's replica groups."""
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if named:  # newer XLA: replica_groups=mesh['data'=4,'model'=2] {'data'}
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", named.group(1)))
        size = 1
        for axis in re.findall(r"'([^']+)'", named.group(2)):
            size *= int(sizes[axis])
        return size
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    return everyone  # replica_groups={}: every device
