"""``value_and_grad``: one training step, whatever the schedule.

The user writes the loss of **one** example with its own key. The step vmaps
it over the examples of a microbatch with ``example_keys(key, ids)``, runs the
microbatches of each device in a ``lax.scan`` (activation memory of one
microbatch), sums loss, weight and gradient over the devices, and divides once
by the global weight. Data parallelism and gradient accumulation are therefore
the same function of ``(params, global batch, ids, key)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from unsplit._src import distributed, validate
from unsplit._src import keys as keys_lib

LossFn = Callable[[Any, Any, jax.Array], Any]


def value_and_grad(
    loss_fn: LossFn,
    *,
    weighted: bool = False,
    microbatches: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    bitwise: bool = False,
    chunk_size: int | None = None,
) -> Step:
    """Makes a schedule-invariant ``(loss, grads)`` step from a one-example loss.

    Args:
        loss_fn: ``loss_fn(params, example, key)`` for ONE example (no batch
            axis) with its own PRNG key. It returns a scalar loss, or with
            ``weighted=True`` a pair ``(loss_sum, weight)`` such as (sum of token
            losses, number of tokens).
        weighted: whether ``loss_fn`` returns ``(loss_sum, weight)``. The step
            loss is ``sum(loss_sum) / sum(weight)`` over the global batch
            (never a mean of microbatch means); unweighted, it is the mean over
            examples. Weights are data: no gradient flows through them.
        microbatches: each device runs its share of the batch as this many
            sequential microbatches (gradient accumulation); the result is the
            same as with 1.
        mesh: a ``jax.sharding.Mesh`` (Explicit or Auto axes, one or several
            processes). The batch is split over the mesh's first axis; params
            and key are replicated. ``None`` runs on the default device.
        bitwise: make loss and grads bit-identical for every (devices,
            microbatches) schedule of the same global batch; see
            :mod:`unsplit._src.bitwise`.
        chunk_size: bitwise mode's fixed unit of work, in examples (default:
            see :func:`unsplit._src.bitwise.default_chunk_size`).

    Returns:
        A :class:`Step`; ``step(params, batch, key, ids=None)`` returns
        ``(loss, grads)``. ``batch`` is a pytree whose leaves all have the
        global batch size ``B`` as leading axis; ``ids`` (shape ``(B,)``,
        default ``arange(B)``) are the examples' global ids.

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> def loss_fn(w, x, key):
        ...     keep = jax.random.bernoulli(key, 0.9, x.shape)
        ...     return jnp.sum((jnp.where(keep, x / 0.9, 0.0) @ w) ** 2)
        >>> w, x, key = jnp.ones((3, 2)), jnp.ones((8, 3)), jax.random.key(0)
        >>> l1, g1 = unsplit.value_and_grad(loss_fn)(w, x, key)
        >>> l4, g4 = unsplit.value_and_grad(loss_fn, microbatches=4)(w, x, key)
        >>> bool(jnp.allclose(l1, l4)) and bool(jnp.allclose(g1, g4))
        True
    """
    return Step(
        loss_fn,
        weighted=weighted,
        microbatches=microbatches,
        mesh=mesh,
        bitwise=bitwise,
        chunk_size=chunk_size,
    )


class Step:
    """A compiled-once ``(loss, grads)`` step; made by :func:`value_and_grad`.

    Calling it validates the inputs on the host (shapes and dtypes only; no
    device work), then runs a function that is traced and compiled once per
    input shapes: later calls with the same shapes reuse the executable.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        *,
        weighted: bool,
        microbatches: int,
        mesh: jax.sharding.Mesh | None,
        bitwise: bool,
        chunk_size: int | None,
    ):
        validate.check_callable(loss_fn)
        validate.check_microbatches(microbatches)
        validate.check_mesh(mesh)
        self.loss_fn = loss_fn
        self.weighted = bool(weighted)
        self.microbatches = int(microbatches)
        self.mesh = mesh
        self.bitwise = bool(bitwise)
        self.chunk_size = chunk_size
        if self.bitwise:
            from unsplit._src import bitwise as bitwise_lib

            self._impl = bitwise_lib.BitwiseStep(self)
        else:
            if chunk_size is not None:
                raise ValueError(
                    f"chunk_size={chunk_size} only applies with bitwise=True; got bitwise=False. "
                    "Fix: drop chunk_size, or pass bitwise=True."
                )
            self._impl = _DefaultStep(self)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", repr(self.loss_fn))
        mesh = None if self.mesh is None else dict(self.mesh.shape)
        return (
            f"Step({name}, weighted={self.weighted}, microbatches={self.microbatches}, "
            f"mesh={mesh}, bitwise={self.bitwise})"
        )

    @property
    def num_devices(self) -> int:
        """How many shares the global batch is split into (the mesh's first axis)."""
        return 1 if self.mesh is None else int(self.mesh.shape[self.mesh.axis_names[0]])

    def __call__(
        self, params: Any, batch: Any, key: jax.Array, ids: Any = None
    ) -> tuple[jax.Array, Any]:
        batch_size = validate.batch_size(batch)
        validate.check_schedule(batch_size, self.num_devices, self.microbatches, self.mesh)
        keys_lib.check_key(key)
        if jax.process_count() > 1 and not isinstance(key, jax.core.Tracer):
            distributed.check_same_key(key)
        ids = validate.ids_words(ids, batch_size)
        return self._impl(params, batch, key, ids)


