"""The user's sharding annotations, as they mean on the user's mesh, inside the step's programs.

A loss written for a plain ``jax.jit`` step names the user's mesh: an
activation constraint in any spelling (``with_sharding_constraint(x,
NamedSharding(mesh, spec))``, a bare ``P(...)`` under ``jax.set_mesh``,
``jax.sharding.reshard``) or ``jnp.matmul(..., out_sharding=P())``. A step's
programs do not run on that mesh as the user declared it: default mode turns
the batch axes Auto inside its program, and bitwise mode traces each chunk
program on a *group mesh* (the group's devices and axes only, Auto).

:func:`retargeted` gives the loss that means the same there. It traces the
user's one-example loss once under the user's mesh (so bare specs resolve and
the user's own checks run, as in a plain jitted step), and if the jaxpr holds
any sharding, evaluates it with every sharding moved onto the program's mesh:

* axes the program does not keep (the batch axes: the per-example ``vmap`` is
  the step's; in bitwise mode, every axis outside the group) are dropped from
  the specs: they are data parallel there;
* a constraint or ``reshard`` over axes that are Auto in the program becomes a
  sharding constraint over them (the same placement; XLA moves the data), over
  axes that stay Explicit a ``reshard``;
* an ``out_sharding`` (and any other sharding parameter) keeps its Explicit
  axes, or is left to XLA where the program has none;
* a ``jit`` inside the loss is inlined; a ``custom_jvp`` and a ``custom_vjp``
  keep their rules, traced on the user's mesh and moved the same way
  (:mod:`~unsplit._src.step.custom_rules`);
* a ``shard_map`` inside the loss (a ring attention) is declared again on the
  program's mesh, manual over the axes it uses (:mod:`~unsplit._src.step.manual`).

A loss with no sharding and no ``shard_map`` in it runs as it is.
:func:`activation_axes` lists the mesh axes a loss's annotations name and those
its ``shard_map`` regions use: bitwise mode makes those that shard neither the
batch nor the params (context parallelism: a ``seq`` axis) part of the group.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.extend import core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import frozen as frozen_lib
from unsplit._src import partition
from unsplit._src.audit import state as audit_state
from unsplit._src.step import custom_rules, jaxpr_eval, manual, state_guard

_CONSTRAINTS = ("sharding_constraint", "reshard", "mesh_cast")
_CALLS = ("jit", "pjit", "closed_call", "core_call")


def retargeted(loss_fn, user_mesh, keep: tuple[str, ...], target=None):
    """``loss_fn`` with its shardings on the user's mesh moved to the program's mesh.

    Args:
        loss_fn: the user's one-example loss ``(params, example, key)``.
        user_mesh: the mesh the user wrote the loss for (``jax.sharding.Mesh``).
        keep: the mesh axes the program keeps; others are dropped from specs.
        target: the mesh constraints go to when the program has no mesh context
            (bitwise mode's group mesh); ``None``: the context's mesh.

    Returns:
        A loss with the same signature. It traces ``loss_fn`` once per call's
        input types under the user's mesh; with no sharding found, it calls
        ``loss_fn`` itself.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("seq",))
        >>> f = retargeted(lambda p, x, k: jnp.sum(jax.sharding.reshard(x * p, P("seq"))),
        ...                mesh, keep=("seq",))
        >>> float(f(jnp.float32(2.0), jnp.ones(4), None))
        8.0
    """
    if user_mesh is None:
        return loss_fn

    def loss(*args):  # (params, example, key), and frozen last when the step has one
        leaves, treedef = jax.tree.flatten(args)
        mask = [_is_array(x) for x in leaves]
        arrays = [x for x, m in zip(leaves, mask, strict=True) if m]
        closed, out_tree = _user_trace(loss_fn, treedef, leaves, mask, user_mesh)
        explicit = AxisType.Explicit in tuple(user_mesh.axis_types)
        if closed is None or not _has_sharding(closed.jaxpr, explicit):
            return loss_fn(*args)
        rewrite = _Rewrite(user_mesh, tuple(keep), target)
        out = rewrite.eval(closed.jaxpr, closed.consts, *arrays)
        return jax.tree.unflatten(out_tree, out)

    return loss


class ActivationAxes(NamedTuple):
    """The mesh axes a loss shards its activations over (beside the batch and params)."""

    named: frozenset[str]  # named by its sharding annotations
    manual: frozenset[str]  # used by its own shard_map regions (needed at any size)


def activation_axes(loss_fn, user_mesh, params, example, key) -> ActivationAxes:
    """The mesh axes the loss's sharding annotations name and its ``shard_map`` regions use
    (traced on the user's mesh).

    ``params``, ``example`` and ``key`` are arrays or ``ShapeDtypeStruct``s of
    one example. A loss that does not trace there gives no axes (its error
    comes where it runs).
    """
    leaves, treedef = jax.tree.flatten((params, example, key))
    mask = [_is_array(x) for x in leaves]
    closed, _ = _user_trace(frozen_lib.bound(loss_fn), treedef, leaves, mask, user_mesh)
    if closed is None:
        return ActivationAxes(frozenset(), frozenset())
    named: set[str] = set()
    regions: set[str] = set()
    _collect(closed.jaxpr, named, regions)
    axes = set(user_mesh.axis_names)
    return ActivationAxes(frozenset(named & axes), frozenset(regions & axes))


def on_user_mesh(user_mesh, fn):
    """``fn()`` (a trace of the user's loss as written) on the user's mesh, unaudited."""
    with audit_state.paused():
        return custom_rules.on_mesh(user_mesh, fn)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) or hasattr(x, "dtype")


def _user_trace(loss_fn, treedef, leaves, mask, user_mesh):
    """``loss_fn``'s jaxpr on the user's mesh, from one example's types; ``None`` if it fails.

    The inputs keep the Explicit axes of their types that the user's mesh has
    (its model axes); inside the step they carry no batch axis.
    """
    avals = [_user_aval(x, user_mesh) for x, m in zip(leaves, mask, strict=True) if m]
    statics = [x for x, m in zip(leaves, mask, strict=True) if not m]

    def traced(*arrays):
        it_a, it_s = iter(arrays), iter(statics)
        args = jax.tree.unflatten(treedef, [next(it_a) if m else next(it_s) for m in mask])
        # The loss runs as this jaxpr, not as Python: this is the trace whose dropped state
        # updates (a BatchNorm's) must be found, against what this trace returns.
        with state_guard.watch(args[0]) as guard:
            out = loss_fn(*args)
        guard.check(returned=out)
        return out

    def trace():  # the caller's guard watches the call, not this trace of unsplit's own
        with audit_state.paused(), jax.sharding.use_abstract_mesh(user_mesh.abstract_mesh):
            return jax.make_jaxpr(traced, return_shape=True)(*avals)

    try:
        closed, shape = custom_rules.outside_manual(trace)
    except state_guard.DroppedStateError:
        raise
    except Exception:  # the loss runs as it is: its own error (if any) comes from there
        return None, None
    return closed, jax.tree.structure(shape)


def _user_aval(x: Any, user_mesh) -> jax.ShapeDtypeStruct:
    return custom_rules.user_struct(jax.typeof(x) if isinstance(x, jax.Array) else x, user_mesh)


def _axes(mesh) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    return tuple(mesh.axis_names), tuple(mesh.axis_types)


def _shardings(params: dict) -> list[Any]:
    return [v for v in params.values() if isinstance(v, NamedSharding)]


def _has_sharding(jaxpr: core.Jaxpr, explicit: bool) -> bool:
    """A constraint, or (on a mesh with Explicit axes) an ``out_sharding``. The sharding
    parameters JAX adds itself (an ``iota``'s, a ``broadcast``'s) follow the program's mesh
    there: a loss with only those runs as it is, the same program as on one device."""
    for eqn in jaxpr.eqns:
        placed = isinstance(eqn.params.get("out_sharding"), NamedSharding)
        if eqn.primitive.name in _CONSTRAINTS or (explicit and placed) or manual.is_region(eqn):
            return True
        if any(_has_sharding(j, explicit) for j in jaxpr_eval.subjaxprs(eqn.params)):
            return True
    return False


def _collect(jaxpr: core.Jaxpr, named: set[str], regions: set[str]) -> None:
    for eqn in jaxpr.eqns:
        if manual.is_region(eqn):
            regions |= manual.used_axes(eqn.params)
            continue  # inside, every value is per device: nothing to place
        for s in _shardings(eqn.params):
            named |= partition.spec_axes(partition.plain(s.spec))
        for j in jaxpr_eval.subjaxprs(eqn.params):
            _collect(j, named, regions)


class _Rewrite:
    """Evaluates a jaxpr traced on the user's mesh, its shardings on the program's mesh."""

    def __init__(self, user, keep: tuple[str, ...], target):
        self.user = user
        self.keep = keep
        self.target = target

    def context(self):
        """The program's mesh (abstract) and its Explicit axes."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty and self.target is not None:
            mesh = self.target.abstract_mesh
        if mesh.empty:
            return mesh, ()
        explicit = tuple(n for n, t in zip(*_axes(mesh), strict=True) if t == AxisType.Explicit)
        return mesh, explicit

    def spec(self, spec: Any, mesh) -> P:
        """``spec`` with only the axes the program keeps (and its mesh has)."""
        axes = [a for a in self.keep if a in mesh.axis_names]
        return P(*(e if e is P.UNCONSTRAINED else partition.keep_axes((e,), axes)[0] for e in spec))

    def constrain(self, x, sharding: NamedSharding, explicit_too: bool):
        """``x`` placed as ``sharding`` says, on the program's mesh."""
        mesh, explicit = self.context()
        if mesh.empty:
            return x
        spec = self.spec(sharding.spec, mesh)
        auto = P(*(e if e is P.UNCONSTRAINED else _without(e, explicit) for e in spec))
        if explicit_too and explicit:
            fixed = P(*(None if e is P.UNCONSTRAINED else _only(e, explicit) for e in spec))
            if jax.typeof(x).sharding.spec != fixed:
                x = jax.sharding.reshard(x, fixed)
        if all(e is None for e in auto) and explicit:
            return x  # nothing left on Auto axes (an assertion on Explicit ones: done on the trace)
        concrete = self.target if mesh.empty or self.target is not None else None
        where = NamedSharding(concrete, auto) if concrete is not None else auto
        return jax.lax.with_sharding_constraint(x, where)

    def param(self, value: Any) -> Any:
        """A sharding parameter (``out_sharding``...): its Explicit axes, or left to XLA."""
        if not isinstance(value, NamedSharding):
            return self.jaxpr_param(value)
        mesh, explicit = self.context()
        if not explicit:
            return None
        spec = self.spec(value.spec, mesh)
        spec = P(*(e if e is P.UNCONSTRAINED else _only(e, explicit) for e in spec))
        return NamedSharding(mesh, spec)

    def trace(self, fn):
        """``fn()`` on the user's mesh (custom rules are traced there)."""
        return custom_rules.on_mesh(self.user, fn)

    def struct(self, aval, dtype=None) -> jax.ShapeDtypeStruct:
        return custom_rules.user_struct(aval, self.user, dtype)

    def jaxpr_param(self, value: Any) -> Any:
        return jaxpr_eval.nested(value, self.retrace)

    def retrace(self, jaxpr: core.Jaxpr, consts) -> tuple[core.Jaxpr, list[Any]]:
        """A nested jaxpr traced again through :meth:`eval`, its inputs typed on the program's mesh."""
        return jaxpr_eval.retrace(jaxpr, consts, self.eval, self.aval)

    def aval(self, aval) -> Any:
        weak = bool(getattr(aval, "weak_type", False))
        if not hasattr(aval, "shape"):
            return aval
        mesh, explicit = self.context()
        spec = getattr(getattr(aval, "sharding", None), "spec", None)
        if spec is None or not explicit:
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)
        spec = P(*(_only(e, explicit) for e in partition.plain(self.spec(spec, mesh))))
        sharding = NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=weak)

    def eval(self, jaxpr: core.Jaxpr, consts, *args) -> list[Any]:
        # Not under each equation's context: that holds the user's mesh, which this moves off;
        # a typed literal keeps that mesh too: read back as a plain value.
        return jaxpr_eval.evaluate(jaxpr, consts, args, self.equation, literal=jaxpr_eval.plain)

    def equation(self, eqn: core.JaxprEqn, invals: list[Any]) -> Any:
        """One equation's outputs, its shardings on the program's mesh."""
        name, params = eqn.primitive.name, eqn.params
        if name == "sharding_constraint":
            return self.constrain(invals[0], params["sharding"], explicit_too=False)
        if name in ("reshard", "mesh_cast"):
            return self.constrain(invals[0], params["dst_sharding"], explicit_too=True)
        if name in _CALLS and "jaxpr" in params:  # a jit inside the loss: inlined
            body = params["jaxpr"]
            return self.eval(body.jaxpr, body.consts, *invals)
        if name == "custom_jvp_call":
            return jaxpr_eval.bind(eqn, invals, custom_rules.moved_jvp(self, params))
        if name == "custom_vjp_call":
            return custom_rules.moved_vjp(self, params, invals)
        if manual.is_region(eqn):
            return manual.moved(
                params, invals, user=self.user, keep=self.keep, target=self.target,
                sharding=self.param,
            )  # fmt: skip
        return jaxpr_eval.bind(eqn, invals, {k: self.param(v) for k, v in params.items()})


def _without(entry, axes) -> Any:
    return partition.entry(n for n in partition.names(entry) if n not in axes)


def _only(entry, axes) -> Any:
    return partition.entry(n for n in partition.names(entry) if n in axes)
