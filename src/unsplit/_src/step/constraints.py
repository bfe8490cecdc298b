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
* a ``jit`` inside the loss is inlined; a ``custom_jvp`` keeps its rule; a
  ``custom_vjp`` is differentiated through its primal computation (its bwd rule
  checks the cotangents' types on the user's mesh, which the program's values
  do not have): the same gradient unless the rule is not the primal's derivative
  (a straight-through estimator), in a loss with sharding annotations only.

A loss with no sharding in it runs as it is. :func:`activation_axes` lists the
mesh axes a loss's annotations name: bitwise mode makes those that shard
neither the batch nor the params (context parallelism: a ``seq`` axis) part of
the group.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.linear_util as lu
import numpy as np
from jax.extend import core
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import frozen as frozen_lib
from unsplit._src import partition
from unsplit._src.audit import state as audit_state
from unsplit._src.step import jaxpr_eval, settings, state_guard

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


def activation_axes(loss_fn, user_mesh, params, example, key) -> set[str]:
    """The mesh axes the loss's sharding annotations name (traced on the user's mesh).

    ``params``, ``example`` and ``key`` are arrays or ``ShapeDtypeStruct``s of
    one example. A loss that does not trace there gives ``set()`` (its error
    comes where it runs).
    """
    leaves, treedef = jax.tree.flatten((params, example, key))
    mask = [_is_array(x) for x in leaves]
    closed, _ = _user_trace(frozen_lib.bound(loss_fn), treedef, leaves, mask, user_mesh)
    if closed is None:
        return set()
    found: set[str] = set()
    _collect(closed.jaxpr, found)
    return found & set(user_mesh.axis_names)


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
        closed, shape = _outside_manual(trace)
    except state_guard.DroppedStateError:
        raise
    except Exception:  # the loss runs as it is: its own error (if any) comes from there
        return None, None
    return closed, jax.tree.structure(shape)


def _outside_manual(fn):
    """``fn()``, in a thread of its own when called inside a ``shard_map`` region (an FSDP
    group's chunk program is manual over the chunk axes): the user's mesh cannot be
    entered there, and JAX's trace and mesh contexts are per thread. The caller's other
    settings (``jax.default_matmul_precision(...)`` around the step) go along: the
    loss's jaxpr is traced there (:mod:`unsplit._src.step.settings`)."""
    if AxisType.Manual not in tuple(jax.sharding.get_abstract_mesh().axis_types):
        return fn()
    return settings.in_thread(fn)


def _user_aval(x: Any, user_mesh) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x) if isinstance(x, jax.Array) else x
    dtype, shape = aval.dtype, tuple(aval.shape)
    weak = bool(getattr(aval, "weak_type", False))
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    explicit = [n for n, t in zip(*_axes(user_mesh), strict=True) if t == AxisType.Explicit]
    if spec is None or not partition.spec_axes(_plain(spec)) & set(explicit):
        return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
    spec = partition.keep_axes(_plain(spec), explicit)
    sharding = NamedSharding(user_mesh.abstract_mesh, spec)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=weak)


def _axes(mesh) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    return tuple(mesh.axis_names), tuple(mesh.axis_types)


def _plain(spec: Any) -> P:
    """``spec`` with ``P.UNCONSTRAINED`` entries as ``None`` (for reading axis names)."""
    return P(*(None if e is P.UNCONSTRAINED else e for e in spec))


def _shardings(params: dict) -> list[Any]:
    return [v for v in params.values() if isinstance(v, NamedSharding)]


def _subjaxprs(params: dict) -> list[Any]:
    found = []
    for v in params.values():
        for item in v if isinstance(v, tuple | list) else (v,):
            if isinstance(item, core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, core.Jaxpr):
                found.append(item)
    return found


def _has_sharding(jaxpr: core.Jaxpr, explicit: bool) -> bool:
    """A constraint, or (on a mesh with Explicit axes) an ``out_sharding``. The sharding
    parameters JAX adds itself (an ``iota``'s, a ``broadcast``'s) follow the program's mesh
    there: a loss with only those runs as it is, the same program as on one device."""
    for eqn in jaxpr.eqns:
        placed = isinstance(eqn.params.get("out_sharding"), NamedSharding)
        if eqn.primitive.name in _CONSTRAINTS or (explicit and placed):
            return True
        if any(_has_sharding(j, explicit) for j in _subjaxprs(eqn.params)):
            return True
    return False


def _collect(jaxpr: core.Jaxpr, found: set[str]) -> None:
    for eqn in jaxpr.eqns:
        for s in _shardings(eqn.params):
            found |= partition.spec_axes(_plain(s.spec))
        for j in _subjaxprs(eqn.params):
            _collect(j, found)


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

    def custom(self, params: dict) -> dict:
        """A custom_jvp call's params, its jvp rule's jaxpr moved like the body.

        The rule is traced lazily, from the types it had on the user's mesh: it is
        traced there, then again through :meth:`eval`.
        """
        new = dict(params, call_jaxpr=self.jaxpr_param(params["call_jaxpr"]))
        field = "jvp_jaxpr_fun"
        thunk = params[field]

        def moved(*zeros):
            def rule():
                with jax.sharding.use_abstract_mesh(self.user.abstract_mesh):
                    return thunk.call_wrapped(*zeros)

            jaxpr, consts, *rest = _outside_manual(rule)
            return (*self.retrace(jaxpr, consts), *rest)

        new[field] = lu.wrap_init(moved, debug_info=thunk.debug_info)
        return new

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
        spec = P(*(_only(e, explicit) for e in _plain(self.spec(spec, mesh))))
        sharding = NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=weak)

    def eval(self, jaxpr: core.Jaxpr, consts, *args) -> list[Any]:
        # Not under each equation's context: that holds the user's mesh, which this moves off;
        # a typed literal keeps that mesh too: read back as a plain value.
        return jaxpr_eval.evaluate(jaxpr, consts, args, self.equation, literal=_plain_literal)

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
            return jaxpr_eval.bind(eqn, invals, self.custom(params))
        if name == "custom_vjp_call":
            # Its bwd rule checks cotangents against the types on the user's mesh, which
            # the program's values do not have: differentiated through its primal instead.
            body = params["call_jaxpr"]
            return self.eval(body.jaxpr, body.consts, *invals)
        return jaxpr_eval.bind(eqn, invals, {k: self.param(v) for k, v in params.items()})


def _plain_literal(value: Any) -> Any:
    """A literal's value without the mesh its type was traced on (a plain NumPy array)."""
    return np.asarray(value).view(np.ndarray) if isinstance(value, np.ndarray) else value


def _without(entry, axes) -> Any:
    return partition.entry(n for n in partition.names(entry) if n not in axes)


def _only(entry, axes) -> Any:
    return partition.entry(n for n in partition.names(entry) if n in axes)
