"""A traced function run again from its jaxpr, equation by equation, some equations rewritten.

Three places trace a function and run its jaxpr again with changes: the loss's
sharding annotations moved onto the program's mesh (:mod:`~unsplit._src.step.constraints`),
bitwise mode's CPU dots laid out canonically
(:mod:`~unsplit._src.bitwise.canonical_dots`) and an FSDP group's optimizer update run on
its blocks with its sums in a fixed order (:mod:`~unsplit._src.bitwise.fsdp.fixed_order_update`).
Each is :func:`evaluate` with a rewrite of its own, called once per equation; an equation the rewrite leaves
alone is :func:`bind` again, its nested jaxprs (a ``scan``'s body, a ``cond``'s
branches, a ``remat``'s) traced again through the same rewrite by
:func:`nested` and :func:`retrace`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The outputs of one equation for its input values: a list for a primitive with multiple
# results, else one value.
Rewrite = Callable[[core.JaxprEqn, list[Any]], Any]
# A jaxpr and its constants traced again (the new jaxpr and its constants).
Retrace = Callable[[core.Jaxpr, Any], tuple[core.Jaxpr, list[Any]]]


def evaluate(
    jaxpr: core.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    rewrite: Rewrite,
    *,
    eqn_context: bool = False,
    literal: Callable[[Any], Any] | None = None,
) -> list[Any]:
    """``jaxpr``'s outputs for ``args``, each equation's outputs being ``rewrite(eqn, invals)``.

    Args:
        jaxpr: the jaxpr (of a ``ClosedJaxpr``: its ``.jaxpr``).
        consts: the values of its constants (``closed.consts``).
        args: the values of its inputs.
        rewrite: called with each equation and its input values, in order; returns
            what the equation's primitive would (:func:`bind` runs it as it is).
        eqn_context: run each rewrite under the context its equation was traced in
            (compute type, XLA metadata, the abstract mesh...). Off where the rewrite
            moves the equation onto another mesh than the one it was traced on.
        literal: maps each literal's value before use (e.g. a typed literal that
            carries the mesh it was traced on, read back as a plain array).

    Returns:
        The values of ``jaxpr``'s outputs.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
        >>> def cos_for_sin(eqn, invals):
        ...     if eqn.primitive.name == "sin":
        ...         return jnp.cos(*invals)
        ...     return bind(eqn, invals)
        >>> float(evaluate(closed.jaxpr, closed.consts, [0.0], cos_for_sin)[0])
        2.0
    """
    env: dict[Any, Any] = {}

    def read(v):
        if isinstance(v, core.Literal):
            return v.val if literal is None else literal(v.val)
        return env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with eqn.ctx.manager if eqn_context else contextlib.nullcontext():
            ans = rewrite(eqn, invals)
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, ans, strict=True):
                env[v] = x
        else:
            env[eqn.outvars[0]] = ans
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: core.JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> Any:
    """``eqn``'s primitive applied to ``invals``, with its own params or ``params``."""
    params = eqn.params if params is None else params
    return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))


def plain_aval(aval: Any, dtype: Any = None) -> jax.ShapeDtypeStruct:
    """An input's type for :func:`retrace`: its shape, dtype (or ``dtype``) and weak type,
    and inside a ``shard_map`` region how it varies over the manual axes (its sharding:
    the current region's mesh, nothing split)."""
    dtype = aval.dtype if dtype is None else dtype
    weak = bool(getattr(aval, "weak_type", False))
    manual = getattr(aval, "mat", None)
    if manual is None or not getattr(manual, "varying", ()):
        return jax.ShapeDtypeStruct(aval.shape, dtype, weak_type=weak)
    where = NamedSharding(jax.sharding.get_abstract_mesh(), P())
    return jax.ShapeDtypeStruct(
        aval.shape, dtype, weak_type=weak, sharding=where, manual_axis_type=manual
    )


def retrace(
    jaxpr: core.Jaxpr,
    consts: Any,
    run: Callable[..., list[Any]],
    aval: Callable[[Any], Any] = plain_aval,
) -> tuple[core.Jaxpr, list[Any]]:
    """``jaxpr`` traced again through ``run(jaxpr, consts, *inputs)`` (an evaluation with a
    rewrite), its inputs typed ``aval(invar.aval)``: the new jaxpr and its constants."""
    avals = [aval(v.aval) for v in jaxpr.invars]
    closed = jax.make_jaxpr(lambda *a: run(jaxpr, consts, *a))(*avals)
    return closed.jaxpr, list(closed.consts)


def nested(value: Any, retrace: Retrace) -> Any:
    """An equation's parameter with the jaxprs in it traced again by ``retrace``.

    A ``ClosedJaxpr`` (a ``jit``'s, a ``scan``'s), a constant-free ``Jaxpr`` (a
    ``remat``'s) and a tuple of ``ClosedJaxpr`` (a ``cond``'s branches); any other
    value is returned as it is.
    """
    if isinstance(value, core.ClosedJaxpr):
        return core.ClosedJaxpr(*retrace(value.jaxpr, value.consts))
    if isinstance(value, core.Jaxpr) and not value.constvars:
        new, consts = retrace(value, ())
        return value if consts else new  # an open jaxpr cannot take new constants
    if isinstance(value, tuple) and any(isinstance(v, core.ClosedJaxpr) for v in value):
        return tuple(nested(v, retrace) for v in value)
    return value


def subjaxprs(params: dict) -> list[core.Jaxpr]:
    """The jaxprs in an equation's params (a ``scan``'s body, a ``cond``'s branches...)."""
    found = []
    for v in params.values():
        for item in v if isinstance(v, tuple | list) else (v,):
            if isinstance(item, core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, core.Jaxpr):
                found.append(item)
    return found


def plain(value: Any) -> Any:
    """A literal's value without the mesh its type was traced on (a plain NumPy array):
    for :func:`evaluate`'s ``literal`` where equations move to another mesh."""
    return np.asarray(value).view(np.ndarray) if isinstance(value, np.ndarray) else value
