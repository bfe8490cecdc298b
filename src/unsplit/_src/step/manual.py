"""A loss's own ``shard_map`` (a ring attention over a sequence axis), on the program's mesh.

A loss may hold a ``shard_map`` over axes of the user's mesh: ring attention over a
``seq`` axis, as ringattention's README calls it (``shard_map(ring_attention, mesh=mesh,
in_specs=P(None, "seq", None, None), ...)``) and :func:`unsplit.ring_attention` is
called. The step's programs do not run on that mesh as the user declared it
(:mod:`~unsplit._src.step.constraints`: default mode turns the batch axes Auto; bitwise
mode runs each chunk program on its group's devices), so :func:`moved` declares the region
again on the program's mesh:

* manual over the axes of the user's region that the program keeps (the sequence axis;
  in bitwise mode the axes a region uses join the group, :func:`used_axes`); the other
  axes of the user's mesh (the batch axes: the step vmaps the loss over them) stay the
  program's, so each example's region runs on the devices that hold it;
* with the same specs and the same body, run as it was traced: inside the region every
  value is per device and nothing names the mesh, and its custom derivative rules (ring
  attention's memory-saving backward pass) stay as the user wrote them.

A region whose specs or collectives name an axis the program does not keep (a batch
axis) is refused with the fix: a loss is written for one example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core
from jax.sharding import NamedSharding

from unsplit._src import partition
from unsplit._src.step import custom_rules, jaxpr_eval

# Collectives name their axes in one of these parameters (psum: ``axes``; ppermute,
# all_gather, axis_index: ``axis_name``).
_AXIS_PARAMS = ("axes", "axis_name")


def is_region(eqn: core.JaxprEqn) -> bool:
    return eqn.primitive.name == "shard_map"


def manual_axes(params: dict) -> frozenset[str]:
    """The axes a ``shard_map`` equation is manual over."""
    return frozenset(params.get("manual_axes", params.get("newly_manual_axes", ())))


def used_axes(params: dict) -> set[str]:
    """The axes a ``shard_map`` equation's specs and body's collectives name (of its manual ones).

    An axis the region is manual over but never uses (a ``shard_map`` over the
    whole mesh whose specs name one axis) plays no part in it.
    """
    found = {n for s in (*params["in_specs"], *params["out_specs"]) for n in _spec_names(s)}
    _collectives(params["jaxpr"], found)
    return found & manual_axes(params)


def _spec_names(spec: Any) -> set[str]:
    return partition.spec_axes(partition.plain(spec)) if spec is not None else set()


def _collectives(jaxpr: core.Jaxpr, found: set[str]) -> None:
    for eqn in jaxpr.eqns:
        for name in _AXIS_PARAMS:
            value = eqn.params.get(name)
            for axis in value if isinstance(value, tuple | list) else (value,):
                if isinstance(axis, str):
                    found.add(axis)
        for sub in jaxpr_eval.subjaxprs(eqn.params):
            _collectives(sub, found)


def moved(
    params: dict,
    invals: list[Any],
    *,
    user,
    keep: tuple[str, ...],
    target,
    sharding: Callable[[NamedSharding], Any],
) -> list[Any]:
    """A ``shard_map`` equation's outputs, its region declared on the program's mesh.

    Args:
        params: the equation's params (traced on the user's mesh ``user``).
        invals: its inputs' values in the program.
        user: the user's mesh.
        keep: the mesh axes the program keeps (batch axes are not among them).
        target: the mesh of a program with no mesh context (bitwise mode's group
            mesh), else ``None``.
        sharding: maps a sharding parameter of an equation in the body onto the
            program's mesh.
    """
    mesh = _program_mesh(target)
    kept = set() if mesh is None else set(mesh.axis_names) & set(keep)
    used = used_axes(params)
    if used - kept:
        raise ValueError(
            f"the loss's shard_map uses mesh axes {sorted(used - kept)} (in its in_specs, "
            f"out_specs or a collective), which the step's program does not keep: batch axes "
            f"(the step vmaps the loss over them) or axes outside {sorted(kept)}. Expected: "
            "a loss written for one example splits it over another axis of the mesh (e.g. a "
            "'seq' axis: in_specs=P(None, 'seq', None, None)). Fix: shard_map over that "
            "axis only, or leave it out of batch_axes."
        )
    region = Region(user, manual_axes(params), params["check_vma"], sharding)
    body: core.Jaxpr = params["jaxpr"]
    mapped = jax.shard_map(
        lambda *args: tuple(region.eval(body, (), *args)),
        mesh=mesh,
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=set(manual_axes(params) & kept),
        check_vma=params["check_vma"],
    )
    return list(mapped(*invals))


class Region:
    """Evaluates a ``shard_map`` body traced in the user's region, inside the program's.

    Inside, every value is per device: the equations run as traced, their nested
    jaxprs (a scan's body, a ``checkpoint``'s) traced again here with their
    types' manual axes (how each value varies over the region's axes), and custom
    rules traced in the user's region (:mod:`~unsplit._src.step.custom_rules`).
    Implements :class:`~unsplit._src.step.custom_rules.Place`.
    """

    def __init__(self, user, axes: frozenset[str], check_vma: bool, sharding):
        self.user = user
        self.axes = axes
        self.check_vma = check_vma
        self.sharding = sharding

    def trace(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` inside the user's region: its mesh, its manual axes bound (a trace of
        an empty ``shard_map`` over them, whose body calls ``fn``)."""
        found = []

        def body():
            found.append(fn())
            return ()

        region = jax.shard_map(
            body, mesh=self.user, in_specs=(), out_specs=(), axis_names=set(self.axes),
            check_vma=self.check_vma,
        )  # fmt: skip
        custom_rules.on_mesh(self.user, lambda: jax.make_jaxpr(region)())
        return found[0]

    def struct(self, aval: Any, dtype: Any = None) -> jax.ShapeDtypeStruct:
        """``aval`` as a type of the current region: its manual axes kept."""
        return jaxpr_eval.plain_aval(aval, dtype)

    def eval(self, jaxpr: core.Jaxpr, consts: Any, *args: Any) -> list[Any]:
        return jaxpr_eval.evaluate(jaxpr, consts, args, self.equation, literal=jaxpr_eval.plain)

    def retrace(self, jaxpr: core.Jaxpr, consts: Any) -> tuple[core.Jaxpr, list[Any]]:
        return jaxpr_eval.retrace(jaxpr, consts, self.eval, self.struct)

    def equation(self, eqn: core.JaxprEqn, invals: list[Any]) -> Any:
        name, params = eqn.primitive.name, eqn.params
        if name in ("jit", "pjit", "closed_call", "core_call") and "jaxpr" in params:
            body = params["jaxpr"]  # inlined, as in the rest of the loss
            return self.eval(body.jaxpr, body.consts, *invals)
        if name == "custom_jvp_call":
            return jaxpr_eval.bind(eqn, invals, custom_rules.moved_jvp(self, params))
        if name == "custom_vjp_call":
            return custom_rules.moved_vjp(self, params, invals)
        moved_params = {
            k: self.sharding(v)
            if isinstance(v, NamedSharding)
            else jaxpr_eval.nested(v, self.retrace)
            for k, v in params.items()
        }
        return jaxpr_eval.bind(eqn, invals, moved_params)


def _program_mesh(target):
    """The program's mesh: its context's (abstract), else the target (``None``: no mesh,
    where a region cannot run)."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return context
    return target
