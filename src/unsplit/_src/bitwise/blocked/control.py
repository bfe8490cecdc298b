"""The canonical-block rewrite's rules for equations with nested jaxprs.

``cond``, ``while`` and ``scan`` run their bodies through the same rewrite (a
loop's carry keeps the splits it settles on: split dims only spread, so a fixed
point comes soon), a ``remat`` body under ``jax.checkpoint`` with its policy.
They always go through the rewrite, also when no operand is split, so the float
sums inside them are the rewrite's too.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from unsplit._src.audit import graph
from unsplit._src.bitwise.blocked.values import Dims, Unsupported, V, dims_of
from unsplit._src.step import jaxpr_eval


def out_dims(rw, jaxpr, consts, ops: list[V]) -> list[Dims]:
    """The splits of a nested jaxpr's outputs for these operands (traced, not run)."""
    seen: list[Dims] = []

    def run(*xs):
        got = rw.run(jaxpr, consts, [V(x, v.dims) for x, v in zip(xs, ops, strict=True)])
        seen.extend(v.dims for v in got)
        return [v.value for v in got]

    jax.make_jaxpr(run)(*[v.value for v in ops])
    return seen


def agree(options: list) -> list[Dims]:
    """Per output, the split every option can be brought to (exactly): the common one, or
    whole where the options differ."""
    out = []
    for per in zip(*options, strict=True):
        split = {d for d in per if any(d)}
        out.append(split.pop() if len(split) == 1 else ((),) * len(per[0]))
    return out


def local_fn(rw, jaxpr, consts, ops: list[V], dims, fixed=()):
    """The nested jaxpr as a function of its blocks (``fixed``: leading operands closed
    over), its outputs brought to ``dims``."""

    def fn(*xs):
        got = rw.run(
            jaxpr, consts,
            [*fixed, *(V(x, v.dims) for x, v in zip(xs, ops[len(fixed):], strict=True))],
        )  # fmt: skip
        return [rw.to_dims(v, d) for v, d in zip(got, dims, strict=True)]

    return fn


def fixed_point(rw, body, fixed: list[V], carry: list[V], extra=()) -> list[Dims]:
    """The carry's splits a loop keeps: split dims only spread, so a fixed point comes soon
    (``extra``: the body's other operands after the carry, e.g. a scan's slices)."""
    for _ in range(len(carry) + 1):
        dims = [v.dims for v in carry]
        out = out_dims(rw, body.jaxpr, body.consts, [*fixed, *carry, *extra])[: len(carry)]
        new = agree([dims, out])
        if list(new) == dims:
            return dims
        carry[:] = [V(rw.to_dims(v, d), d) for v, d in zip(carry, new, strict=True)]
    raise Unsupported("a loop whose carry's split does not settle")


def cond(rw, eqn, vals):
    index, *ops = vals
    if any(index.dims):
        raise Unsupported("a cond on a split predicate")
    branches = eqn.params["branches"]
    dims = agree([out_dims(rw, b.jaxpr, b.consts, ops) for b in branches])
    fns = [local_fn(rw, b.jaxpr, b.consts, ops, dims) for b in branches]
    outs = jax.lax.switch(index.value, fns, *[v.value for v in ops])
    return [V(o, d) for o, d in zip(outs, dims, strict=True)]


def while_loop(rw, eqn, vals):
    p = eqn.params
    cconsts, bconsts = vals[: p["cond_nconsts"]], vals[p["cond_nconsts"] :][: p["body_nconsts"]]
    carry = list(vals[p["cond_nconsts"] + p["body_nconsts"] :])
    body = p["body_jaxpr"]
    dims = fixed_point(rw, body, list(bconsts), carry)
    test_jaxpr = p["cond_jaxpr"]
    test = local_fn(rw, test_jaxpr.jaxpr, test_jaxpr.consts, [*cconsts, *carry], [()], cconsts)
    step = local_fn(rw, body.jaxpr, body.consts, [*bconsts, *carry], dims, bconsts)
    out = jax.lax.while_loop(lambda c: test(*c)[0], lambda c: step(*c), [v.value for v in carry])
    return [V(o, d) for o, d in zip(out, dims, strict=True)]


def scan(rw, eqn, vals):
    p = eqn.params
    nconsts, ncarry = graph.scan_counts(p)  # JAX 0.12 names them otherwise
    consts, carry, xs = (
        vals[:nconsts],
        list(vals[nconsts : nconsts + ncarry]),
        vals[nconsts + ncarry :],
    )
    if any(x.dims and x.dims[0] for x in xs):
        raise Unsupported("a scan over a split dimension")
    body = p["jaxpr"]
    slices = [V(jax.ShapeDtypeStruct(np.shape(x.value)[1:], x.value.dtype), x.dims[1:]) for x in xs]
    dims = fixed_point(rw, body, list(consts), carry, slices)
    ys = out_dims(rw, body.jaxpr, body.consts, [*consts, *carry, *slices])[ncarry:]
    step = local_fn(rw, body.jaxpr, body.consts, [*consts, *carry, *slices], [*dims, *ys], consts)

    def f(c, x):
        out = step(*c, *x)
        return out[:ncarry], out[ncarry:]

    c, y = jax.lax.scan(
        f, [v.value for v in carry], [x.value for x in xs], length=p["length"],
        reverse=p["reverse"], unroll=p["unroll"],
    )  # fmt: skip
    return [
        *(V(o, d) for o, d in zip(c, dims, strict=True)),
        *(V(o, ((), *d)) for o, d in zip(y, ys, strict=True)),
    ]


def remat(rw, eqn, vals):
    p = eqn.params
    body = p["jaxpr"]
    dims = out_dims(rw, body, (), vals)
    fn = local_fn(rw, body, (), vals, dims)
    wrapped = jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])
    outs = wrapped(*[v.value for v in vals])
    return [V(o, d) for o, d in zip(outs, dims, strict=True)]


def region(rw, eqn, vals):
    """The loss's own ``shard_map`` (a ring attention) over axes this rewrite is manual over
    already: its operands split as its in_specs say (exact), its body run on them as it was
    traced (its collectives name axes that are manual here; its values are per device and
    its own order of adds is the body's), its outputs split as its out_specs say."""
    p = eqn.params
    axes = set(p.get("manual_axes", p.get("newly_manual_axes", ())))
    if not axes <= set(rw.axes):
        raise Unsupported(f"a shard_map over {sorted(axes)}, axes this program is not manual over")

    def dims(spec, ndim) -> Dims:
        return tuple(tuple(n for n in d if n in rw.axes) for d in dims_of(spec, ndim))

    local = [rw.to_dims(v, dims(s, len(v.dims))) for v, s in zip(vals, p["in_specs"], strict=True)]
    body = p["jaxpr"]
    consts = body.consts if hasattr(body, "consts") else ()
    body = getattr(body, "jaxpr", body)
    outs = jaxpr_eval.evaluate(body, consts, local, lambda e, xs: rw.bind(e, xs))
    return [V(o, dims(s, np.ndim(o))) for o, s in zip(outs, p["out_specs"], strict=True)]


RULES: dict[str, Any] = {
    "shard_map": region,
    "cond": cond,
    "while": while_loop,
    "scan": scan,
    "checkpoint": remat,
    "remat": remat,
    "remat2": remat,
}
