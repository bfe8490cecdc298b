"""JAX's settings made by context managers, carried into another thread.

``with jax.default_matmul_precision("highest"): step(...)`` sets the precision for
the thread that calls the step: JAX keeps a context manager's setting per thread
(``jax.numpy_dtype_promotion``, ``jax.enable_x64``, ``jax.debug_nans`` and the
others alike). A function traced in another thread sees the process-wide values
instead, and a trace bakes them in: a dot traced there gets XLA's default
precision (on a TPU, bf16 passes for float32 matmuls) whatever the caller set.

:func:`current` reads, in the calling thread, every setting the public ``jax``
module offers as a context manager; :func:`applied` enters, in another thread, those
whose value there differs. :func:`in_thread` runs a function in a thread of its own
with the caller's settings. The mesh contexts are not among them: they are what a
thread of its own is for (see :mod:`unsplit._src.step.constraints`).

Example:
    >>> import jax
    >>> with jax.default_matmul_precision("highest"):
    ...     in_thread(lambda: jax.config.jax_default_matmul_precision)
    'highest'
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

_T = TypeVar("_T")


@functools.cache
def _states() -> tuple[Any, ...]:
    """The settings ``jax`` offers as context managers (``jax.default_matmul_precision``
    and its kind: objects of its type, read once; those of a newer JAX are found too)."""
    kind = type(jax.default_matmul_precision)
    found = {id(v): v for v in vars(jax).values() if isinstance(v, kind)}
    return tuple(found[i] for i in sorted(found))


def current() -> tuple[tuple[Any, Any], ...]:
    """Every such setting with its value in the calling thread."""
    return tuple((state, state.value) for state in _states())


@contextlib.contextmanager
def applied(settings: tuple[tuple[Any, Any], ...]) -> Iterator[None]:
    """In this thread, the settings of :func:`current` (those whose value here differs)."""
    with contextlib.ExitStack() as stack:
        for state, value in settings:
            if state.value != value:
                stack.enter_context(state(value))
        yield


def in_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` in a thread of its own, under the calling thread's JAX settings."""
    settings = current()

    def run() -> _T:
        with applied(settings):
            return fn()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()
