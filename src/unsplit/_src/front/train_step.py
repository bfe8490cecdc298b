"""``train_step`` (also ``bitwise_train_step``): one call per training step, optimizer included.

A bitwise step cannot run inside ``jax.jit`` (its chunk programs are compiled
on their own; see the Bitwise mode guide, https://unsplit.readthedocs.io/en/latest/bitwise/), so the usual "jit the whole train
step" does not apply to it. ``bitwise_train_step`` gives the same thing: the
step's ``(loss, grads)``, then the optimizer update as one compiled program
(on copies of the params and optimizer state: not donated). The host work per call does not
grow with the number of parameters: when it gets back the params it returned,
it skips looking at their shardings again.

It also takes a default-mode step; then the whole train step is one jitted,
donated function. Both modes take the params and optimizer state as two trees,
or a Flax ``TrainState`` (any struct with ``params``, ``opt_state``, ``tx``,
``step`` and ``replace``) as one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import numpy as np
import optax

from unsplit._src import keys as keys_lib
from unsplit._src.bitwise.step import BitwiseStep
from unsplit._src.bitwise.update import CanonicalUpdate, GroupedUpdate
from unsplit._src.front.array_jit import ArrayJit, with_static, without_static
from unsplit._src.front.value_and_grad import Step
from unsplit._src.step import memory
from unsplit._src.step.sums import is_inexact_array


def train_step(step: Step, optimizer: optax.GradientTransformation | None = None) -> Callable:
    """A train function for ``step``: ``train(params, opt_state, batch, key, ids=None)``.

    Or, for a Flax ``flax.training.train_state.TrainState``, ``train(state, batch,
    key, ids=None) -> (loss, state)``: the update uses the state's own ``tx`` and
    the new state has ``step + 1``, as ``state.apply_gradients(grads=grads)``
    gives.

    Args:
        step: a step made by :func:`unsplit.value_and_grad` (usually with
            ``bitwise=True``).
        optimizer: an ``optax.GradientTransformation``; omit it when you pass a
            ``TrainState`` (its ``tx`` is the optimizer). Params leaves without a
            gradient (integer leaves, PRNG state, non-array leaves: ``None``
            in the grads) are left as they are; init the optimizer on the float
            leaves, ``optimizer.init(unsplit.trainable(params))`` (for Equinox
            the same as ``eqx.filter(model, eqx.is_inexact_array)``), or on the
            params themselves when they are all float (Flax linen variables).

    Returns:
        ``train(params, opt_state, batch, key, ids=None) -> (loss, params,
        opt_state)`` (``((loss, aux), params, opt_state)`` with
        ``has_aux=True``), or ``train(state, batch, key, ids=None) -> (loss,
        state)``. In default mode ``params`` and ``opt_state`` (or the state) are
        donated: do not use the arrays you passed in after the call. In bitwise
        mode they are not: the update runs on copies gathered onto one device per
        process (with ``chunk_axes``, on each group's shards), and the arrays you
        passed in stay valid until you drop them. Both forms take
        ``frozen=`` (keyword): frozen inputs passed to the step
        (``loss_fn(params, example, key, frozen)``); the optimizer sees the
        params only, and ``frozen`` is never donated. Both take ``step=``
        (keyword): the step number (an int, or ``state.step``), folded into
        ``key`` inside the compiled program, the bits of passing
        ``jax.random.fold_in(key, step)`` without a host dispatch per step:
        the recommended loop is ``train(params, opt_state, batch, key, step=i)``
        with one ``key`` for the run (placed on the mesh once).

        Default mode is one ``jax.jit``: params and optimizer state that are not on
        the step's mesh yet (fresh ``jnp`` arrays) come back placed on it, so the
        second call compiles once more, as any jitted train step would; place them
        on the mesh before the loop (``jax.device_put(params, NamedSharding(mesh,
        P()))``, or your FSDP specs) to compile once.

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
        >>> key = jax.random.key(0)
        >>> for i in range(2):  # the step key is fold_in(key, i), made inside the program
        ...     loss, w, state = train(w, state, jnp.ones((8, 3)), key, step=i)
        >>> w.shape
        (3, 2)

        With Flax's ``TrainState`` (its own ``tx``; ``step`` counts the updates):

        >>> from flax.training import train_state
        >>> state = train_state.TrainState.create(apply_fn=None, params=w, tx=optimizer)
        >>> train = unsplit.train_step(step)
        >>> loss, state = train(state, jnp.ones((8, 3)), jax.random.key(1))
        >>> int(state.step)
        1
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"step must be made by unsplit.value_and_grad; got {type(step).__name__}. "
            "Fix: step = unsplit.value_and_grad(loss_fn, bitwise=True, ...)."
        )
    if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation (with init and update); got "
            f"{type(optimizer).__name__}. Fix: e.g. optimizer = optax.adam(1e-3)."
        )

    def update(params, opt_state, grads, tx=optimizer):
        with_grads = jax.tree.map(
            lambda g, p: None if g is None else p, grads, params, is_leaf=lambda x: x is None
        )
        assert tx is not None  # a TrainState's own tx, or the optimizer train_step was given
        updates, opt_state = tx.update(grads, opt_state, with_grads)
        # A leaf without a gradient has no update: it stays as it is (optax.apply_updates
        # would add None to it).
        params = jax.tree.map(
            lambda u, p: p if u is None else optax.apply_updates(p, u),
            updates,
            params,
            is_leaf=lambda x: x is None,
        )
        return params, opt_state

    def update_state(state, grads):
        params, opt_state = update(state.params, state.opt_state, grads, tx=state.tx)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

    if not step.bitwise:
        value_and_grad = step  # the keyword ``step`` below is the step number

        def fused(params, opt_state, batch, key, ids=None, frozen=None, step=None):
            out, grads = value_and_grad(params, batch, key, ids, frozen=frozen, step=step)
            params, opt_state = update(params, opt_state, grads)
            return out, params, opt_state

        def fused_state(state, batch, key, ids=None, frozen=None, step=None):
            out, grads = value_and_grad(state.params, batch, key, ids, frozen=frozen, step=step)
            return out, update_state(state, grads)

        # The whole train step is one program: refuse it, before it runs, when it needs
        # more memory than the devices have free (the step's own check is inside it).
        def check(compiled):
            memory.check(compiled, memory.default_fix(step.microbatches))

        return _Train(
            step,
            optimizer,
            ArrayJit(fused, donate_argnums=(0, 1), check=check),
            ArrayJit(fused_state, donate_argnums=(0,), check=check),
            placed_key=_PlacedKey(step.mesh),
        )

    # Bitwise: the update too is one program whatever the schedule: on whole arrays, or, with
    # FSDP groups (chunk_axes), on each group's shards (its sums over a split dimension per
    # canonical block, so groups of every size dividing the blocks give the same bits, as the
    # step's chunks do).
    bitwise = _BitwiseTrain(step)
    mesh = _bitwise_mesh(step)
    groups = tuple(a for a in cast(BitwiseStep, step._engine).chunk_axes if mesh.shape[a] > 1)

    def canonical(fn, outputs):
        if groups:
            return GroupedUpdate(fn, mesh, outputs=outputs, axes=groups)
        return CanonicalUpdate(fn, mesh, outputs=outputs)

    return _Train(
        step,
        optimizer,
        functools.partial(bitwise, canonical(update, 2)),
        functools.partial(
            bitwise.with_state,
            canonical(lambda state, grads: (update_state(state, grads),), 1),
        ),
    )


