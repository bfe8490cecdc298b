"""``jax.jit`` for pytrees that hold more than arrays, as ``eqx.filter_jit`` does.

An Equinox model keeps its activation function (or a string, an int
setting) among its leaves; ``jax.jit`` refuses such a leaf as an argument.
:class:`ArrayJit` traces only the array leaves (and Python numbers, as
``jax.jit`` does) and holds the other leaves static: one compiled program per
distinct set of them, and outputs may hold them too. Arguments of plain
arrays take ``jax.jit`` itself, unchanged.

Example:
    >>> import jax.numpy as jnp
    >>> from unsplit._src.front.array_jit import ArrayJit
    >>> model = {"w": jnp.ones(3), "act": jnp.tanh}
    >>> step = ArrayJit(lambda m, x: ({**m, "w": m["act"](m["w"] * x)}, m["w"].sum()))
    >>> new, total = step(model, 2.0)
    >>> new["act"] is jnp.tanh, float(total)
    (True, 3.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import numpy as np

_TRACEABLE = (jax.Array, np.ndarray, np.generic, int, float, complex)
# Leaf types seen to be traceable: a set lookup per leaf on later calls instead of an
# isinstance against jax.Array (an ABC), which cost microseconds per leaf on every call
# of a train step (measured: most of its host time, for params and optimizer state).
_traceable_types: set[type] = set()


def is_static(x: Any) -> bool:
    """A leaf ``jax.jit`` cannot trace: not an array, a NumPy scalar or a Python number."""
    kind = type(x)
    if kind in _traceable_types:
        return False
    if isinstance(x, _TRACEABLE):
        _traceable_types.add(kind)
        return False
    return True


class ArrayJit:
    """``jax.jit(fn, donate_argnums=...)``, with non-array leaves static."""

    def __init__(
        self,
        fn: Callable,
        donate_argnums: Sequence[int] = (),
        check: Callable[[Any], None] | None = None,
    ):
        """``check``: called with the compiled program of each new input signature before it
        runs (compiled then, once: the call reuses it); it may raise to refuse the program."""
        self.fn = fn
        self.donate_argnums = tuple(donate_argnums)
        self.check = check
        self._checked: set = set()  # the signatures whose programs were checked
        self.plain = jax.jit(fn, donate_argnums=self.donate_argnums)
        self._filtered: dict[Any, tuple[Callable, dict]] = {}
        self._seen_static = False  # whether a call had a non-array leaf

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._seen_static:
            # Arrays only (Flax, optax: every call of most train steps): straight to
            # ``jax.jit``, which flattens the arguments itself, so the host does no more
            # per call than the user's own jitted step. A non-array leaf makes ``jax.jit``
            # raise before anything runs or is donated; from then on, the filtered path.
            try:
                return self._run(self.plain, args, kwargs)
            except TypeError:
                if not any(is_static(x) for x in jax.tree.leaves((args, kwargs))):
                    raise
                self._seen_static = True
        leaves, treedef = jax.tree.flatten((args, kwargs))
        static = tuple((i, x) for i, x in enumerate(leaves) if is_static(x))
        if not static:
            return self._run(self.plain, args, kwargs)
        donated = self._donated(args, kwargs, len(leaves))
        try:
            entry = self._filtered.get((treedef, static, donated))
        except TypeError:
            kinds = sorted({type(x).__name__ for _, x in static})
            raise TypeError(
                f"a leaf that is not an array must be hashable to be compiled in; got leaves of "
                f"type {kinds}. Fix: make it an array, or mark it static in your module "
                "(eqx.field(static=True))."
            ) from None
        if entry is None:
            entry = self._compile(treedef, static, donated, len(leaves))
            self._filtered[(treedef, static, donated)] = entry
        jitted, out = entry
        arrays = [x for i, x in enumerate(leaves) if not is_static(x)]
        mask = self._mask(leaves, donated)
        gift = [x for x, d in zip(arrays, mask, strict=True) if d]
        kept = [x for x, d in zip(arrays, mask, strict=True) if not d]
        out_arrays = iter(self._run(jitted, (gift, kept), {}, kept))
        out_def, out_static = out["def"], dict(out["static"])
        return jax.tree.unflatten(
            out_def,
            [
                out_static[j] if j in out_static else next(out_arrays)
                for j in range(out_def.num_leaves)
            ],
        )

    def _run(self, jitted, args: tuple, kwargs: dict, kept=None) -> Any:
        """``jitted(*args, **kwargs)``; with ``check``, each new signature's program is
        compiled (``lower().compile()``, which the call then reuses) and checked first.

        The signature is the structure, shapes and dtypes of the arguments that are not
        donated (the batch, the key): a few leaves, cheap on every call, not the params and
        optimizer state, which a train step passes back as it got them (a layout of theirs
        new to ``jax.jit`` compiles unchecked).
        """
        if self.check is None:
            return jitted(*args, **kwargs)
        if kept is None:
            kept = ([a for i, a in enumerate(args) if i not in self.donate_argnums], kwargs)
        kept_leaves, kept_def = jax.tree.flatten(kept)
        signature = (kept_def, tuple((np.shape(x), _dtype(x)) for x in kept_leaves))
        # Inside another jit nothing is compiled here: the caller's program is.
        if signature not in self._checked and not any(
            isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))
        ):
            self.check(jitted.lower(*args, **kwargs).compile())
            self._checked.add(signature)
        return jitted(*args, **kwargs)

    def _donated(self, args: tuple, kwargs: dict, count: int) -> tuple[int, ...]:
        """The leaf indices that come from the donated positional arguments."""
        donated, start = [], 0
        for position, arg in enumerate(args):
            n = len(jax.tree.leaves(arg))
            if position in self.donate_argnums:
                donated.extend(range(start, start + n))
            start += n
        return tuple(donated)

    @staticmethod
    def _mask(leaves: list, donated: tuple[int, ...]) -> list[bool]:
        chosen = set(donated)
        return [i in chosen for i, x in enumerate(leaves) if not is_static(x)]

    def _compile(self, treedef, static, donated, count) -> tuple[Callable, dict]:
        fixed = dict(static)
        chosen = set(donated)
        out: dict[str, Any] = {}

        def inner(gift, kept):
            gift, kept = iter(gift), iter(kept)
            leaves = [
                fixed[i] if i in fixed else next(gift) if i in chosen else next(kept)
                for i in range(count)
            ]
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            result, out_def = jax.tree.flatten(self.fn(*args, **kwargs))
            out["def"] = out_def
            out["static"] = tuple((j, x) for j, x in enumerate(result) if is_static(x))
            return [x for x in result if not is_static(x)]

        return jax.jit(inner, donate_argnums=0), out


def _dtype(x: Any) -> Any:
    """A leaf's dtype (key dtypes included), or its type (a Python number, a static leaf)."""
    dtype = getattr(x, "dtype", None)
    return dtype if dtype is not None else type(x)


def without_static(tree: Any) -> Any:
    """``tree`` with its non-array leaves as ``None`` (for a function that needs none)."""
    return jax.tree.map(lambda x: None if is_static(x) else x, tree)


def with_static(stripped: Any, like: Any) -> Any:
    """``stripped`` (from :func:`without_static`) with ``like``'s non-array leaves back."""
    leaves, treedef = jax.tree.flatten(like)
    new = jax.tree.leaves(stripped, is_leaf=lambda x: x is None)
    return jax.tree.unflatten(
        treedef, [old if is_static(old) else x for x, old in zip(new, leaves, strict=True)]
    )
