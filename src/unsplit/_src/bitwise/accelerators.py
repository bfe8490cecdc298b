"""What bitwise mode needs from an accelerator backend, checked once per process.

On CPU, unsplit fixes what would vary (see :mod:`.canonical_dots`). On GPU, XLA
picks kernels by autotuning and may use atomics in reductions (scatter-add,
some reductions): run to run and process to process, the same program can give
other bits unless every process runs with ``--xla_gpu_deterministic_ops=true``
and either ``--xla_gpu_autotune_level=0`` or one shared autotune cache. A
bitwise step on a GPU backend whose ``XLA_FLAGS`` lack the first flag warns
once (the Bitwise mode guide, https://unsplit.readthedocs.io/en/latest/bitwise/#accelerators-gpu-tpu).

On CPU with jaxlib before 0.12, a step whose groups span several devices runs their
programs one at a time (:func:`groups_one_at_a_time`, :class:`Launched`): that client can deadlock on two
collective programs in flight.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable

import jax
from jaxlib import version as jaxlib_release

from unsplit._src import links
from unsplit._src.bitwise.canonical_dots import is_cpu

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
_warned: set[str] = set()


def missing_gpu_flags(platforms: Iterable[str], xla_flags: str) -> list[str]:
    """The flags a bitwise step needs on these platforms that ``xla_flags`` lacks.

    Example:
        >>> missing_gpu_flags(["cuda"], "--xla_gpu_autotune_level=0")
        ['--xla_gpu_deterministic_ops=true']
        >>> missing_gpu_flags(["cpu"], "")
        []
    """
    if not any(p in GPU_PLATFORMS for p in platforms):
        return []
    given = xla_flags.split()
    return [] if DETERMINISTIC in given else [DETERMINISTIC]


def warn_once_without_gpu_flags(devices: Iterable) -> None:
    """Warns once per process if a bitwise step runs on GPUs without deterministic ops."""
    platforms = {d.platform for d in devices}
    missing = missing_gpu_flags(platforms, os.environ.get("XLA_FLAGS", ""))
    if not missing or "gpu" in _warned:
        return
    _warned.add("gpu")
    warnings.warn(
        "bitwise=True on a GPU backend without XLA_FLAGS="
        f"{' '.join(missing)}: XLA may pick non-deterministic kernels (atomics, autotuned "
        "algorithms), so the bits can differ run to run and between processes. Fix: start "
        "every process with XLA_FLAGS='--xla_gpu_deterministic_ops=true "
        "--xla_gpu_autotune_level=0' (or one shared autotune cache), set before jax is "
        f"imported; see {links.doc_ref('bitwise', 'accelerators-gpu-tpu')}.",
        stacklevel=4,
    )


# The first jaxlib whose CPU client launches one collective program only once the one before
# it is done on every device (measured: 0.12.0 and 0.12.1 never hung where 0.10.2, 0.11.0 and
# 0.11.2 did, below).
GANG_SCHEDULED_JAXLIB = (0, 12)


def groups_one_at_a_time(
    devices: Iterable, jaxlib_version: str = jaxlib_release.__version__
) -> bool:
    """Whether a step's programs on groups of several devices must run one at a time here.

    XLA's CPU client before jaxlib 0.12 runs each device's share of a multi-device
    program on a thread of one pool, about as large as the process's devices, and a
    share that reaches a collective holds its thread until every device's share has
    arrived. Two collective programs with no data between them (two groups' chunk
    programs, two chunks of one FSDP group) can then take every thread between them,
    each waiting for shares that the other's threads keep from starting: XLA aborts
    the process after 40 s (``Termination timeout for `all gather RendezvousKey...```).
    Measured on 8 CPU devices: a bitwise FSDP-groups train step called 300 times
    without waiting hung, and so did two plain ``jax.jit`` programs (a
    ``psum_scatter`` and an ``all_gather``) called alternately, on jaxlib 0.10.2,
    0.11.0 and 0.11.2; never on 0.12.0 or 0.12.1. So there the runner waits for each
    such program before it launches the next (the host then waits on the device each
    launch; the bits are the same).

    Example:
        >>> import jax
        >>> groups_one_at_a_time(jax.devices("cpu"), "0.10.2")
        True
        >>> groups_one_at_a_time(jax.devices("cpu"), "0.12.1")
        False
    """
    release = tuple(int(n) for n in re.findall(r"\d+", jaxlib_version)[:2])
    return release < GANG_SCHEDULED_JAXLIB and is_cpu(devices)


class Launched:
    """A step's group programs' outputs, waited for where they must run one at a time.

    Groups of one device run programs without collectives: never waited for.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> launched = Launched(jax.devices("cpu"), group_size=2)
        >>> float(launched(jnp.ones(3)).sum())  # on jaxlib < 0.12: ready when it returns
        3.0
    """

    def __init__(self, devices: Iterable, group_size: int):
        self.wait = group_size > 1 and groups_one_at_a_time(devices)

    def __call__(self, outputs):
        if self.wait:
            jax.block_until_ready(outputs)
        return outputs


def warn_once_with_compilation_cache(devices: Iterable, cache_dir: str | None = None) -> None:
    """Warns once per process if a bitwise step runs on several CPU devices with JAX's
    persistent compilation cache on (``cache_dir``: default ``jax_compilation_cache_dir``).

    Measured: ``step_test.py``'s bitwise grid run a second time with a warm cache hung
    at 4 CPU devices in its combine (one device waited in a reduce-scatter of two for
    the other, which never came; XLA aborted the process after 40 s), on jaxlib 0.10.2
    and 0.12.1; with a cold cache, and without the cache, it passes. The cause is not
    found, so the step warns rather than guess.

    Example:
        >>> import jax, warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_once_with_compilation_cache(jax.devices("cpu")[:1], "/tmp/cache")
        >>> caught  # one device: no collective, no warning
        []
    """
    devices = list(devices)
    if cache_dir is None:  # a config option the stubs do not name
        cache_dir = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
    if "cache" in _warned or not cache_dir or len(devices) < 2 or not is_cpu(devices):
        return
    _warned.add("cache")
    warnings.warn(
        f"bitwise=True on {len(devices)} CPU devices with JAX's persistent compilation cache "
        f"on (jax_compilation_cache_dir={cache_dir!r}): with a warm cache a bitwise step on 4 "
        "CPU devices hung in its combine and XLA aborted the process after 40 s (measured on "
        "jaxlib 0.10.2 and 0.12.1; cause not found). Fix: run bitwise steps on CPU without "
        "it (unset JAX_COMPILATION_CACHE_DIR / jax_compilation_cache_dir); see "
        f"{links.doc_ref('bitwise', 'on-cpu-before-jaxlib-012')}.",
        stacklevel=4,
    )
