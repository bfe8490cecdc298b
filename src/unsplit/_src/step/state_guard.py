"""Stateful layers inside a per-example loss: a clear error instead of a silently dropped update.

``value_and_grad`` calls the loss on ONE example at a time (under ``vmap``) and
keeps only what it returns. A layer that updates state while computing the
loss -- BatchNorm's running statistics (a Flax linen mutable collection such as
``batch_stats``, or an NNX ``BatchStat`` variable), any NNX variable assigned
inside the loss -- would compute that state from one example and the update
would be lost without a word. This module watches the loss while it is traced
(never at run time) and raises, naming the layer and the fix.

What counts as an update: an existing floating-point variable whose value was
replaced during the call. Not counted: PRNG state (keys and counters, which
``unsplit`` reseeds per example), integer counters, and variables created
during the call (``sow`` into a new collection, e.g. ``intermediates``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import jax
import jax.numpy as jnp

_IGNORED_COLLECTIONS = ("params", "intermediates")


class DroppedStateError(ValueError):
    """A layer updated state inside the per-example loss; the update would be lost."""


def _inexact_leaves(tree: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for path, leaf in flat:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
            out[jax.tree_util.keystr(path)] = leaf
    return out


class _Guard:
    def __init__(self, params: Any):
        self.params = params
        self.before = _inexact_leaves(params)
        self.linen_updates: list[tuple[str, str, str]] = []  # (module path, class, collection)
        self.updated: dict[tuple[str, str, str], list[Any]] = {}  # each update's new values

    def intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        before = _collection_leaves(module)
        out = next_fun(*args, **kwargs)
        after = _collection_leaves(module)
        for (collection, path), leaf in before.items():
            if after.get((collection, path), leaf) is not leaf:
                name = "/".join(module.scope.path) or type(module).__name__
                item = (name, type(module).__name__, collection)
                if item not in self.linen_updates:
                    self.linen_updates.append(item)
                self.updated.setdefault(item, []).append(after[(collection, path)])
        return out

    def check(self, returned: Any = None) -> None:
        """Raises on an update the call dropped; one it ``returned`` (e.g. in aux) is kept."""
        kept = {id(x) for x in jax.tree.leaves(returned)}
        dropped = [
            item
            for item in self.linen_updates
            if not all(id(v) in kept for v in self.updated.get(item, []))
        ]
        if dropped:
            name, cls, collection = dropped[0]
            raise DroppedStateError(
                f"the {cls} layer {name!r} updates its {collection!r} collection inside the "
                "per-example loss. unsplit calls loss_fn on ONE example at a time (vmapped), so "
                "the new statistics would come from a single example and the update would be "
                "dropped without a word. Fix: use a per-example normalization (nn.LayerNorm, "
                "nn.GroupNorm, nn.RMSNorm), or freeze the statistics (BatchNorm("
                "use_running_average=True), and do not pass mutable=[...] to apply); for "
                "statistics over the batch (ghost batches, running averages of the global "
                "batch), make a group of rows one example and pool the statistics with "
                "unsplit.value_and_grad(features_fn, batch_loss=...) (docs/coupled.md, "
                "BatchNorm)."
            )
        after = _inexact_leaves(self.params)
        changed = [path for path, leaf in self.before.items() if after.get(path, leaf) is not leaf]
        if changed:
            shown = ", ".join(f"params{p}" for p in changed[:4])
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            raise DroppedStateError(
                f"loss_fn assigned new values to state it received in params ({shown}{more}), "
                "e.g. an NNX BatchNorm updating its running statistics. unsplit calls loss_fn "
                "on ONE example at a time (vmapped) and keeps only what it returns, so the "
                "update would come from a single example and be dropped without a word. Fix: "
                "use a per-example normalization (nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm), "
                "or freeze the statistics (e.g. model.eval() / use_running_average=True for "
                "BatchNorm)."
            )


def _collection_leaves(module: Any) -> dict[tuple[str, str], Any]:
    out = {}
    for collection, tree in module.variables.items():
        if collection in _IGNORED_COLLECTIONS:
            continue
        for path, leaf in _inexact_leaves(tree).items():
            out[(collection, path)] = leaf
    return out


@contextlib.contextmanager
def watch(params: Any, layout: Any = None):
    """Watches one call of the loss (at trace time); ``guard.check()`` raises on a dropped update."""
    del layout
    guard = _Guard(params)
    # A Flax Linen module in the loss means Flax is imported already; without it there is
    # no Linen state to watch (and unsplit does not import Flax itself: it is an extra).
    linen = sys.modules.get("flax.linen")
    if linen is None:
        yield guard
        return
    with linen.intercept_methods(guard.intercept):
        yield guard
