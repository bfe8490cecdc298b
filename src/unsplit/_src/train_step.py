"""``bitwise_train_step``: one call per training step, optimizer included, buffers donated.

A bitwise step cannot run inside ``jax.jit`` (its chunk programs are compiled
on their own; see ``docs/bitwise.md``), so the usual "jit the whole train
step" does not apply to it. ``bitwise_train_step`` gives the same thing: the
step's ``(loss, grads)``, then the optimizer update as one compiled program
with the params and optimizer state donated. The host work per call does not
grow with the number of parameters: when it gets back the params it returned,
it skips looking at their shardings again.

It also takes a default-mode step; then the whole train step is one jitted,
donated function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from unsplit._src.step import validate
from unsplit._src.value_and_grad import Step


def train_step(step: Step, optimizer: optax.GradientTransformation) -> Callable:
    """A train function for ``step``: ``train(params, opt_state, batch, key, ids=None)``.

    Args:
        step: a step made by :func:`unsplit.value_and_grad` (usually with
            ``bitwise=True``).
        optimizer: an ``optax.GradientTransformation``. Params leaves without a
            gradient (integer leaves, PRNG state: ``None`` in the grads) are
            left as they are; init the optimizer on the float leaves, e.g.
            ``optimizer.init(eqx.filter(model, eqx.is_inexact_array))``, or on
            the params themselves when they are all float (Flax variables).

    Returns:
        ``train(params, opt_state, batch, key, ids=None) -> (loss, params,
        opt_state)`` (``((loss, aux), params, opt_state)`` with
        ``has_aux=True``). ``params`` and ``opt_state`` are donated: do not
        use the arrays you passed in after the call.

    Example:
        >>> import jax, jax.numpy as jnp, optax, unsplit
        >>> def loss_fn(w, x, key):
        ...     keep = jax.random.bernoulli(key, 0.9, x.shape)
        ...     return jnp.sum(jnp.where(keep, x, 0.0) @ w) ** 2
        >>> step = unsplit.value_and_grad(loss_fn, bitwise=True)
        >>> optimizer = optax.sgd(1e-3)
        >>> train = unsplit.train_step(step, optimizer)
        >>> w = jnp.ones((3, 2))
        >>> state = optimizer.init(w)
        >>> loss, w, state = train(w, state, jnp.ones((8, 3)), jax.random.key(0))
        >>> w.shape
        (3, 2)
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"step must be made by unsplit.value_and_grad; got {type(step).__name__}. "
            "Fix: step = unsplit.value_and_grad(loss_fn, bitwise=True, ...)."
        )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation (with init and update); got "
            f"{type(optimizer).__name__}. Fix: e.g. optimizer = optax.adam(1e-3)."
        )

    def update(params, opt_state, grads):
        trainable = jax.tree.map(
            lambda g, p: None if g is None else p, grads, params, is_leaf=lambda x: x is None
        )
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(params, updates), opt_state

    if not step.bitwise:

        def fused(params, opt_state, batch, key, ids=None):
            out, grads = step(params, batch, key, ids)
            params, opt_state = update(params, opt_state, grads)
            return out, params, opt_state

        return jax.jit(fused, donate_argnums=(0, 1))

    return _BitwiseTrain(step, jax.jit(update, donate_argnums=(0, 1)))


class _BitwiseTrain:
    """The bitwise step (outside jit), then the compiled, donated update."""

    def __init__(self, step: Step, update: Callable):
        self.step = step
        self.update = update
        self._returned: Any = None  # the params this function returned last
        self._state: Any = None

    def __call__(self, params, opt_state, batch, key, ids: Any = None):
        step = self.step
        ids = step.check_inputs(params, batch, key, ids)
        signature = (jax.tree.structure(batch), tuple(x.shape for x in jax.tree.leaves(batch)))
        if params is not self._returned or self._state is None or self._state[0] != signature:
            state, params = step.engine.prepare(params, batch, key)
            self._state = (signature, state)
        loss, grads, aux, weight = self._state[1].run(params, batch, key, ids)
        if step.checked:
            validate.check_result(loss, weight)
        params, opt_state = self.update(params, opt_state, grads)
        self._returned = params
        out = (loss, aux) if step.has_aux else loss
        return out, params, opt_state


#: The name this function had first; the same function (both modes).
bitwise_train_step = train_step