def _bitwise_mesh(step: Step) -> jax.sharding.Mesh:
    """A bitwise step's mesh (a one-device mesh for ``mesh=None``: it always has one)."""
    mesh = cast(BitwiseStep, step._engine).layout.mesh
    assert mesh is not None
    return mesh


def trainable(params: Any) -> Any:
    """``params`` with ``None`` at every leaf that gets no gradient: init the optimizer on it.

    A step's grads are ``None`` at integer leaves (counters, NNX ``Rngs`` counts), PRNG
    keys, Python numbers and non-array leaves (an Equinox activation function); an optax
    state made from ``trainable(params)`` has the same structure, so
    :func:`train_step` updates the float leaves and leaves the rest as they are. For
    Equinox it is ``eqx.filter(params, eqx.is_inexact_array)``; it works on any pytree
    (Flax NNX modules included).

    Example:
        >>> import jax.numpy as jnp, optax, unsplit
        >>> params = {"w": jnp.ones(2), "count": jnp.int32(0), "act": jnp.tanh}
        >>> unsplit.trainable(params)
        {'act': None, 'count': None, 'w': Array([1., 1.], dtype=float32)}
        >>> state = optax.adam(1e-3).init(unsplit.trainable(params))
    """
    return jax.tree.map(lambda x: x if is_inexact_array(x) else None, params)


def is_train_state(x: Any) -> bool:
    """Whether ``x`` is a Flax ``TrainState`` (or a struct with the same fields)."""
    return all(hasattr(x, name) for name in ("params", "opt_state", "tx", "step", "replace"))


