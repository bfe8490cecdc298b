"""Where noise meets the batch's rows: the second ``batch_draw`` signal.

Tracing the step with a batch twice as large finds a draw whose shape follows
the batch size. A loop over microbatches whose size is a constant of the code
(``size = B // K`` with module constants, as config-driven trainers write it)
draws the same shapes for any batch, so that signal misses it. This walk
follows two facts about the axes of every value:

* ``rows``: the axes that index rows of the batch: a batch argument's leading
  axis (both leading axes of a batch that a ``jax.pmap`` ped step takes stacked
  per device), followed through slices, reshapes (``(B, D) -> (K, B // K, D)``
  keeps both factors), transposes, broadcasts, reductions, ``dot_general``,
  the iterations of a ``scan`` and the blocks of a device map;
* ``noise``: for each random draw, the axes that are the draw's own (not
  broadcast), followed the same way.

An elementwise operation where a draw's own axis meets an axis of rows of
another operand (``x + noise``, ``jnp.where(keep, x, 0)``) gives each example
the noise of its *position* in the (micro)batch: a :class:`Meeting`. Whether
the draw is per-example is decided by its key (:mod:`batched` keeps only
draws from one key per iteration): a vmapped draw over per-example keys has a
key per row, and a hash of per-row counters (``unsplit.example_keys`` ids)
carries the rows itself, so its noise axes are rows already.

Primitives the walk does not know drop both facts (unless they keep the
shape, as elementwise ones do): the check would rather miss a meeting than
invent one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from unsplit._src.audit.finding import Site
from unsplit._src.audit.keys import KeyRules
from unsplit._src.audit.values import Ctx, Node

ROWS = "rows"  # facts key: frozenset of the axes that index rows of the batch
NOISE = "noise"  # facts key: {draw tag: frozenset of the draw's own axes}
_DRAWS = frozenset({"random_bits", "threefry2x32", "rng_bit_generator"})
_SAME_RANK = frozenset(
    {"slice", "dynamic_slice", "rev", "pad", "dynamic_update_slice", "concatenate", "split"}
    | {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"}
)
_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or"}
    | {"argmax", "argmin"}
)


class Meeting(NamedTuple):
    """A draw's own axis meeting an axis of batch rows in an elementwise operation."""

    site: Site  # where the noise meets the rows
    size: int  # the length of the shared axis
    rows: str  # which batch leaf the rows come from


def draw_tag(ctx: Ctx, eqn: Any) -> tuple:
    """The tag of a draw (as :class:`keys.Draw` s are told apart): its call path and equation."""
    return (ctx.path, id(eqn))


