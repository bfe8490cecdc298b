"""Frozen inputs: a pytree every example's loss needs that is not trained.

A text encoder, a VAE, a LoRA base model: ``step(params, batch, key,
frozen=frozen)`` calls ``loss_fn(params, example, key, frozen)``. Inside the
step, params and frozen travel together as one :class:`WithFrozen` pytree, so
frozen arrays take every path the params take -- jit arguments with their own
shardings in default mode; packed, gathered and placed on each device group
like params in bitwise mode -- and are never constants of a compiled
program. :meth:`unsplit._src.step.sums.Params.split` marks frozen leaves as
not differentiated: no backward pass reaches them (they are not the
differentiated argument, which ``stop_gradient`` alone would not avoid), and
the grads have the params' structure only.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WithFrozen:
    """Params and frozen inputs as one pytree (params' leaves first)."""

    params: Any
    frozen: Any


def combine(params: Any, frozen: Any) -> Any:
    """``params`` alone without frozen inputs, else both as one :class:`WithFrozen`."""
    return params if frozen is None else WithFrozen(params, frozen)


def params_of(tree: Any) -> Any:
    """The params part of a combined tree (its grads too); ``tree`` itself otherwise."""
    return tree.params if isinstance(tree, WithFrozen) else tree


def frozen_of(tree: Any) -> Any:
    return tree.frozen if isinstance(tree, WithFrozen) else None


def call(fn: Callable, params: Any, *args: Any) -> Any:
    """``fn(params, *args)``, or ``fn(params, *args, frozen)`` for combined params."""
    if isinstance(params, WithFrozen):
        return fn(params.params, *args, params.frozen)
    return fn(params, *args)


def bound(fn: Callable) -> Callable:
    """``fn(params, example, key, frozen)`` as a function of combined params."""

    def with_frozen(params, example, key):
        return call(fn, params, example, key)

    return with_frozen


def frozen_leaf_count(params: Any) -> int | None:
    """How many leaves of a combined tree are params' (the rest are frozen); ``None``
    for a params tree alone."""
    if not isinstance(params, WithFrozen):
        return None
    return len(jax.tree.leaves(params.params))


def check_arity(fn: Callable, name: str, signature: str, count: int, frozen_given: bool) -> None:
    """A clear TypeError when ``fn`` cannot take the frozen argument it will get (or
    needs one it will not get). ``count``: its arguments without frozen.

    Functions whose signature cannot be read (builtins, some C callables) pass.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    takes = _binds(sig, count + 1)
    if frozen_given and not takes:
        raise TypeError(
            f"frozen= was given, so {name} is called as {name}({signature}, frozen); expected "
            f"a function that takes {count + 1} positional arguments, got {name}{sig}. Fix: "
            f"add frozen as its last parameter, def {name}({signature}, frozen), or drop "
            "frozen= and close over nothing the step should not compile in."
        )
    if not frozen_given and not _binds(sig, count) and takes:
        raise TypeError(
            f"{name}{sig} needs a frozen argument, but the step was called without frozen=; "
            f"expected {name}({signature}). Fix: pass the frozen inputs, step(params, batch, "
            "key, frozen=frozen), or drop the last parameter."
        )


def _binds(sig: inspect.Signature, count: int) -> bool:
    try:
        sig.bind(*range(count))
    except TypeError:
        return False
    return True
