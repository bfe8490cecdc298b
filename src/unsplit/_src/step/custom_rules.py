"""A loss's ``custom_jvp`` and ``custom_vjp`` rules, kept when its jaxpr runs on another mesh.

:mod:`~unsplit._src.step.constraints` runs a loss traced on the user's mesh again, its
shardings moved onto the program's mesh (and :mod:`~unsplit._src.step.manual` a
``shard_map`` region inside it, on the program's region). A custom derivative inside keeps
its rule: the rule is traced where the user's code was traced (:meth:`Place.trace`: on
the user's mesh, or inside the user's region), when the step differentiates the loss,
and run through the same rewrite (:meth:`Place.eval`), so its shardings move too and
JAX's checks of the rule's cotangents compare them with the types of the user's trace. A
ring attention's memory-saving backward pass (a ``custom_vjp`` whose rule runs the ring
again) stays the backward pass that runs, as in a plain jitted step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.extend.linear_util as lu
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad
from jax.sharding import AxisType, NamedSharding

from unsplit._src import partition
from unsplit._src.step import settings


class Place(Protocol):
    """Where the user's code was traced, and how what was traced there runs here."""

    def trace(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (which traces user code) in the context the user's code was traced in."""
        ...

    def struct(self, aval: Any, dtype: Any = None) -> jax.ShapeDtypeStruct:
        """A type of the user's trace (``dtype`` replaced), for tracing there."""
        ...

    def eval(self, jaxpr: core.Jaxpr, consts: Any, *args: Any) -> list[Any]:
        """A jaxpr traced there, evaluated here (its shardings moved)."""
        ...

    def retrace(self, jaxpr: core.Jaxpr, consts: Any) -> tuple[core.Jaxpr, list[Any]]:
        """A jaxpr traced there, traced again here through :meth:`eval`."""
        ...


def on_mesh(mesh, fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``mesh`` (its abstract mesh), as the user's code was traced.

    In a thread of its own when called inside a ``shard_map`` region (an FSDP group's
    chunk program is manual over the chunk axes): another mesh cannot be entered
    there, and JAX's trace and mesh contexts are per thread.
    """

    def run():
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn()

    return outside_manual(run)


# JAX's settings a trace reads that a context manager can set per thread: carried into the
# thread that traces outside a manual region (a rule traced there reads what the user set).


def outside_manual(fn: Callable[[], Any]) -> Any:
    """``fn()``, in a fresh thread when called inside a manual (``shard_map``) region, under
    the caller's per-thread JAX settings (dtype promotion, x64, matmul precision...)."""
    if AxisType.Manual not in tuple(jax.sharding.get_abstract_mesh().axis_types):
        return fn()
    return settings.in_thread(fn)


def user_struct(aval: Any, user_mesh, dtype: Any = None) -> jax.ShapeDtypeStruct:
    """A value's type on the user's mesh: its shape, dtype (or ``dtype``) and the Explicit
    axes of its sharding that the user's mesh has (``aval``: a ``ShapedArray`` or
    ``ShapeDtypeStruct``)."""
    dtype, shape = aval.dtype if dtype is None else dtype, tuple(aval.shape)
    weak = bool(getattr(aval, "weak_type", False))
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    explicit = [
        n
        for n, t in zip(user_mesh.axis_names, user_mesh.axis_types, strict=True)
        if t == AxisType.Explicit
    ]
    plain = None if spec is None else partition.plain(spec)
    if plain is None or not partition.spec_axes(plain) & set(explicit):
        return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
    sharding = NamedSharding(user_mesh.abstract_mesh, partition.keep_axes(plain, explicit))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=weak)


def moved_jvp(place: Place, params: dict) -> dict:
    """A ``custom_jvp_call``'s params, its body and its jvp rule's jaxpr moved like the loss.

    The rule is traced lazily, where the user's code was, then again through the
    rewrite.
    """
    call = params["call_jaxpr"]
    thunk = params["jvp_jaxpr_fun"]

    def moved(*zeros):
        jaxpr, consts, *rest = place.trace(lambda: thunk.call_wrapped(*zeros))
        return (*place.retrace(jaxpr, consts), *rest)

    return {
        **params,
        "call_jaxpr": core.ClosedJaxpr(*place.retrace(call.jaxpr, call.consts)),
        "jvp_jaxpr_fun": lu.wrap_init(moved, debug_info=thunk.debug_info),
    }


def moved_vjp(place: Place, params: dict, invals: list[Any]) -> list[Any]:
    """A ``custom_vjp_call``'s outputs, with the user's rule as its derivative.

    The primal computation, the fwd rule and the bwd rule each run through
    :meth:`Place.eval`; the fwd and bwd rules are traced where the user's code was
    (from the types of the user's trace) when the step differentiates the loss.
    Closed-over values (the call's constants) get no cotangent, as in JAX.
    """
    call: core.ClosedJaxpr = params["call_jaxpr"]
    n_consts: int = params["num_consts"]
    thunk, bwd, out_trees = params["fwd_jaxpr_thunk"], params["bwd"], params["out_trees"]
    residual_types: list[Any] = []  # the fwd rule's residuals' types in the user's trace

    @jax.custom_vjp
    def call_with_rule(*args):
        return tuple(place.eval(call.jaxpr, call.consts, *args))

    def fwd(*args):
        nonzeros = [True] * (len(args) - n_consts)
        jaxpr, consts = place.trace(lambda: thunk.call_wrapped(*nonzeros))
        outs = place.eval(jaxpr, consts, *args[n_consts:])
        _, res_tree, input_fwds = out_trees()  # set by the trace just above
        computed = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        made = iter(zip(outs[:computed], [v.aval for v in jaxpr.outvars[:computed]], strict=True))
        residuals, types = [], []
        for f in input_fwds:  # a residual the rule computed, or one of the call's inputs
            value, aval = next(made) if f is None else (args[f], call.in_avals[f])
            residuals.append(value)
            types.append(aval)
        residual_types[:] = types
        return tuple(outs[computed:]), tuple(residuals)

    def bwd_rule(residuals, cts):
        zero: list[bool] = []

        def rule(*args):
            out = list(bwd.call_wrapped(*args))
            if len(out) == 2 and isinstance(out[0], list):  # JAX 0.12.0.1+: (cotangents, logs)
                out = out[0]
            zero[:] = [isinstance(o, ad.Zero) for o in out]
            return [o for o in out if not isinstance(o, ad.Zero)]

        def traced():
            structs = [place.struct(a) for a in residual_types]
            # A cotangent's dtype is its own (float0 for an integer output).
            structs += [
                place.struct(a, jnp.result_type(c))
                for a, c in zip(call.out_avals, cts, strict=True)
            ]
            return jax.make_jaxpr(rule)(*structs)

        closed = place.trace(traced)
        given = iter(place.eval(closed.jaxpr, closed.consts, *residuals, *cts))
        grads = [None if z else next(given) for z in zero]
        args = call.in_avals[n_consts:]
        grads = [g if _inexact(a) else None for g, a in zip(grads, args, strict=True)]
        return (*(None,) * n_consts, *grads)

    call_with_rule.defvjp(fwd, bwd_rule)
    return list(call_with_rule(*invals))


def _inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)
