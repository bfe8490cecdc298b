"""Many processes: agree on what must be equal, in one small collective, before any work.

In a multi-process program every process passes its own copy of what must be
the same everywhere: the step's settings, the params, the key, the shape of
the global batch. If they differ, JAX runs anyway and each process computes
something else, or the processes wait for each other forever. :func:`agree`
checks them on the host at the first call:

1. each process runs its local checks; an error does not propagate yet;
2. one ``process_allgather`` of a fixed-size ``uint32`` vector: a status
   word and a 128-bit digest per item (about 1 KiB per process);
3. if every process is ok and every digest is equal: done. Otherwise a second
   exchange carries each process's values (or its error) and **every**
   process raises: the process whose local check failed re-raises its own
   error, the others an :class:`AgreementError` naming it and its error; on a
   mismatch every process raises an :class:`AgreementError` naming the
   differing items, which process has which value, and the fix.

Because the decision to take the second exchange is made from the gathered
vector, which is the same everywhere, no process is left waiting. In a single
process nothing is exchanged and local errors propagate unchanged.

Example:
    >>> import jax
    >>> from unsplit._src.processes import agreement
    >>> with agreement.agreeing("my step's first call") as items:
    ...     items["microbatches"] = 4  # a local check may raise here instead
    >>> agreement.agree({"mode": "bitwise"}, what="my step's first call")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from unsplit._src.processes.items import KEY_FIX as KEY_FIX
from unsplit._src.processes.items import STEP_FIXES as STEP_FIXES
from unsplit._src.processes.items import canonical as canonical
from unsplit._src.processes.items import local_copy as local_copy
from unsplit._src.processes.items import step_items as step_items
from unsplit._src.processes.items import tree_items as tree_items

_VERSION = 1
_OK, _FAILED = 0, 1
_SLOTS = 64  # items beyond 64 share slots (their digests are XORed): still caught
_DIGEST_WORDS = 4  # 128 bits per item
_SHOWN = 240  # characters of a value shown in a message


class AgreementError(ValueError):
    """Processes disagree on something that must be equal, or a peer's local check failed."""


def needed() -> bool:
    """True when there are several processes to agree (``jax.process_count() > 1``)."""
    return jax.process_count() > 1


def agree(items: Mapping[str, Any], *, what: str, fixes: Mapping[str, str] | None = None):
    """Raises on every process unless all processes pass equal ``items``.

    Args:
        items: name -> value (Python scalars, strings, sequences, dicts, NumPy
            or JAX arrays, dtypes, meshes); :func:`tree_items` describes a
            pytree. Compared by a digest of a canonical form; shown on mismatch.
        what: where the check runs, for the message (e.g. "the step's first call").
        fixes: name -> the fix to print when that item differs.

    Raises:
        AgreementError: on every process, naming each differing item, which
            process has which value, and the fix.
    """
    with agreeing(what, fixes=fixes) as mine:
        mine.update(items)


@contextlib.contextmanager
def agreeing(what: str, *, fixes: Mapping[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """Runs the body's local checks, then agrees on the items it fills in.

    The body fills the yielded dict with the items to compare. An exception in
    the body is not raised at once: it is sent to the other processes, and
    then every process raises (see the module docs), so one process's bad
    input never leaves the others waiting in a collective.

    The checks and the exchange are host work on each process's own copies
    (fingerprints computed on the device that holds a copy): they run outside the
    caller's ``jax.set_mesh``, whose mesh spans every process's devices.
    """
    items: dict[str, Any] = {}
    if not needed():
        yield items
        return
    error: Exception | None = None
    with jax.set_mesh(None):
        try:
            yield items
        except Exception as e:  # a local check failed: tell the others before raising
            error = e
        _exchange(what, items, error, dict(fixes or {}))
    if error is not None:  # _exchange raises it; never let the context manager swallow it
        raise error


def _exchange(what: str, items: dict[str, Any], error: Exception | None, fixes) -> None:
    me, count = jax.process_index(), jax.process_count()
    if error is None:
        try:
            canon = {name: canonical(value) for name, value in items.items()}
        except Exception as e:  # an item that cannot be described is a local failure
            error, canon = e, {}
    if error is None:
        payload = json.dumps(canon).encode()
        table = np.zeros((_SLOTS, _DIGEST_WORDS), np.uint32)
        for i, (name, value) in enumerate(canon.items()):
            table[i % _SLOTS] ^= _digest(json.dumps([name, value], sort_keys=True).encode())
        status, n = _OK, len(canon)
    else:
        payload = json.dumps({"type": type(error).__name__, "message": str(error)[:20000]}).encode()
        table = np.zeros((_SLOTS, _DIGEST_WORDS), np.uint32)
        status, n = _FAILED, 0
    header = np.array([_VERSION, status, n, len(payload)], np.uint32)
    everyone = np.asarray(
        multihost_utils.process_allgather(np.concatenate([header, table.ravel()]))
    )
    if (everyone == everyone[0]).all() and everyone[0, 1] == _OK:
        return
    # The mismatch path (the same decision on every process): exchange the values.
    lengths = everyone[:, 3].astype(np.int64)
    # A power of two: few distinct shapes, so few compiled gathers.
    buffer = np.zeros(1 << max(10, int(lengths.max()).bit_length()), np.uint8)
    buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer))
    decoded = [json.loads(gathered[p, : lengths[p]].tobytes()) for p in range(count)]
    failed = [p for p in range(count) if everyone[p, 1] != _OK]
    if failed:
        message = _failure_message(what, failed, decoded, count)
        if error is not None:
            error.add_note(
                f"(unsplit: this is process {me} of {count}; the other processes were told "
                "and raise too, before any step work.)"
            )
            raise error
        raise AgreementError(message)
    raise AgreementError(_mismatch_message(what, decoded, fixes))


