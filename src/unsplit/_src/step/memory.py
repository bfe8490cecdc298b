"""Refusing, before it runs, a compiled program that needs more memory than its devices have.

A program too big for the device fails when it runs: asynchronously, often only in
``block_until_ready``, as a bare ``RESOURCE_EXHAUSTED`` far from the call that caused
it. On the first call of each new signature the steps compile their programs
explicitly anyway; :func:`check` compares the memory XLA says the program needs with
what its devices have free and raises :class:`OutOfMemoryError`, with the fix for the
mode, before anything runs.

What the program needs, per device, is XLA's ``compiled.memory_analysis()``: its
outputs and temporaries, less the outputs that reuse donated arguments (its arguments
are on the device already, counted as in use). What a device has free is
``device.memory_stats()``'s ``bytes_limit - bytes_in_use`` where the backend reports
it (GPU, TPU); on CPU, where it does not, the host's ``MemAvailable`` shared by its
CPU devices. A backend that reports neither is not checked.

``UNSPLIT_MEMORY_CHECK=0`` in the environment turns the check off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

import jax

ENV = "UNSPLIT_MEMORY_CHECK"


def _bases() -> tuple[type, ...]:
    """``JaxRuntimeError`` and ``MemoryError``; ``MemoryError`` alone where the former cannot
    be subclassed (a JAX whose runtime error is a closed extension type)."""
    try:
        type("Probe", (jax.errors.JaxRuntimeError, MemoryError), {})
    except (AttributeError, TypeError):
        return (MemoryError,)
    return (jax.errors.JaxRuntimeError, MemoryError)


class OutOfMemoryError(*_bases()):
    """A step's program needs more device memory than is free; raised before it runs.

    It is a ``jax.errors.JaxRuntimeError`` (what JAX raises when a program runs out
    of memory, its message starting ``RESOURCE_EXHAUSTED``) and a ``MemoryError``, so
    either ``except`` catches it.
    """


def enabled() -> bool:
    """Whether the check runs (``UNSPLIT_MEMORY_CHECK=0`` turns it off)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def needed_bytes(compiled: Any) -> int | None:
    """The memory a compiled program allocates per device when it runs (``None``: unknown)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # a backend without the analysis: nothing to compare
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    if analysis is None:
        return None
    try:
        output = analysis.output_size_in_bytes
        temp = analysis.temp_size_in_bytes
        alias = analysis.alias_size_in_bytes
    except AttributeError:
        return None
    return max(int(output) + int(temp) - int(alias), 0)


def host_available_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` of ``/proc/meminfo``; ``None``: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(device: Any) -> int | None:
    """The memory free on ``device`` (``None``: the backend does not say)."""
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        host = host_available_bytes()
        if host is None:
            return None
        # The simulated CPU devices of one process share the host's memory.
        sharing = sum(1 for d in jax.local_devices(backend="cpu"))
        return host // max(sharing, 1)
    return None


def devices_of(compiled: Any) -> list[Any]:
    """The local devices a compiled program runs on (from its input and output shardings)."""
    found: dict[int, Any] = {}
    for shardings in (compiled.input_shardings, compiled.output_shardings):
        for sharding in jax.tree.leaves(shardings):
            for device in getattr(sharding, "device_set", ()):
                if device.process_index == jax.process_index():
                    found[device.id] = device
    return [found[i] for i in sorted(found)]


def check(compiled: Any, fix: str, devices: Iterable[Any] | None = None) -> None:
    """Raises :class:`OutOfMemoryError` if ``compiled`` needs more than a device has free.

    Args:
        compiled: a ``jax.stages.Compiled`` (or anything with ``memory_analysis()``).
        fix: what to change, for the message (the mode's own fix).
        devices: the devices it runs on; default: read from its shardings.
    """
    if not enabled():
        return
    needed = needed_bytes(compiled)
    if not needed:
        return
    devices = list(devices) if devices is not None else devices_of(compiled)
    for device in devices:
        available = available_bytes(device)
        if available is not None and needed > available:
            raise OutOfMemoryError(
                f"RESOURCE_EXHAUSTED: unsplit: the step's program needs {size_text(needed)} on "
                f"{device} (XLA's memory analysis: outputs + temporaries - donated), and the "
                f"device has {size_text(available)} free; it was not run. {fix} "
                f"(To skip this check: {ENV}=0.)"
            )


def default_fix(microbatches: int) -> str:
    """Default mode's fix: more microbatches (the result does not change)."""
    return (
        "Activation memory grows with the examples each device processes at once (now "
        f"{microbatches} microbatch(es) per device). Fix: raise microbatches=... (the result "
        "does not change), add devices to the batch axes, or shard the params (FSDP / tensor "
        "parallel)."
    )


def bitwise_fix(chunk_size: int | None) -> str:
    """Bitwise mode's fix: a smaller chunk (it changes the bits), or FSDP groups."""
    now = "the default" if chunk_size is None else chunk_size
    return (
        f"Bitwise mode computes one chunk of examples at a time (chunk_size now {now}). Fix: "
        "a smaller chunk_size=... (it changes the bits: compare schedules at the same "
        "chunk_size), or chunk_axes=... so that a group of devices computes each chunk "
        "together with the params sharded over it."
    )


def size_text(n: int) -> str:
    """Bytes for a message: ``1.50 GiB (1610612736 bytes)``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


@contextlib.contextmanager
def hint(step: Any):
    """Out-of-memory errors raised inside get the mode's fix; others pass unchanged."""
    try:
        yield
    except OutOfMemoryError:  # refused before running: it names the fix already
        raise
    except Exception as error:
        text = str(error)
        if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
            raise
        fix = bitwise_fix(step.chunk_size) if step.bitwise else default_fix(step.microbatches)
        raise type(error)(f"{text}\n\nunsplit: the step ran out of device memory. {fix}") from error