class RowRules(KeyRules):
    """:class:`KeyRules` plus the ``rows`` and ``noise`` facts and their meetings.

    Args:
        in_rows: for each input of the top jaxpr, the axes that index rows of
            the batch (``frozenset({0})`` for a batch leaf, empty otherwise).
    """

    def __init__(self, in_rows: Sequence[frozenset[int]] = ()) -> None:
        super().__init__()
        self.in_rows = list(in_rows)
        self.meetings: dict[tuple, Meeting] = {}  # draw tag -> its first meeting with rows

    def start(self, consts: Sequence[Node], ins: Sequence[Node]) -> None:
        for node, rows in zip(ins, self.in_rows, strict=False):
            if rows:
                node.facts[ROWS] = rows
        for node in consts:  # the batch's NumPy leaves, held static by a Python-level step
            if node.aval.ndim and any(o.kind == "data" for o in node.info):
                node.facts[ROWS] = frozenset({0})

    def bind_inner(self, eqn: Any, index: int, outer: Node, inner: Node) -> None:
        name = eqn.primitive.name
        ndim = outer.aval.ndim
        if name == "scan":  # one iteration: the leading axis is gone
            pairs = [(a, a - 1) for a in range(1, ndim)]
        elif name == "xla_pmap":
            axes = eqn.params.get("in_axes", ())
            gone = axes[index] if index < len(axes) else None
            pairs = [(a, a - (gone is not None and a > gone)) for a in range(ndim) if a != gone]
        else:  # shard_map: a device's block keeps every axis
            pairs = [(a, a) for a in range(ndim)]
        _carry_facts(outer, inner, pairs)
        if pmap_stacked(eqn, index) and 0 in outer.facts.get(ROWS, ()):
            # (devices, B, ...): an example's row is (device, position); both index rows.
            inner.facts[ROWS] = inner.facts.get(ROWS, frozenset()) | {b for a, b in pairs if a == 1}

    def transfer(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        super().transfer(eqn, ins, outs, ctx)
        name = eqn.primitive.name
        in_shapes = [_shape(v) for v in eqn.invars]
        for out_var, out in zip(eqn.outvars, outs, strict=True):
            shape = _shape(out_var)
            for k, node in enumerate(ins):
                pairs = _axis_pairs(name, eqn, in_shapes, k, shape)
                if pairs:
                    _carry_facts(node, out, pairs, merge=True)
        if name in _DRAWS:
            tag = draw_tag(ctx, eqn)
            for out in outs[-1:] if name == "rng_bit_generator" else outs:
                _mark_noise(out, tag)
        elif len(outs) == 1:
            self._meet(eqn, ins, in_shapes, _shape(eqn.outvars[0]), ctx)

    def after_call(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        super().after_call(eqn, ins, outs, ctx)
        name = str(eqn.params.get("name", ""))
        if "threefry" in name and len(ins) == 4:  # a jitted cipher: a draw (see KeyRules)
            for out in outs:
                _mark_noise(out, draw_tag(ctx, eqn))

    def _meet(self, eqn: Any, ins: Sequence[Node], in_shapes: list, shape: tuple, ctx: Ctx):
        """Records a draw's own axis meeting another operand's axis of rows."""
        full = [n for n, s in zip(ins, in_shapes, strict=True) if s == shape and s]
        if len(full) < 2:
            return
        for a in full:
            for tag, axes in a.facts.get(NOISE, {}).items():
                if tag in self.meetings:
                    continue
                for r in sorted(axes - a.facts.get(ROWS, frozenset())):
                    rows = [b for b in full if b is not a and r in b.facts.get(ROWS, ())]
                    if rows and shape[r] > 1:
                        data = sorted(o.label for o in rows[0].info if o.kind == "data")
                        label = data[0] if data else "the batch"
                        self.meetings[tag] = Meeting(ctx.site_of(eqn), shape[r], label)
                        break


def pmap_stacked(eqn: Any, index: int) -> bool:
    """Whether ``eqn`` is a ``jax.pmap`` taking input ``index`` stacked per device.

    ``xla_pmap`` maps axis 0 away; a ``pmap`` written as a ``shard_map`` (JAX
    >= 0.8) gives each device a block of one and squeezes that axis.
    """
    name = eqn.primitive.name
    if name == "xla_pmap":
        axes = eqn.params.get("in_axes", ())
        return index < len(axes) and axes[index] == 0
    if name != "shard_map":
        return False
    specs = eqn.params.get("in_specs", ())
    if index >= len(specs) or not len(specs[index]) or specs[index][0] is None:
        return False
    closed = eqn.params["jaxpr"]
    jaxpr = getattr(closed, "jaxpr", closed)
    var = jaxpr.invars[index]
    if _shape(var)[:1] != (1,):
        return False
    return any(
        e.primitive.name == "squeeze"
        and tuple(e.params["dimensions"]) == (0,)
        and e.invars[0] is var
        for e in jaxpr.eqns
    )


def _shape(var: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(var, "aval", None), "shape", ()))


def _mark_noise(node: Node, tag: tuple) -> None:
    node.facts[NOISE] = {tag: frozenset(range(node.aval.ndim))}


Pairs = Sequence[tuple[int, int]]  # (input axis, output axis); an input axis may split in two


def _carry_facts(src: Node, dst: Node, pairs: Pairs, *, merge: bool = False) -> None:
    """``dst`` gets ``src``'s rows and noise axes through ``pairs``."""

    def moved(axes):
        return frozenset(b for a, b in pairs if a in axes)

    rows = moved(src.facts.get(ROWS, ()))
    if rows:
        dst.facts[ROWS] = (dst.facts.get(ROWS, frozenset()) | rows) if merge else rows
    noise = dict(dst.facts.get(NOISE, {})) if merge else {}
    for tag, axes in src.facts.get(NOISE, {}).items():
        if moved(axes):
            noise[tag] = noise.get(tag, frozenset()) | moved(axes)
    if noise:
        dst.facts[NOISE] = noise


def _axis_pairs(name: str, eqn: Any, in_shapes: list, k: int, out: tuple) -> list:
    """How input ``k``'s axes land in the output of shape ``out`` (``[]`` when unknown)."""
    shape = in_shapes[k]
    if not shape or name in _DRAWS:
        return []
    p = eqn.params
    if name == "broadcast_in_dim" and k == 0:
        return [(a, d) for a, d in enumerate(p["broadcast_dimensions"]) if shape[a] == out[d]]
    if name == "reshape" and k == 0:
        return _reshape_pairs(shape, out)
    if name == "squeeze" and k == 0:
        kept = [a for a in range(len(shape)) if a not in p["dimensions"]]
        return [(a, i) for i, a in enumerate(kept)]
    if name == "transpose" and k == 0:
        return [(a, i) for i, a in enumerate(p["permutation"])]
    if name in _SAME_RANK and len(shape) == len(out):
        return [(a, a) for a in range(len(out))]
    if name in _REDUCTIONS and k == 0:
        axes = p.get("axes", (p.get("axis"),))
        kept = [a for a in range(len(shape)) if a not in axes]
        return [(a, i) for i, a in enumerate(kept)] if len(kept) == len(out) else []
    if name == "dot_general" and k < 2:
        (contract_l, contract_r), (batch_l, batch_r) = p["dimension_numbers"]
        batch, contract = (batch_l, contract_l) if k == 0 else (batch_r, contract_r)
        free = [a for a in range(len(shape)) if a not in batch and a not in contract]
        lhs_free = len(in_shapes[0]) - len(contract_l) - len(batch_l)
        start = len(batch) + (0 if k == 0 else lhs_free)
        return [(a, i) for i, a in enumerate(batch)] + [(a, start + i) for i, a in enumerate(free)]
    if shape == out and name not in _REDUCTIONS:  # elementwise (and casts, selects, hashes)
        return [(a, a) for a in range(len(out))]
    return []


def _reshape_pairs(shape: tuple, out: tuple) -> list:
    """Axes of a reshape, grouped where the running sizes agree: ``(B, D) -> (K, B // K, D)``
    maps axis 0 to both 0 and 1 (a microbatch index and a position: both index rows)."""
    pairs = []
    i = j = 0
    while i < len(shape) and j < len(out):
        group_in, group_out = [i], [j]
        size_in, size_out = shape[i], out[j]
        while size_in != size_out:
            if size_in < size_out and i + 1 < len(shape):
                i += 1
                group_in.append(i)
                size_in *= shape[i]
            elif size_out < size_in and j + 1 < len(out):
                j += 1
                group_out.append(j)
                size_out *= out[j]
            else:
                return pairs
        pairs += [(a, b) for a in group_in for b in group_out if shape[a] > 1 and out[b] > 1]
        i += 1
        j += 1
    return pairs