def per_example_loss(step: Step) -> Callable[[Any, Any, jax.Array], tuple[jax.Array, jax.Array]]:
    """The user's loss as ``(loss_sum, weight)`` in float32, checked at trace time."""

    def fn(params, example, key):
        out = step.loss_fn(params, example, key)
        return validate.loss_output(out, step.weighted)

    return fn


def microbatch_sums(step: Step, params, batch, key, ids: keys_lib.Ids64):
    """Sums of (loss, weight, grad) over one microbatch, from per-example losses."""
    one = per_example_loss(step)

    def total(p):
        keys = keys_lib.example_keys(key, ids)
        loss_sums, weights = jax.vmap(one, in_axes=(None, 0, 0))(p, batch, keys)
        return jnp.sum(loss_sums), jax.lax.stop_gradient(jnp.sum(weights))

    (loss_sum, weight), grad_sum = jax.value_and_grad(total, has_aux=True)(params)
    return loss_sum, weight, jax.tree.map(_accumulation_dtype, grad_sum)


def accumulated_sums(step: Step, params, batch, key, ids: keys_lib.Ids64, axis: str | None):
    """Sums over ``step.microbatches`` sequential microbatches (a ``lax.scan``).

    ``axis`` names the ``shard_map`` mesh axis the batch varies over, if any.
    """
    k = step.microbatches
    if k == 1:
        return microbatch_sums(step, params, batch, key, ids)

    def split(x):
        return x.reshape(k, x.shape[0] // k, *x.shape[1:])

    xs = jax.tree.map(split, (batch, ids))

    def body(carry, x):
        sums = microbatch_sums(step, params, x[0], key, x[1])
        return jax.tree.map(jnp.add, carry, sums), None

    first = jax.tree.map(lambda a: a[0], xs)
    shapes = jax.eval_shape(lambda b, i: microbatch_sums(step, params, b, key, i), *first)
    zeros = jax.tree.map(lambda a: _zeros(a, axis), shapes)
    sums, _ = jax.lax.scan(body, zeros, xs)
    return sums


def normalize(like, loss_sum, weight, grad_sum):
    """The step loss and gradient: global sums divided once by the global weight.

    ``like`` is the params tree (or a tree of their dtypes): grads get its dtypes.
    """
    loss = loss_sum / weight
    grads = jax.tree.map(lambda g, p: (g / weight).astype(_dtype_of(p)), grad_sum, like)
    return loss, grads


class _DefaultStep:
    """Default mode: one jitted program; data parallel via ``shard_map`` + ``psum``."""

    def __init__(self, step: Step):
        self.step = step
        self._jitted = jax.jit(self._run)

    def _run(self, params, batch, key, ids):
        step = self.step
        if step.mesh is None:
            ids = _default_ids(ids, _leading(batch), offset=0)
            sums = accumulated_sums(step, params, batch, key, ids, None)
        else:
            axis = step.mesh.axis_names[0]

            def shard(params, batch, key, ids):
                local = _leading(batch)
                # Per-device params: each device's gradient is its own share's sum, combined
                # by the one explicit psum below (AD of invariant params would psum too).
                params = jax.lax.pcast(params, (axis,), to="varying")
                ids = _default_ids(ids, local, offset=jax.lax.axis_index(axis) * local)
                sums = accumulated_sums(step, params, batch, key, ids, axis)
                return jax.lax.psum(sums, axis)

            ids_spec = None if ids is None else P(axis)
            params, key = _place(step.mesh, P(), (params, key))
            batch, ids = _place(step.mesh, P(axis), (batch, ids))
            sums = jax.shard_map(
                shard,
                mesh=step.mesh,
                in_specs=(P(), P(axis), P(), ids_spec),
                out_specs=P(),
            )(params, batch, key, ids)
        loss_sum, weight, grad_sum = sums
        loss, grads = normalize(params, loss_sum, weight, grad_sum)
        return loss, grads, weight

    def __call__(self, params, batch, key, ids):
        loss, grads, weight = self._jitted(params, batch, key, ids)
        if self.step.weighted:
            validate.check_total_weight(weight)
        return loss, grads


def _dtype_of(x: Any) -> Any:
    return x if isinstance(x, np.dtype) else jnp.result_type(x)


def _zeros(aval: jax.ShapeDtypeStruct, axis: str | None) -> jax.Array:
    zeros = jnp.zeros(aval.shape, aval.dtype)
    # Inside shard_map a scan carry must vary over the mesh axis, like the body's output.
    return zeros if axis is None else jax.lax.pcast(zeros, (axis,), to="varying")


def _accumulation_dtype(x: jax.Array) -> jax.Array:
    # Low-precision grads (bf16 params) are summed in float32, cast back once at the end.
    return x.astype(wide_float(x.dtype))


def wide_float(dtype: Any) -> Any:
    """float32 for narrower floats (bf16, f16), the dtype itself otherwise."""
    dtype = jnp.dtype(dtype)
    narrow = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    return jnp.dtype(jnp.float32) if narrow else dtype


def _place(mesh: jax.sharding.Mesh, spec: P, tree: Any) -> Any:
    """Reshards ``tree`` to ``spec`` on ``mesh`` inside jit (Explicit and Auto axes)."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    place = jax.reshard if explicit else jax.lax.with_sharding_constraint
    return jax.tree.map(lambda x: place(x, sharding), tree)


def _leading(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


def _default_ids(ids, size, offset) -> keys_lib.Ids64:
    if ids is not None:
        return ids
    lo = (offset + jnp.arange(size)).astype(jnp.uint32)
    return keys_lib.Ids64(hi=jnp.zeros_like(lo), lo=lo)
