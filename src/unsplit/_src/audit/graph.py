"""Walking a jaxpr: where every value comes from, through every sub-jaxpr.

The audit follows dataflow forward. Every value of the traced function is a
:class:`Node` whose ``info`` is the set of :class:`Origin` s it depends on: an
input (the example key, a params leaf, a batch leaf), a constant the function
closed over, a key made inside it (``random_seed``), the device index, and
markers the rules add (a loop's varying inputs, a per-microbatch statistic).

Calls (``jit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat``) are inlined: their equations join the caller's *flat program*,
which the padding check can evaluate. Structured control flow and device maps
(``scan``, ``while``, ``cond``, ``shard_map``, ``xla_pmap``) are walked as
nested scopes: loop carries are iterated to a fixpoint first (rules silent),
then walked once more with the rules listening. A higher-order primitive the
walker does not know passes the union of its inputs to its outputs and is not
looked into.

Only the public ``jax.extend.core`` view of jaxprs is used: ``eqn.primitive.name``,
``eqn.params``, ``eqn.invars``/``outvars`` and ``eqn.source_info``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from unsplit._src.audit.values import (
    CALLS,
    EMPTY,
    MARKERS,
    Ctx,
    FlatEqn,
    Info,
    Loop,
    Node,
    Origin,
)


class Rules:
    """Callbacks of a walk; the base class adds nothing and checks nothing."""

    def transfer(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        """Adjusts the outputs' ``info`` (the union of the inputs') and ``facts``; always called."""

    def visit(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        """Called once per primitive equation and context, after its outputs exist."""

    def after_call(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        """Called after an inlined call (``jit``, ...) with its input and output nodes."""

    def enter_map(self, eqn: Any, ins: Sequence[Node], ctx: Ctx) -> list[Info]:
        """Extra origins for each input of a device map (``shard_map``, ``xla_pmap``)."""
        return [EMPTY for _ in ins]

    def start(self, consts: Sequence[Node], ins: Sequence[Node]) -> None:
        """Called with the top jaxpr's constant and input nodes before the walk."""

    def bind_inner(self, eqn: Any, index: int, outer: Node, inner: Node) -> None:
        """``eqn``'s input ``index`` as a scan iteration's slice or a device's block."""

    def loop_exit(self, loop: Loop, carry_in: Sequence[Node], carry_out: Sequence[Node]) -> None:
        """Called after the final walk of a loop body with its carry nodes."""


def union(infos: Iterable[Info]) -> Info:
    out: set[Origin] = set()
    for info in infos:
        out |= info
    return frozenset(out)


def roots(info: Info) -> Info:
    """The origins of ``info`` that are inputs, constants or keys, not rule markers."""
    return frozenset(o for o in info if o.kind not in MARKERS)


