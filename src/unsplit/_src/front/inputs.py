"""A step's input checks: every call's (on the host, no device work) and the first call's.

Every call: ``frozen`` given exactly when the user's functions take it, no
bitwise step inside ``jax.jit``, the batch's shapes and the schedule, the key,
the ids. The first call also audits the loss on one example (``audit=``) and,
with several processes, agrees on settings, params, key and rows, so a
mistake on one process raises on every process before any work.
"""

from __future__ import annotations

from typing import Any

import jax

from unsplit._src import frozen as frozen_lib
from unsplit._src import keys as keys_lib
from unsplit._src.audit import finding as audit_finding
from unsplit._src.audit import loss as audit_loss
from unsplit._src.processes import agreement
from unsplit._src.step import validate
from unsplit._src.trees import canonical_dtype


class Inputs:
    """The checks of one :class:`~unsplit._src.front.value_and_grad.Step`'s inputs."""

    def __init__(self, step: Any):
        self.step = step
        self._agreed = False  # several processes: agreed on the first call
        self._audited = False
        self._frozen_checked: set[bool] = set()

    def check(
        self,
        params: Any,
        batch: Any,
        key: jax.Array,
        ids: Any,
        frozen: Any,
        *,
        audit=True,
        step: Any = None,
    ) -> Any:
        """Checks a call's inputs (``step``: the step number, checked by the caller); returns
        the ids as the step's engine takes them."""
        self._frozen(frozen)
        if self.step.bitwise:
            validate.refuse_bitwise_in_jit(params, batch, key, ids, frozen, step)
        ids = self._agreed_ids(params, batch, key, ids, frozen, step)
        if audit:
            self._audit(params, batch, key, frozen)
        return ids

    def _frozen(self, frozen: Any) -> None:
        """The user's functions take ``frozen`` last exactly when it is given (checked once)."""
        given = frozen is not None
        if given in self._frozen_checked:
            return
        if self.step.batch_loss is not None:
            frozen_lib.check_arity(
                self.step.loss_fn, "features_fn", "params, example, key", 3, given
            )
            frozen_lib.check_arity(self.step.batch_loss, "batch_loss", "params, features", 2, given)
        else:
            frozen_lib.check_arity(self.step.loss_fn, "loss_fn", "params, example, key", 3, given)
        self._frozen_checked.add(given)

    def _agreed_ids(
        self, params: Any, batch: Any, key: jax.Array, ids: Any, frozen: Any = None, step=None
    ) -> Any:
        """Validates the inputs; on a multi-process first call, also agrees on them.

        Shapes, dtypes and the schedule are checked on the host (no device
        work). On a multi-process first call the processes also agree on the
        settings, params, key and batch (one small collective), so a mistake on
        one process raises on all of them before any work; inside the caller's
        jit that comparison happens on device instead (see
        :mod:`unsplit._src.step.default`). Returns the ids as the engine takes them.
        """
        traced = validate.is_traced(params, batch, key, ids, step)
        if self._agreed or not agreement.needed() or traced:
            return self._validated(batch, key, ids)
        what = f"the first call of {self.step!r}"
        with agreement.agreeing(what, fixes=agreement.STEP_FIXES) as items:
            ids = self._validated(batch, key, ids)
            settings = self.step.settings()
            items.update(
                agreement.step_items(settings, params, batch, key, ids, frozen=frozen, step=step)
            )
        self._agreed = True
        return ids

    def _validated(self, batch: Any, key: jax.Array, ids: Any) -> Any:
        batch_size = validate.batch_size(batch)
        # Bitwise mode computes one chunk at a time whatever the microbatches: they never
        # make it refuse (its own check is that each device's share is whole chunks).
        microbatches = 1 if self.step.bitwise else self.step.microbatches
        validate.check_schedule(
            batch_size, self.step.num_devices, microbatches, self.step.batch_axes
        )
        if self.step.mesh is None:
            validate.check_single_device_batch(batch)
        keys_lib.check_key(key)
        return validate.ids_words(ids, batch_size)

    def _audit(self, params: Any, batch: Any, key: jax.Array, frozen: Any = None) -> None:
        """First call: trace the loss on one example and refuse schedule-dependent noise."""
        if self._audited:
            return
        example = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], canonical_dtype(x.dtype)), batch
        )
        kinds = None if self.step.audit else ("foreign_key",)
        findings = audit_loss.audit_loss(
            self.step.loss_fn,
            params,
            example,
            key,
            weighted=self.step.weighted,
            kinds=kinds,
            frozen=frozen,
        )
        errors = (
            {f.kind for f in findings} - {"audit_error"} if self.step.audit else {"foreign_key"}
        )
        audit_finding.raise_for(findings, kinds=errors)
        self._audited = True
