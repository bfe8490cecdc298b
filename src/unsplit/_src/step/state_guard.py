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
from typing import Any

import jax

from unsplit._src import links
from unsplit._src.audit import state as audit_state


class DroppedStateError(ValueError):
    """A layer updated state inside the per-example loss; the update would be lost."""


class _Guard:
    """The audit's state recorder (:mod:`unsplit._src.audit.state`), turned into an error."""

    def __init__(self, params: Any):
        self.recorder = audit_state.Recorder()
        self.snapshot = self.recorder.nnx_snapshot(params)

    def check(self, returned: Any = None) -> None:
        """Raises on an update the call dropped; one it ``returned`` (e.g. in aux) is kept."""
        self.recorder.nnx_updates(self.snapshot)
        kept = {id(x) for x in jax.tree.leaves(returned)}
        dropped = [u for u in self.recorder.updates if id(u.value) not in kept]
        linen = [u for u in dropped if u.kind == "linen"]
        if linen:
            cls, where = linen[0].owner.split(" at ", 1)  # "BatchNorm at 'BatchNorm_0'"
            collection = linen[0].collection
            raise DroppedStateError(
                f"the {cls} layer {where} updates its {collection!r} collection inside the "
                "per-example loss. unsplit calls loss_fn on ONE example at a time (vmapped), so "
                "the new statistics would come from a single example and the update would be "
                "dropped without a word. Fix: use a per-example normalization (nn.LayerNorm, "
                "nn.GroupNorm, nn.RMSNorm), or freeze the statistics (BatchNorm("
                "use_running_average=True), and do not pass mutable=[...] to apply); for "
                "statistics over the batch (ghost batches, running averages of the global "
                "batch), make a group of rows one example and pool the statistics with "
                "unsplit.value_and_grad(features_fn, batch_loss=...) ("
                + links.doc_ref("coupled", "recipe-batchnorm-over-fixed-groups-ghost-batches")
                + ")."
            )
        if dropped:
            shown = ", ".join(u.owner for u in dropped[:4])
            more = f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
            raise DroppedStateError(
                f"loss_fn assigned new values to state it received in params ({shown}{more}), "
                "e.g. an NNX BatchNorm updating its running statistics. unsplit calls loss_fn "
                "on ONE example at a time (vmapped) and keeps only what it returns, so the "
                "update would come from a single example and be dropped without a word. Fix: "
                "use a per-example normalization (nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm), "
                "or freeze the statistics (e.g. model.eval() / use_running_average=True for "
                "BatchNorm)."
            )


@contextlib.contextmanager
def watch(params: Any, layout: Any = None):
    """Watches one call of the loss (at trace time); ``guard.check()`` raises on a dropped update."""
    del layout
    guard = _Guard(params)
    with guard.recorder.linen():
        yield guard