def signature(items: Mapping[str, Any]) -> np.ndarray:
    """``uint32[4]``: a 128-bit digest of ``items``, to compare inside a compiled program.

    For a step traced inside a user's ``jax.jit``, where a host exchange is not
    safe: embed ``jnp.asarray(signature(static_items))`` (settings, shapes) as a
    constant and compare it across devices with
    :func:`unsplit._src.processes.fingerprint.replicas_agree`. Processes that traced
    different programs then see it on device.

    Example:
        >>> from unsplit._src.processes.agreement import signature
        >>> (signature({"microbatches": 2}) == signature({"microbatches": 2})).all()
        np.True_
        >>> (signature({"microbatches": 2}) == signature({"microbatches": 4})).all()
        np.False_
    """
    canon = {name: canonical(value) for name, value in items.items()}
    return _digest(json.dumps(canon, sort_keys=True).encode()).copy()


def _failure_message(what: str, failed: list[int], decoded: list[Any], count: int) -> str:
    lines = [
        f"{'process' if len(failed) == 1 else 'processes'} {_names(failed)} of {count} failed "
        f"{'its' if len(failed) == 1 else 'their'} local checks in {what}; every process "
        "stops here, before any step work. The error:"
    ]
    for p in failed:
        lines.append(f"  process {p}: {decoded[p]['type']}: {decoded[p]['message']}")
    lines.append(f"Fix: the error above, on process {_names(failed)} (see its log).")
    return "\n".join(lines)


def _mismatch_message(what: str, decoded: list[dict[str, Any]], fixes) -> str:
    count = len(decoded)
    names = list(dict.fromkeys(n for d in decoded for n in d))
    differing = [
        n for n in names if any(d.get(n, _MISSING) != decoded[0].get(n, _MISSING) for d in decoded)
    ]
    # A tree whose structure differs also differs in its per-leaf items: say it once.
    trees = [n.removesuffix(" structure") for n in differing if n.endswith(" structure")]
    differing = [
        n for n in differing
        if not any(n.startswith(f"{t} ") and not n.endswith(" structure") for t in trees)
    ]  # fmt: skip
    if not differing:  # equal values, different digests: another version of unsplit?
        return (
            f"the {count} processes check the same values differently in {what}. Fix: run the "
            "same version of unsplit (and of your code) on every process."
        )
    lines = [f"the {count} processes disagree on the {' and the '.join(differing)} in {what}:"]
    for name in differing:
        lines.append(f"  {name}: " + _difference([d.get(name, _MISSING) for d in decoded]))
        fix = fixes.get(name, f"every process must pass the same {name}")
        lines.append(f"    Fix: {fix}.")
    return "\n".join(lines)


_MISSING = "<not checked by this process: another version of the code?>"


def _difference(values: list[Any]) -> str:
    """Which processes have which value, at the first place where they differ."""
    where = ""
    while True:
        if all(isinstance(v, dict) for v in values):
            if any(list(v) != list(values[0]) for v in values):
                where, values = where + " the names", [list(v) for v in values]
                continue
            key = next(k for k in values[0] if any(v[k] != values[0][k] for v in values))
            where, values = (
                where + (key if key.startswith("[") else f"[{key!r}]"),
                [v[key] for v in values],
            )
        elif (
            all(isinstance(v, list) for v in values)
            and len({len(v) for v in values}) == 1
            and any(isinstance(e, dict | list | str) for e in values[0])
        ):
            i = next(i for i in range(len(values[0])) if any(v[i] != values[0][i] for v in values))
            where, values = where + f"[{i}]", [v[i] for v in values]
        else:
            break
    groups: dict[str, list[int]] = {}
    for p, v in enumerate(values):
        groups.setdefault(json.dumps(v), []).append(p)
    shown = "; ".join(
        f"process {_names(ps)} {'has' if len(ps) == 1 else 'have'} {_short(json.loads(v))}"
        for v, ps in groups.items()
    )
    return (f"at {where.strip()}: " if where else "") + shown


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _names(processes: list[int]) -> str:
    return ", ".join(str(p) for p in processes)


def _digest(data: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(data).digest()[: 4 * _DIGEST_WORDS], np.uint32)
