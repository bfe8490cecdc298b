"""``unsplit.audit`` and ``unsplit.audit_step``: what makes a training step depend on its schedule.

Both trace the function (``jax.make_jaxpr``; nothing runs), follow where every
value comes from through every sub-jaxpr, and return :class:`Finding` s that
name the user's source line. See the audit guide (https://unsplit.readthedocs.io/en/latest/audit/) for the catalogue of kinds
and for what the audit cannot see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src import frozen as frozen_lib
from unsplit._src import keys as keys_lib
from unsplit._src.audit import trace as audit_trace
from unsplit._src.audit.batched import check_step
from unsplit._src.audit.finding import UNKNOWN, Finding, Site, dedupe, finding
from unsplit._src.audit.graph import Walker
from unsplit._src.audit.keys import THREEFRY_DTYPE, KeyRules, default_impl_note
from unsplit._src.audit.loss import LossTraceError, check_loss
from unsplit._src.audit.state import captured_module_finding
from unsplit._src.audit.values import Origin
from unsplit._src.trees import canonical_dtype


def audit(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    key: Any,
    *,
    weighted: bool = False,
    has_aux: bool = False,
    frozen: Any = None,
) -> list[Finding]:
    """Finds what makes a per-example loss depend on the schedule; nothing runs.

    The loss is checked as ``unsplit.value_and_grad`` calls it:
    ``jax.vmap(loss_fn, in_axes=(None, 0, 0))(params, batch,
    unsplit.example_keys(key, ids))``, then walked for one example. Kinds:
    ``foreign_key``, ``cross_example``, ``dropped_state``, ``unsafe_key``,
    ``padding_unstable``, ``device_key`` (see the audit guide, https://unsplit.readthedocs.io/en/latest/audit/).

    Args:
        loss_fn: ``loss_fn(params, example, key)`` for ONE example.
        params: any pytree (arrays or ``jax.ShapeDtypeStruct`` s; a Flax
            variables dict, an ``nnx.State`` or module, an Equinox module).
        batch: a pytree whose leaves have the batch as leading axis.
        key: the step key (``jax.random.key(seed)``).
        weighted: whether ``loss_fn`` returns ``(loss_sum, weight)``.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        frozen: frozen inputs (a pytree), as ``step(..., frozen=frozen)`` gets
            them: the loss is then ``loss_fn(params, example, key, frozen)``.

    Returns:
        The findings, in program order; ``[]`` when nothing was found.

    Raises:
        TypeError, ValueError: the inputs or the loss's outputs are not what
            ``value_and_grad`` accepts (the message names the fix); or the
            loss itself fails to trace (its own error, with a note).

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> fixed = jax.random.key(42)
        >>> def loss_fn(w, x, key):
        ...     keep = jax.random.bernoulli(fixed, 0.9, x.shape)  # not the example's key
        ...     return jnp.sum(jnp.where(keep, x, 0.0) * w)
        >>> findings = unsplit.audit(loss_fn, jnp.ones(3), jnp.ones((8, 3)), jax.random.key(0))
        >>> [f.kind for f in findings]
        ['foreign_key']
    """
    _check_callable(loss_fn, "loss_fn")
    # The step's own arity check: frozen= given exactly when the loss takes it.
    frozen_lib.check_arity(loss_fn, "loss_fn", "params, example, key", 3, frozen is not None)
    if frozen is not None:  # traced as the step calls it: frozen travels with the params
        loss_fn, params = frozen_lib.bound(loss_fn), frozen_lib.combine(params, frozen)
    size = _batch_size(batch)
    found: list[Finding] = []
    unsafe = keys_lib.is_typed_key(key) and str(key.dtype) != THREEFRY_DTYPE
    unsafe_dtype = str(getattr(key, "dtype", ""))
    if unsafe:  # audit the rest as if the key were a threefry key
        key = jax.random.key(0, impl="threefry2x32")
    keys_lib.check_key(key)
    key = audit_trace.abstract(key)
    keys = jax.eval_shape(keys_lib.example_keys, key, jnp.arange(size, dtype=jnp.uint32))

    def batched(params, batch, keys):
        return jax.vmap(loss_fn, in_axes=(None, 0, 0))(params, batch, keys)

    try:
        traced = audit_trace.trace(batched, [params, batch, keys], ["params", "batch", "keys"])
    except Exception as e:
        captured = captured_module_finding(e)
        if captured is not None:
            if unsafe:
                found.append(_unsafe_step_key(unsafe_dtype, _key_use_site(None, loss_fn)))
            return dedupe([*found, captured])
        e.add_note(
            "unsplit.audit traced loss_fn as value_and_grad calls it: jax.vmap(loss_fn, "
            "in_axes=(None, 0, 0))(params, batch, unsplit.example_keys(key, ids))."
        )
        raise
    if unsafe:
        found.append(_unsafe_step_key(unsafe_dtype, _key_use_site(traced, loss_fn)))
    _check_output(traced.out_shape, size, weighted=weighted, has_aux=has_aux)
    example = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x)[1:], canonical_dtype(x.dtype))
            if audit_trace.is_array(x)
            else x
        ),
        batch,
    )
    try:
        found += check_loss(loss_fn, params, example, key)
    except LossTraceError as e:
        cause = e.__cause__ if isinstance(e.__cause__, BaseException) else e
        raise cause from None  # traced batched but not alone: the loss's own error
    return dedupe(found)


def audit_step(
    fn: Callable, *args: Any, batch_argnums: Sequence[int] | None = None, frozen: Any = None
) -> list[Finding]:
    """Finds what makes an ordinary (batched) train step depend on its schedule; nothing runs.

    Kinds: ``batch_draw`` (one key draws for the whole batch), ``device_key``
    (a key per device, e.g. ``shard_prng_key``), ``mean_of_means`` (per-microbatch
    means accumulated, e.g. ``optax.MultiSteps`` over a token-weighted loss),
    ``unsafe_key``; each ``fix`` names the ``unsplit`` equivalent.

    ``batch_draw`` has two signals: a draw whose shape follows the batch size
    (the step traced again with the batch twice as large), and a draw from one
    key whose own axis meets the rows of the batch (a microbatch loop whose
    size is a constant of the code).

    Args:
        fn: the step, called as ``fn(*args)``: jitted or not, a
            ``jax.shard_map`` over a mesh with ``Explicit`` or ``Auto`` axes
            (inputs keep their ``NamedSharding`` s and the step is traced under
            their mesh), or a ``jax.pmap`` (its batch, stacked per device as
            ``(devices, B, ...)``, grows per device).
        *args: example inputs: arrays or ``jax.ShapeDtypeStruct`` s (other
            leaves, such as Python numbers, are held static).
        batch_argnums: which arguments hold the batch (``unsplit audit
            --batch-args``); by default those whose array leaves all share one
            leading size (the first argument, the params, only if no other
            does).
        frozen: frozen inputs (a text encoder, a LoRA base model), passed as the step
            takes them: ``fn(*args, frozen=frozen)`` (an ``unsplit`` train function or a
            default-mode step, or your own step with that keyword); traced as inputs,
            never as the batch.

    Returns:
        The findings, in program order; ``[]`` when nothing was found.

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> def step(w, x, key):  # batch-level dropout: one key for the whole batch
        ...     keep = jax.random.bernoulli(key, 0.9, x.shape)
        ...     return jnp.mean(jnp.where(keep, x, 0.0) @ w)
        >>> findings = unsplit.audit_step(step, jnp.ones((3, 2)), jnp.ones((8, 3)), jax.random.key(0))
        >>> [f.kind for f in findings]
        ['batch_draw']
    """
    _check_callable(fn, "fn")
    if batch_argnums is not None:
        bad = [i for i in batch_argnums if not -len(args) <= i < len(args)]
        if bad:
            raise ValueError(
                f"batch_argnums={tuple(batch_argnums)} names arguments {bad} that do not exist; "
                f"got {len(args)} arguments. Fix: index the batch among fn's positional arguments."
            )
        batch_argnums = tuple(i % len(args) for i in batch_argnums)
    if frozen is None:
        return check_step(fn, args, batch_argnums=batch_argnums)
    # The last traced argument, passed by keyword: never the batch.
    if batch_argnums is None:
        batch_argnums = audit_trace.infer_batch_argnums(args)

    def with_frozen(*traced):
        return fn(*traced[:-1], frozen=traced[-1])

    return check_step(with_frozen, (*args, frozen), batch_argnums=batch_argnums)


def _check_callable(fn: Any, name: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"{name} must be a function; got {type(fn).__name__}: {fn!r}. Fix: pass the "
            f"function itself, e.g. unsplit.audit(loss_fn, params, batch, key)."
        )


def _batch_size(batch: Any) -> int:
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if audit_trace.is_array(x)]
    if not leaves:
        raise ValueError(
            f"batch has no array leaves; got {type(batch).__name__}. Fix: pass the batch as a "
            "pytree of arrays whose leading axis is the batch, e.g. {'x': x} with x of shape (B, ...)."
        )
    sizes = sorted({np.shape(x)[0] if np.ndim(x) else -1 for x in leaves})
    if -1 in sizes:
        raise ValueError(
            "every batch leaf must have the batch as leading axis; got a scalar leaf. Fix: "
            "give per-example values a leading axis of size B, and pass constants in params."
        )
    if len(sizes) != 1 or sizes[0] == 0:
        raise ValueError(
            f"every batch leaf must have the same leading size B >= 1; got leading sizes {sizes}. "
            "Fix: stack every per-example value along axis 0."
        )
    return sizes[0]


def _check_output(out: Any, size: int, *, weighted: bool, has_aux: bool) -> None:
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise TypeError(
                f"with has_aux=True loss_fn must return (loss, aux); got {_shapes(out)} per "
                "batch. Fix: return a pair, or pass has_aux=False."
            )
        out = out[0]
    if weighted:
        ok = isinstance(out, tuple | list) and len(out) == 2
        if not ok or any(np.shape(x) != (size,) for x in out):
            raise TypeError(
                f"with weighted=True loss_fn must return (loss_sum, weight), two scalars per "
                f"example; got {_shapes(out)} for a batch of {size}. Fix: return "
                "(jnp.sum(token_losses), jnp.sum(mask)), or pass weighted=False."
            )
        return
    if isinstance(out, tuple | list):
        raise TypeError(
            f"loss_fn returns a {len(out)}-tuple {_shapes(out)} per batch; with weighted=False "
            "it must return one scalar loss per example. Fix: pass weighted=True if it is "
            "(loss_sum, weight), or has_aux=True if it is (loss, aux)."
        )
    if np.shape(out) != (size,):
        raise TypeError(
            f"loss_fn must return a scalar loss for one example; got shape "
            f"{tuple(np.shape(out))[1:]} per example. Fix: reduce it (e.g. jnp.sum or jnp.mean "
            "over the example's own axes)."
        )


def _shapes(out: Any) -> str:
    return str(jax.tree.map(lambda x: tuple(np.shape(x)), out))


def _unsafe_step_key(dtype: str, site: Site) -> Finding:
    return finding(
        "unsafe_key",
        f"the step key is a {dtype} key{default_impl_note()}, and loss_fn draws from it here: "
        "value_and_grad refuses it, because under jax.vmap rbg and unsafe_rbg keys draw the "
        "whole batch from the first example's key, so an example's noise would depend on its "
        "batch.",
        site,
    )


def _key_use_site(traced: audit_trace.Traced | None, loss_fn: Callable) -> Site:
    """The first line of the loss that draws from its key; else where the loss is defined.

    The key was made outside the audit, so the line that uses it is the one to show.
    """
    code = getattr(loss_fn, "__code__", None)
    defined = Site(code.co_filename, code.co_firstlineno) if code is not None else UNKNOWN
    if traced is None:
        return defined
    infos = [
        frozenset({Origin("example_key", "key")} if leaf.arg == 2 else ()) for leaf in traced.leaves
    ]
    rules = KeyRules()
    walker = Walker(rules)
    walker.run(traced.closed, infos, lambda i, value: Origin("const", "a constant"))
    for d in rules.draws_of(resolved=False):
        if d.site.file is not None and any(o.kind == "example_key" for o in d.key_info):
            return d.site
    return defined
