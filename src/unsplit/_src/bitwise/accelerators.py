"""What bitwise mode needs from an accelerator backend, checked once per process.

On CPU, unsplit fixes what would vary (see :mod:`.canonical_dots`). On GPU, XLA
picks kernels by autotuning and may use atomics in reductions (scatter-add,
some reductions): run to run and process to process, the same program can give
other bits unless every process runs with ``--xla_gpu_deterministic_ops=true``
and either ``--xla_gpu_autotune_level=0`` or one shared autotune cache. A
bitwise step on a GPU backend whose ``XLA_FLAGS`` lack the first flag warns
once (the Bitwise mode guide, https://unsplit.readthedocs.io/en/latest/bitwise/#accelerators-gpu-tpu).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

from unsplit._src import links

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
