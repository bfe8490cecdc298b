"""Bitwise mode's compiled programs: one cache per loss function, one key function.

Chunk programs (and the batch loss's program of a coupled step) are compiled
explicitly, once per distinct program, and shared by every step built from the
same loss function. :func:`program_key` says what a program depends on: the
params' and sums' flat layouts, its devices and the inputs' shapes -- not the
schedule, so a step on 4 devices reuses the programs a step on 8 devices
compiled for the same devices. Groups of the same size run the same program:
it is compiled for the first such group's devices and loaded onto the others'
(:mod:`unsplit._src.bitwise.relocate`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import weakref
from typing import Any

import jax
import numpy as np

from unsplit._src.bitwise import canonical_dots, placement, programs, relocate
from unsplit._src.bitwise.blocked import chunk as blocked_chunk
from unsplit._src.bitwise.fsdp import group_reduce
from unsplit._src.bitwise.plan import Plan
from unsplit._src.step import memory, sums

# Compiled chunk programs, shared by every step built from the same loss function for
# as long as that function lives: a compiled executable does not keep the function
# alive, so dropping the function (and the steps) frees its programs too; a loop that
# builds steps from one function compiles once.
_EXECUTABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clear() -> None:
    """Drops every compiled program shared this way (the next call of a step compiles again).

    Example:
        >>> clear()
        >>> len(_EXECUTABLES)
        0
    """
    _EXECUTABLES.clear()


def shared(spec: sums.LossSpec) -> dict:
    """The compiled programs of ``spec``'s loss function (every step built from it)."""
    try:
        return _EXECUTABLES.setdefault(spec.loss_fn, {})
    except TypeError:  # a loss that cannot be weakly referenced: no sharing across steps
        return {}


def program_key(
    tag: str, plan: Plan, spec: sums.LossSpec, devices: Any, args: Any, *extra
) -> tuple:
    """Everything a compiled program depends on (``extra``: e.g. the batch loss function)."""
    leaves, treedef = jax.tree.flatten(args)
    avals = tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves)
    return (
        tag,
        *extra,
        programs.CANONICAL_DOTS,
        group_reduce.fixed_order(),
        canonical_dots.exact(),
        canonical_dots.pinned_level(),
        spec.weighted,
        spec.has_aux,
        plan.structure,
        plan.params_flat,
        plan.sums_flat,
        plan.local_specs,
        plan.group_axes,
        plan.chunk_axes,
        plan.canonical_blocks,
        blocked_chunk.ENABLED,
        devices.shape,
        tuple(d.id for d in devices.flat),
        treedef,
        avals,
    )


def compile_groups(
    cache: dict,
    plan: Plan,
    spec: sums.LossSpec,
    local_groups: list[int],
    fns: dict,
    args: dict,
    tag: str,
) -> dict:
    """Each local group's program ``fns[g]`` for ``args[g]``, compiled once per distinct one
    (``cache``: the loss function's programs, :func:`shared`; keys from :func:`program_key`).

    Traces here (the caller's JAX settings apply). Groups of the same size all
    run the same program: it is compiled for the first such group's devices and
    loaded onto the others' (:mod:`.relocate`), the same machine code.
    """
    keys = {g: program_key(tag, plan, spec, plan.group_devices(g), args[g]) for g in local_groups}
    todo = [g for g in local_groups if keys[g] not in cache]
    by_size: dict[Any, list[int]] = {}  # groups of the same size run the same program
    for g in todo:
        devices = plan.group_devices(g)
        # A group spread over processes is compiled for its own devices, by every process
        # it spans (the same call in each; an executable cannot be loaded onto devices
        # another process drives).
        spread = placement.spans_processes(devices)
        by_size.setdefault(("spread", g) if spread else devices.size, []).append(g)
    first = [groups[0] for groups in by_size.values()]
    lowered = {g: programs.lower_chunk(fns[g], args[g], plan.group_devices(g).flat) for g in first}
    if lowered:
        with compiling(len(todo)), concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
            compiled = pool.map(
                lambda low: low[0].compile(compiler_options=low[1]), lowered.values()
            )
            done = dict(zip(lowered, compiled, strict=True))
            for g, compiled in done.items():
                programs.check_chunk(compiled, lowered[g][1])
                memory.check(compiled, memory.bitwise_fix(plan.chunk))
                cache[keys[g]] = compiled
            for head, *rest in by_size.values():
                for g in rest:
                    cache[keys[g]] = _relocated(
                        fns[g], done[head], plan, g, lowered[head][1], args[g]
                    )
    return {g: cache[keys[g]] for g in local_groups}


def _relocated(fn, compiled, plan: Plan, g: int, options, args) -> Any:
    """Group ``g``'s program: ``compiled`` loaded onto its devices, else compiled for them."""
    devices = plan.group_devices(g)
    try:
        if devices.size == 1:
            return relocate.Relocated(compiled, devices.flat[0], options)
        return relocate.Relocated(compiled, options=options, mesh=plan.group_mesh(g))
    except Exception:  # a runtime that cannot load it there: compile it for the devices
        low = programs.lower_chunk(fn, args, list(devices.flat))
        return low[0].compile(compiler_options=low[1])


@contextlib.contextmanager
def compiling(groups: int):
    """A spinner on an interactive terminal while the first call compiles (it can take a while)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    message = f"unsplit: compiling the bitwise step's chunk program ({groups} device group(s))"
    with Console(stderr=True).status(message):
        yield