class _Train:
    """``train(params, opt_state, batch, key, ids=None)`` or ``train(state, batch, key, ids=None)``."""

    def __init__(
        self, step: Step, optimizer, with_trees: Callable, with_state: Callable, placed_key=None
    ):
        self.step = step
        self.optimizer = optimizer
        self.with_trees = with_trees
        self.with_state = with_state
        self.placed_key = placed_key  # default mode: the step key on the mesh (_PlacedKey)

    def __call__(self, *args, **kwargs):
        with memory.hint(self.step):  # the first call's compiles and transfers too
            return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        if kwargs.get("step") is not None:  # one type for every step number: no retrace
            kwargs["step"] = keys_lib.step_number(kwargs["step"])
        position = 2 if args and is_train_state(args[0]) else 3
        if self.placed_key is not None and len(args) > position:
            args = (*args[:position], self.placed_key(args[position]), *args[position + 1 :])
        if args and is_train_state(args[0]):
            state = args[0]
            if self.optimizer is not None and state.tx is not self.optimizer:
                raise ValueError(
                    "train_step was given an optimizer and the TrainState has another tx. "
                    "Fix: pass one of them: unsplit.train_step(step) uses state.tx."
                )
            if len(args) + len(kwargs) - ("frozen" in kwargs) - ("step" in kwargs) not in (3, 4):
                raise TypeError(
                    "with a TrainState, call train(state, batch, key, ids=None) (and frozen=..., "
                    f"step=...); got {len(args)} positional and {len(kwargs)} keyword arguments."
                )
            return self.with_state(*args, **kwargs)
        if self.optimizer is None:
            got = type(args[0]).__name__ if args else "no arguments"
            raise TypeError(
                "this train function was made without an optimizer, so it takes a TrainState "
                f"(params, opt_state, tx, step); got {got}. Fix: unsplit.train_step(step, "
                "optimizer) to call train(params, opt_state, batch, key), or pass a "
                "flax.training.train_state.TrainState."
            )
        return self.with_trees(*args, **kwargs)


class _BitwiseTrain:
    """The bitwise step (outside jit), then the compiled update."""

    def __init__(self, step: Step):
        self.step = step
        self._returned: Any = None  # the params this function returned last
        self._memo: dict = {}  # the step's programs and placed frozen (BitwiseStep.__call__)
        self._frozen: Any = None  # the frozen given last

    def grads(self, params, batch, key, ids, frozen=None, step=None):
        """The step's (out, grads, params); params (and frozen) re-placed only when new."""
        if params is not self._returned or frozen is not self._frozen:
            self._memo.clear()  # new params or frozen: the step looks at their layout again
        self._frozen = frozen
        result = self.step._run(params, batch, key, ids, frozen=frozen, step=step, memo=self._memo)
        out = (result.loss, result.aux) if self.step.has_aux else result.loss
        return out, result.grads, result.params

    def on_step_mesh(self, tree):
        """On a one-device step, single-device leaves as arrays of the step's mesh.

        The grads come back typed by the step's mesh; putting the params and
        the optimizer state there on the first call gives the update the same
        input types on every call, so nothing is traced twice.
        """
        mesh = _bitwise_mesh(self.step)
        if mesh.size != 1:
            return tree
        sharding = jax.sharding.NamedSharding(mesh, jax.P())

        def place(x):
            if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding):
                return x
            if isinstance(x, int | float):  # TrainState.create's step=0: not weakly typed
                x = np.asarray(x)
            if isinstance(x, jax.Array | np.ndarray | np.generic):
                return jax.device_put(x, sharding)
            return x

        return jax.tree.map(place, tree)

    def __call__(
        self, update, params, opt_state, batch, key, ids: Any = None, *, frozen=None, step=None
    ):
        if params is not self._returned:
            params, opt_state = self.on_step_mesh((params, opt_state))
        out, grads, params = self.grads(params, batch, key, ids, frozen, step)
        # The update needs no non-array leaf (an Equinox module's activation): it gets None.
        new, opt_state = update(without_static(params), opt_state, grads)
        params = with_static(new, params)
        self._returned = params
        return out, params, opt_state

    def with_state(
        self, update_state, state, batch, key, ids: Any = None, *, frozen=None, step=None
    ):
        if state.params is not self._returned:
            state = self.on_step_mesh(state)
        out, grads, params = self.grads(state.params, batch, key, ids, frozen, step)
        if params is not state.params:
            state = state.replace(params=params)
        (state,) = update_state(state, grads)
        self._returned = state.params
        return out, state


class _PlacedKey:
    """The step key on the step's mesh, placed once while the same key object comes back.

    The recommended loop passes one key and the step number (``train(..., key, step=i)``);
    a key made by ``jax.random.key`` lives on one device, and ``jax.jit`` would copy it
    to every device of the mesh on every call. One process only (elsewhere the key goes
    to ``jax.jit`` as given).
    """

    def __init__(self, mesh: jax.sharding.Mesh | None):
        many = mesh is not None and mesh.size > 1
        self.sharding = None
        if mesh is not None and many:
            self.sharding = jax.sharding.NamedSharding(mesh, jax.P())
        self._given: Any = None
        self._placed: Any = None

    def __call__(self, key: Any) -> Any:
        if (
            self.sharding is None
            or not isinstance(key, jax.Array)
            or isinstance(key, jax.core.Tracer)
            or jax.process_count() > 1
            or key.sharding == self.sharding
        ):
            return key
        if key is not self._given:
            self._given, self._placed = key, jax.device_put(key, self.sharding)
        return self._placed


#: The name this function had first; the same function (both modes).
bitwise_train_step = train_step
