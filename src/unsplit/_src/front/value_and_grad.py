"""``value_and_grad``: one training step, whatever the schedule.

The user writes the loss of **one** example with its own key. The step vmaps
it over the examples of a microbatch with ``example_keys(key, ids)``, runs the
microbatches of each device in a ``lax.scan`` (activation memory of one
microbatch), sums loss, weight and gradient over the devices, and divides once
by the global weight. Data parallelism and gradient accumulation are therefore
the same function of ``(params, global batch, ids, key)``.
"""

from __future__ import annotations

from typing import Any

import jax

from unsplit._src import frozen as frozen_lib
from unsplit._src import keys as keys_lib
from unsplit._src.front.inputs import Inputs
from unsplit._src.front.options import Bitwise, Options
from unsplit._src.step import groups, memory, sums, validate
from unsplit._src.step.default import DefaultStep
from unsplit._src.step.layout import Layout
from unsplit._src.step.sums import Result

LossFn = sums.LossFn
BatchLossFn = Any  # batch_loss(params, features) -> scalar loss (or (loss, aux))


def value_and_grad(
    loss_fn: LossFn,
    *,
    batch_loss: BatchLossFn | None = None,
    weighted: bool = False,
    has_aux: bool = False,
    microbatches: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    batch_axes: str | tuple[str, ...] | None = None,
    bitwise: bool | Bitwise = False,
    chunk_size: int | None = None,
    chunk_axes: str | tuple[str, ...] | None = None,
    group_size: int | None = None,
    audit: bool = False,
    checked: bool = False,
) -> Step:
    """Makes a schedule-invariant ``(loss, grads)`` step from a one-example loss.

    Args:
        loss_fn: ``loss_fn(params, example, key)`` for ONE example (no batch
            axis) with its own PRNG key. It returns a scalar loss; with
            ``weighted=True`` a pair ``(loss_sum, weight)`` such as (sum of token
            losses, number of tokens); with ``has_aux=True`` a pair
            ``(that, aux)`` where ``aux`` is any pytree of per-example outputs.
        weighted: whether ``loss_fn`` returns ``(loss_sum, weight)``. The step
            loss is ``sum(loss_sum) / sum(weight)`` over the global batch
            (never a mean of microbatch means); unweighted, it is the mean over
            examples. Weights are data: no gradient flows through them. A
            total weight that is not a positive finite number gives nan loss
            and grads (computed on device, no host read-back).
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``; the step then
            returns ``((loss, aux), grads)`` like ``jax.value_and_grad``, with
            ``aux`` stacked per example in global-batch order (leading axis
            ``B``, sharded like the batch), the same for every schedule.
        microbatches: each device runs its share of the batch as this many
            sequential microbatches (gradient accumulation); the result is the
            same as with 1.
        mesh: a ``jax.sharding.Mesh`` (Explicit or Auto axes, one or several
            processes); ``None`` runs on one device.
        batch_axes: the mesh axis name (or tuple of names) the global batch is
            split over; default: the mesh's first axis. Params may be sharded
            over any axes (FSDP over the batch axes, tensor parallel over the
            others) and keep their shardings; so do the grads.
        bitwise: make loss and grads bit-identical for every (devices,
            microbatches, processes) schedule of the same global batch; see
            the Bitwise mode guide (https://unsplit.readthedocs.io/en/latest/bitwise/).
        chunk_size: bitwise mode's fixed unit of work, in examples (default:
            depends on the global batch size only; with ``chunk_axes``, made a
            multiple of their device count).
        chunk_axes: bitwise mode only: batch axes (a name or a tuple, each one
            of ``batch_axes``, the last of them) whose devices compute each
            chunk *together* (FSDP groups): params stay sharded over them, the
            chunk's rows are split over the group, and the bits are fixed by
            its number of devices (like a model-parallel layout), not by the
            other batch axes. Per-device memory then scales as params / devices
            per group.
            Default ``None``: every device computes its chunks alone, with
            params sharded over the batch axes gathered whole.
        group_size: make every ``group_size`` consecutive rows of the batch
            (global ids ``g*G ... g*G+G-1``) ONE example: the loss (or
            ``features_fn``) gets them as arrays of shape ``(G, ...)`` and the
            key ``example_keys(key, g)``, and ``ids`` are the rows' ids. For
            layers that couple a few rows (ghost BatchNorm, see
            https://unsplit.readthedocs.io/en/latest/coupled/): no microbatch or device share can split a
            group (a schedule that would raises), so their statistics are the
            same for every schedule. Default ``None``: one row per example.
        audit: on the first call, run every per-example check of
            :func:`unsplit.audit` (by tracing, nothing runs) and raise
            :class:`unsplit.AuditError` on any finding that makes the step
            depend on its schedule: for CI. A finding that matters only when
            the padded length changes (``padding_unstable``) gives a
            :class:`unsplit.PaddingWarning` instead. Without it, the first call still refuses a loss that draws
            from a key it did not get as its third argument (``foreign_key``).
        checked: after each call, read the loss and the total weight back (one
            host read-back per step) and raise ``FloatingPointError``, naming the
            cause and the fix, when the loss is not finite (a total weight that
            is not a positive finite number, or ``loss_fn`` returning inf or
            nan) instead of returning nan. Inside the caller's ``jit`` the check
            runs on device and the error surfaces when the results are read.
            Default ``False``: the nan is returned, with no read-back.
        batch_loss: for a loss that couples the examples (contrastive with
            in-batch negatives, a global-batch MoE balancing term):
            ``loss_fn`` is then ``features_fn(params, example, key)``, returning
            ONE example's features (a pytree of floating-point arrays), and
            ``batch_loss(params, features)`` returns the scalar loss of the
            global batch from every example's features stacked in global-batch
            order (leading axis ``B``). The step's loss and grads are
            ``jax.value_and_grad`` of ``batch_loss(params, vmap(features_fn)(params,
            batch, example_keys(key, ids)))`` over the whole global batch, for
            every schedule; with ``has_aux=True`` ``batch_loss`` returns
            ``(loss, aux)`` and ``aux`` comes back as it returned it. Memory:
            one microbatch's activations plus the global batch's features (see
            https://unsplit.readthedocs.io/en/latest/coupled/). Not with ``weighted=True`` (put weights in the
            features and divide inside ``batch_loss``).

    Returns:
        A :class:`Step`; ``step(params, batch, key, ids=None)`` returns
        ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``).
        ``params`` is any pytree: grads for its inexact array leaves, ``None``
        for every other leaf (as ``equinox.filter_value_and_grad``). ``batch``
        is a pytree whose leaves all have the global batch size ``B`` as
        leading axis; ``ids`` (shape ``(B,)``, default ``arange(B)``) are the
        examples' global ids.
        ``step(params, batch, key, ids=None, frozen=frozen)`` (keyword) passes
        frozen inputs (a text encoder, a LoRA base model; any pytree): the loss
        is then ``loss_fn(params, example, key, frozen)`` (``features_fn`` and
        ``batch_loss`` take it last too); ``frozen`` is never differentiated,
        keeps its shardings and is an argument of the compiled programs, never
        a constant (https://unsplit.readthedocs.io/en/latest/models/#frozen-inputs).
        ``step(params, batch, key, step=i)`` (keyword) folds the step number into
        the key inside the compiled program: the same as passing
        ``jax.random.fold_in(key, i)``, bit for bit, without a host dispatch per
        step (``i``: a Python int in ``[0, 2**32)`` or an integer array of shape
        ``()`` such as ``state.step``).

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
    options = dict(locals())
    del options["loss_fn"]
    return Step(loss_fn, Options.make(**options))


# Long: the public step -- its documented attributes (the options read back), the one run
# path and lower(); the input checks are front/inputs.py, the engines step/ and bitwise/.
class Step:
    """A compiled-once ``(loss, grads)`` step; made by :func:`value_and_grad`.

    Calling it validates the inputs on the host (shapes and dtypes only; it
    never waits for the device), then runs a program that is traced and
    compiled once per input shapes and params layout: later calls reuse it.

    One call, in order (:meth:`_run`): rows grouped into examples
    (``group_size``), the inputs checked (and, on a multi-process first call,
    agreed), the loss audited once, then the mode's engine -- default mode's one
    SPMD program (:class:`~unsplit._src.step.default.DefaultStep`) or bitwise
    mode's programs (:class:`~unsplit._src.bitwise.step.BitwiseStep`).

    Attributes:
        options: the step's options as one frozen object (``Options``); the
            attributes below read it back: ``loss_fn``, ``batch_loss``,
            ``weighted``, ``has_aux``, ``microbatches``, ``group_size``,
            ``checked``, ``audit``, ``bitwise`` (a bool), ``chunk_size``,
            ``mesh`` and ``batch_axes`` (always a tuple).
        num_devices: how many shares the global batch is split into.
    """

    def __init__(self, loss_fn: LossFn, options: Options | None = None, /, **keywords: Any):
        validate.check_callable(loss_fn)
        if options is None:
            options = Options.make(**keywords)
        elif keywords:
            raise TypeError(
                f"Step takes its options as one Options object or as keywords, not both; got "
                f"both and {sorted(keywords)}. Fix: unsplit.value_and_grad(loss_fn, ...)."
            )
        self.options = options
        self._spec = sums.LossSpec(
            loss_fn,
            weighted=options.weighted,
            has_aux=options.has_aux,
            batch_loss=options.batch_loss,
        )
        self._layout = Layout.make(options.mesh, options.batch_axes)
        self._inputs = Inputs(self)  # a call's checks; the first call's agreement and audit
        if options.bitwise is not None:
            from unsplit._src.bitwise import step as bitwise_lib

            self._engine = bitwise_lib.BitwiseStep(self._spec, self._layout, options.bitwise)
        else:
            self._engine = DefaultStep(
                self._spec, self._layout, options.microbatches, self.settings()
            )

    # The options, read as attributes (``step.bitwise`` is a bool, as the keyword was).
    loss_fn = property(lambda self: self._spec.loss_fn)
    batch_loss = property(lambda self: self.options.batch_loss)
    weighted = property(lambda self: self.options.weighted)
    has_aux = property(lambda self: self.options.has_aux)
    microbatches = property(lambda self: self.options.microbatches)
    group_size = property(lambda self: self.options.group_size)
    checked = property(lambda self: self.options.checked)
    audit = property(lambda self: self.options.audit)
    bitwise = property(lambda self: self.options.bitwise is not None)
    chunk_size = property(
        lambda self: None if self.options.bitwise is None else self.options.bitwise.chunk_size
    )
    mesh = property(lambda self: self._layout.mesh)
    batch_axes = property(lambda self: self._layout.batch_axes)

    @property
    def num_devices(self) -> int:
        """How many shares the global batch is split into (the batch axes' devices)."""
        return self._layout.shards

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__name__", repr(self.loss_fn))
        shown = {
            k: dict(v.shape) if k == "mesh" else getattr(v, "__name__", v)
            for k, v in self.options.changed().items()
        }
        return f"Step({', '.join([name, *(f'{k}={v!r}' for k, v in shown.items())])})"

    def settings(self) -> dict[str, Any]:
        """What fixes the computation, besides the inputs (agreed between processes)."""
        bitwise = self.options.bitwise
        return {
            "mode": self.options.mode,
            "chunk_size": None if bitwise is None else bitwise.chunk_size,
            "chunk_axes": getattr(getattr(self, "_engine", None), "chunk_axes", ()),
            "microbatches": self.microbatches,
            "group_size": self.group_size,
            "weighted": self.weighted,
            "has_aux": self.has_aux,
            "coupled": self._spec.coupled,
            "batch_axes": self.batch_axes,
            "mesh": self.mesh,
        }

    def __call__(
        self,
        params: Any,
        batch: Any,
        key: jax.Array,
        ids: Any = None,
        *,
        frozen: Any = None,
        step: Any = None,
    ) -> tuple[Any, Any]:
        with memory.hint(self):  # also the first call's transfers and compiles
            result = self._run(params, batch, key, ids, frozen=frozen, step=step)
        if self.has_aux:
            return (result.loss, result.aux), result.grads
        return result.loss, result.grads

    def _run(
        self,
        params: Any,
        batch: Any,
        key: jax.Array,
        ids: Any = None,
        *,
        frozen: Any = None,
        step: Any = None,
        memo: dict | None = None,
    ) -> Result:
        """One call, both modes: group, check (agree, audit), run the engine, check the result.

        ``frozen`` travels with the params (placed like them, never differentiated);
        ``result.grads`` and ``result.params`` are the params' alone. ``step``: the step
        number, folded into ``key`` inside the engine's programs. ``memo``: the train
        step's dict, kept while it passes back the params it returned and the same
        frozen, so the engine need not look at their layout again.
        """
        batch, ids = self._group(batch, ids)
        step = keys_lib.step_number(step)
        ids = self._inputs.check(params, batch, key, ids, frozen, step=step)
        placed = memo.get("frozen") if memo else None
        both = frozen_lib.combine(params, frozen if placed is None else placed)
        result = self._engine(both, batch, key, ids, memo=memo, step=step)
        if memo is not None:
            memo["frozen"] = frozen_lib.frozen_of(result.params)
        if self.checked:
            validate.check_result(result.loss, result.weight)
        return result._replace(
            grads=frozen_lib.params_of(result.grads), params=frozen_lib.params_of(result.params)
        )

    def _group(self, batch: Any, ids: Any = None) -> tuple[Any, Any]:
        """With ``group_size``: the row batch and row ids as the group batch and group ids
        (checked: no schedule piece splits a group); without, ``(batch, ids)`` as given."""
        if self.group_size is None:
            return batch, ids
        shares = self.num_devices * (1 if self.bitwise else self.microbatches)
        return groups.group_rows(batch, ids, self.group_size, shares=shares)

    def lower(
        self,
        params: Any,
        batch: Any,
        key: jax.Array,
        ids: Any = None,
        *,
        frozen: Any = None,
        step: Any = None,
    ):
        """The compiled program a call with these inputs runs, lowered; it takes the step's
        arguments, ``frozen=`` included.

        Like ``jax.jit(f).lower(...)``: ``step.lower(...).compile()`` gives its
        ``memory_analysis()``, ``cost_analysis()`` and ``as_text()``. Bitwise mode
        runs several programs per step (a chunk program per chunk, the fixed-order
        reduction): ``lower`` returns them as one object with the same methods, its
        memory per device the step's peak over all of them
        (``unsplit.testing.bitwise_cost`` has the breakdown). Nothing runs.
        """
        if not isinstance(self._engine, DefaultStep):
            from unsplit._src.bitwise import cost

            return cost.BitwiseLowered(self, (params, batch, key, ids), frozen)
        batch, ids = self._group(batch, ids)
        step = keys_lib.step_number(step)
        ids = self._inputs.check(params, batch, key, ids, frozen, audit=False, step=step)
        return self._engine.lower(frozen_lib.combine(params, frozen), batch, key, ids, step=step)