def is_key_aval(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


# Long: an interpreter of every control-flow primitive (calls, scan, while, cond, device
# maps); its methods share one walk's state, so it stays one class.
class Walker:
    """Walks a closed jaxpr with :class:`Rules`; records the flat program."""

    def __init__(self, rules: Rules, max_iterations: int = 8):
        self.rules = rules
        self.max_iterations = max_iterations
        self.flat: list[FlatEqn] = []

    def run(self, closed: Any, in_infos: Sequence[Info], const_origin: Any) -> list[Node]:
        """Walks ``closed`` (a ``ClosedJaxpr``); returns the nodes of its outputs.

        ``const_origin(index, value)`` names the origin of each closed-over constant.
        """
        jaxpr = closed.jaxpr
        consts = [
            Node(v.aval, frozenset({const_origin(i, c)}), value=c)
            for i, (v, c) in enumerate(zip(jaxpr.constvars, closed.consts, strict=True))
        ]
        ins = [Node(v.aval, info) for v, info in zip(jaxpr.invars, in_infos, strict=True)]
        self.inputs = ins
        self.rules.start(consts, ins)
        return self.walk(jaxpr, consts, ins, Ctx())

    def walk(self, jaxpr: Any, consts: Sequence[Node], ins: Sequence[Node], ctx: Ctx) -> list[Node]:
        env: dict[Any, Node] = {}
        for var, node in zip(jaxpr.constvars, consts, strict=True):
            env[var] = node
        for var, node in zip(jaxpr.invars, ins, strict=True):
            env[var] = node

        def read(atom: Any) -> Node:
            if isinstance(atom, jex_core.Literal):
                return Node(atom.aval, EMPTY, value=atom.val)
            return env[atom]

        for eqn in jaxpr.eqns:
            in_nodes = [read(v) for v in eqn.invars]
            out_nodes = self._eqn(eqn, in_nodes, ctx)
            for var, node in zip(eqn.outvars, out_nodes, strict=True):
                env[var] = node
        return [read(v) for v in jaxpr.outvars]

    # -- one equation -------------------------------------------------------------------

    def _eqn(self, eqn: Any, ins: list[Node], ctx: Ctx) -> list[Node]:
        name = eqn.primitive.name
        if name in CALLS:
            closed = _call_jaxpr(eqn.params)
            if closed is not None:
                return self._inline(eqn, closed, ins, ctx)
        if name == "scan":
            return self._scan(eqn, ins, ctx)
        if name == "while":
            return self._while(eqn, ins, ctx)
        if name == "cond":
            return self._cond(eqn, ins, ctx)
        if name in ("shard_map", "xla_pmap"):
            return self._device_map(eqn, ins, ctx)
        return self._primitive(eqn, ins, ctx)

    def _primitive(self, eqn: Any, ins: list[Node], ctx: Ctx) -> list[Node]:
        info = union(n.info for n in ins)
        outs = [Node(v.aval, info) for v in eqn.outvars]
        self.rules.transfer(eqn, ins, outs, ctx)
        if ctx.top:
            flat = FlatEqn(eqn, tuple(ins), tuple(outs), ctx.site_of(eqn))
            self.flat.append(flat)
            for node in outs:
                node.producer = flat
        if not ctx.silent:
            self.rules.visit(eqn, ins, outs, ctx)
        return outs

    def _opaque(self, eqn: Any, ins: list[Node], ctx: Ctx, infos: Sequence[Info]) -> list[Node]:
        """Output nodes of a structured equation, recorded whole in the flat program."""
        outs = [Node(v.aval, info) for v, info in zip(eqn.outvars, infos, strict=True)]
        if ctx.top:
            flat = FlatEqn(eqn, tuple(ins), tuple(outs), ctx.site_of(eqn))
            self.flat.append(flat)
            for node in outs:
                node.producer = flat
        return outs

    def _inline(self, eqn: Any, closed: Any, ins: list[Node], ctx: Ctx) -> list[Node]:
        jaxpr, consts = _unpack(closed)
        const_nodes = [
            Node(v.aval, frozenset({Origin("const", _describe(c), ctx.site_of(eqn))}), value=c)
            for v, c in zip(jaxpr.constvars, consts, strict=True)
        ]
        if len(jaxpr.invars) != len(ins):  # an unfamiliar calling convention
            return self._primitive(eqn, ins, ctx)
        outs = self.walk(jaxpr, const_nodes, ins, ctx.enter(eqn))
        self.rules.after_call(eqn, ins, outs, ctx)
        return outs

    def _scan(self, eqn: Any, ins: list[Node], ctx: Ctx) -> list[Node]:
        p = eqn.params
        jaxpr, consts = _unpack(p["jaxpr"])
        n_consts, n_carry = scan_counts(p)
        marker = Origin("loop", "scan", ctx.site_of(eqn), tag=(ctx.path, id(eqn)))
        body_consts = ins[:n_consts]
        carry = [n.info for n in ins[n_consts : n_consts + n_carry]]
        xs = [Node(n.aval, n.info | {marker}) for n in ins[n_consts + n_carry :]]  # outer avals
        for i, inner in enumerate(xs, n_consts + n_carry):
            self.rules.bind_inner(eqn, i, ins[i], inner)
        const_nodes = _consts(jaxpr, consts)
        loop = Loop(eqn, marker)

        def body(carry_infos, silent):
            carry_nodes = [
                Node(n.aval, info | {marker, _carry_marker(marker, i)})
                for i, (n, info) in enumerate(
                    zip(ins[n_consts : n_consts + n_carry], carry_infos, strict=True)
                )
            ]
            inner = ctx.enter(eqn, loops=(*ctx.loops, loop), top=False, silent=ctx.silent or silent)
            outs = self.walk(jaxpr, const_nodes, [*body_consts, *carry_nodes, *xs], inner)
            return carry_nodes, outs

        carry = self._fixpoint(lambda c: [n.info for n in body(c, True)[1][:n_carry]], carry)
        carry_nodes, outs = body(carry, False)
        if not ctx.silent:
            self.rules.loop_exit(loop, carry_nodes, outs[:n_carry])
        infos = [*carry[:n_carry], *(n.info for n in outs[n_carry:])]
        return self._opaque(eqn, ins, ctx, infos)

    def _while(self, eqn: Any, ins: list[Node], ctx: Ctx) -> list[Node]:
        p = eqn.params
        cond_jaxpr, cond_consts = _unpack(p["cond_jaxpr"])
        body_jaxpr, body_consts = _unpack(p["body_jaxpr"])
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        marker = Origin("loop", "while", ctx.site_of(eqn), tag=(ctx.path, id(eqn)))
        loop = Loop(eqn, marker)
        init = ins[nc + nb :]
        cconst = _consts(cond_jaxpr, cond_consts)
        bconst = _consts(body_jaxpr, body_consts)

        def body(carry_infos, silent):
            carry_nodes = [
                Node(n.aval, info | {marker, _carry_marker(marker, i)})
                for i, (n, info) in enumerate(zip(init, carry_infos, strict=True))
            ]
            inner = ctx.enter(eqn, loops=(*ctx.loops, loop), top=False, silent=ctx.silent or silent)
            self.walk(cond_jaxpr, cconst, [*ins[:nc], *carry_nodes], inner)
            outs = self.walk(body_jaxpr, bconst, [*ins[nc : nc + nb], *carry_nodes], inner)
            return carry_nodes, outs

        carry = self._fixpoint(lambda c: [n.info for n in body(c, True)[1]], [n.info for n in init])
        carry_nodes, outs = body(carry, False)
        if not ctx.silent:
            self.rules.loop_exit(loop, carry_nodes, outs)
        return self._opaque(eqn, ins, ctx, carry)

    def _fixpoint(self, step: Any, carry: list[Info]) -> list[Info]:
        for _ in range(self.max_iterations):
            new = [a | b for a, b in zip(carry, step(carry), strict=True)]
            if new == carry:
                break
            carry = new
        return carry

    def _cond(self, eqn: Any, ins: list[Node], ctx: Ctx) -> list[Node]:
        index, operands = ins[0], ins[1:]
        infos = [index.info for _ in eqn.outvars]
        inner = ctx.enter(eqn, top=False)
        for branch in eqn.params["branches"]:
            jaxpr, consts = _unpack(branch)
            const_nodes = _consts(jaxpr, consts)
            outs = self.walk(jaxpr, const_nodes, operands, inner)
            infos = [a | n.info for a, n in zip(infos, outs, strict=True)]
        return self._opaque(eqn, ins, ctx, infos)

    def _device_map(self, eqn: Any, ins: list[Node], ctx: Ctx) -> list[Node]:
        closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if closed is None:
            return self._primitive(eqn, ins, ctx)
        jaxpr, consts = _unpack(closed)
        extra = self.rules.enter_map(eqn, ins, ctx)
        body_ins = [Node(n.aval, n.info | e) for n, e in zip(ins, extra, strict=True)]
        for i, (outer, inner) in enumerate(zip(ins, body_ins, strict=True)):
            self.rules.bind_inner(eqn, i, outer, inner)
        const_nodes = _consts(jaxpr, consts)
        inner = ctx.enter(eqn, device_maps=(*ctx.device_maps, eqn), top=False)
        outs = self.walk(jaxpr, const_nodes, body_ins, inner)
        return self._opaque(eqn, ins, ctx, [n.info for n in outs])


def _consts(jaxpr: Any, values: Sequence[Any]) -> list[Node]:
    """Nodes for a nested jaxpr's closed-over constants (walked for rules only)."""
    return [Node(v.aval, EMPTY, value=c) for v, c in zip(jaxpr.constvars, values, strict=True)]


def _carry_marker(loop_marker: Origin, index: int) -> Origin:
    return Origin("carry", f"carry {index}", loop_marker.site, tag=(loop_marker.tag, index))


def _call_jaxpr(params: dict) -> Any:
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if name in params:
            return params[name]
    return None


def _unpack(closed: Any) -> tuple[Any, list[Any]]:
    """(jaxpr, consts) of a ``ClosedJaxpr`` or an open ``Jaxpr``."""
    if isinstance(closed, jex_core.ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def _describe(value: Any) -> str:
    aval = jax.typeof(value) if hasattr(value, "dtype") else None
    return "a constant" if aval is None else f"a constant {aval.str_short()}"


def used_as_key(eqn: Any) -> list[int]:
    """Indices of ``eqn``'s inputs that it uses as PRNG key material."""
    name = eqn.primitive.name
    if name in ("random_bits", "random_fold_in", "random_split", "random_unwrap"):
        return [0]
    if name == "random_wrap":
        return [0]
    if name == "threefry2x32":
        return [0, 1]
    if name == "rng_bit_generator":
        return [0]
    return []


def scan_counts(params: dict) -> tuple[int, int]:
    """A scan's (consts, carry) input counts: ``num_consts``/``num_carry`` (JAX <= 0.11), or
    the lengths of the first two groups of ``ft_in`` (JAX 0.12: consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft_in = params["ft_in"]  # a flat tree of three groups; indexing it gives leaves
    consts, carry = getattr(ft_in, "elts", ft_in)[:2]
    return len(consts), len(carry)
