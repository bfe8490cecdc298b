"""Padding stability: does an example keep its noise when padded to another length?

The loss is traced twice: at the example's shapes, and with the leading axis
of every example leaf halved (a shorter padded length). In each trace the
*noise* is the part of the flat program computable from the example key and
constants alone (key derivations, hashes, ``random_bits``, thresholds, masks);
its *frontier* is the noise values the rest of the loss consumes (a dropout
mask meeting the activations). The two frontiers are matched in program order
and evaluated with a fixed key (only the noise is evaluated, never the
model: no params or data are needed), and the short trace's values must equal
the long trace's on the shared prefix of every axis. A mismatch means an
element's bits depend on the padded length: ``padding_unstable``.

This is exact for any implementation of the draws (``random_bits``,
``threefry2x32`` per coordinate, ``fold_in`` per position), and catches
``jax_threefry_partitionable=False`` too. Draws inside loops, branches or
device maps cannot be evaluated alone; for those the shapes of
``random_bits`` are compared instead (threefry bits of element ``i`` are a
function of its row-major flat index, so a shape is stable iff the strides
of the axes the short shape uses are unchanged). Frontier values larger
than :data:`MAX_ELEMENTS` are skipped with an :class:`AuditWarning`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core as jax_core

from unsplit._src.audit.finding import AuditWarning, Finding, Site, finding
from unsplit._src.audit.graph import Walker
from unsplit._src.audit.keys import THREEFRY_DTYPE, Draw
from unsplit._src.audit.values import COLLECTIVES, DRAWS, FlatEqn, Node

MAX_ELEMENTS = 1 << 20
KEYS = 16  # keys the noise is evaluated with
_NOT_EVALUABLE = COLLECTIVES | {"random_seed"}


class Program(NamedTuple):
    """One trace of the loss, walked: its flat program, key input, outputs and draws."""

    walker: Walker
    key: Node
    outputs: Sequence[Node]
    draws: Sequence[Draw]


def padding_findings(long: Program, short: Program) -> list[Finding]:
    """``padding_unstable`` findings from the loss traced at two padded lengths."""
    found: list[Finding] = []
    keys = _dummy_keys(long.key.aval)
    if keys is None:
        return found
    a, b = frontier(long), frontier(short)
    if len(a) != len(b) or any(x.aval.ndim != y.aval.ndim for x, y in zip(a, b, strict=True)):
        warnings.warn(
            f"unsplit.audit: the padding check was skipped: the loss at two lengths consumes "
            f"different noise ({len(a)} vs {len(b)} values), so its draws cannot be matched.",
            AuditWarning,
            stacklevel=3,
        )
        return found
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if _prefix_of(y.aval.shape, x.aval.shape)]
    big = [x for x, _ in pairs if math.prod(x.aval.shape) > MAX_ELEMENTS]
    if big:
        warnings.warn(
            f"unsplit.audit: the padding check skipped {len(big)} noise value(s) larger than "
            f"{MAX_ELEMENTS} elements (e.g. {big[0].aval.str_short()} at {big[0].producer.site}).",
            AuditWarning,
            stacklevel=3,
        )
    pairs = [(x, y) for x, y in pairs if math.prod(x.aval.shape) <= MAX_ELEMENTS]
    values = _evaluate_pairs(long, short, pairs, keys)
    for (x, y), (a, b) in zip(pairs, values, strict=True):
        if a is not None and b is not None and not _equal_prefix(a, b):
            found.append(_unstable(_draw_site(x), x.aval.shape, y.aval.shape))
    found += _structural(long.draws, short.draws)
    return found


def frontier(program: Program) -> list[Node]:
    """The noise values (from the key and constants only) that the rest of the loss reads.

    Noise from rbg/unsafe_rbg keys is left out: those are reported as
    ``unsafe_key``, and their bits under the evaluation's ``vmap`` over keys
    are not their bits one key at a time.
    """
    known = {id(program.key)}
    keyed = {id(program.key)}
    unsafe: set[int] = set()
    readers: dict[int, bool] = {}  # node id -> read by a non-noise equation
    noise: list[Node] = [program.key]
    for flat in program.walker.flat:
        ok = flat.eqn.primitive.name not in _NOT_EVALUABLE and all(
            id(n) in known or _constant(n) for n in flat.ins
        )
        if ok:
            known |= {id(n) for n in flat.outs}
            if any(id(n) in keyed for n in flat.ins):
                keyed |= {id(n) for n in flat.outs}
                noise += flat.outs
        if any(id(n) in unsafe or _unsafe_key(n) for n in (*flat.ins, *flat.outs)):
            unsafe |= {id(n) for n in flat.outs}
        for n in flat.ins:
            if id(n) in keyed:
                readers[id(n)] = readers.get(id(n), False) or not ok
    for n in program.outputs:
        if id(n) in keyed:
            readers[id(n)] = True
    return [n for n in noise if readers.get(id(n)) and id(n) not in unsafe]


def _unsafe_key(node: Node) -> bool:
    dtype = str(getattr(node.aval, "dtype", ""))
    return dtype.startswith("key<") and dtype != THREEFRY_DTYPE


def _evaluate_pairs(long: Program, short: Program, pairs, keys: Any) -> list[tuple[Any, Any]]:
    """Each pair's two noise values for :data:`KEYS` keys, in ONE compiled program.

    A thresholded mask (``bernoulli(key, 0.9, ...)``) of a few elements can
    agree by chance for one key; it does not for 16.
    """

    def one(key):
        a = evaluate(long, [x for x, _ in pairs], key)
        b = evaluate(short, [y for _, y in pairs], key)
        return [(a.get(id(x)), b.get(id(y))) for x, y in pairs]

    def run():
        return jax.vmap(one)(keys())

    # Compiled ahead of time and called without arguments, so it runs (and returns concrete
    # values) even when the audit itself runs inside the trace of a step.
    options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    return jax.jit(run).lower().compile(compiler_options=options)()


def evaluate(program: Program, targets: Sequence[Node], key: Any) -> dict[int, Any]:
    """Values of ``targets`` (noise nodes), evaluating only the equations they need."""
    needed = _ancestors(targets)
    values: dict[int, Any] = {id(program.key): key}
    for flat in program.walker.flat:
        if not any(id(n) in needed for n in flat.outs):
            continue
        try:
            args = [values.get(id(n), n.value) for n in flat.ins]
            outs = _apply(flat, args)
        except Exception:  # an equation that cannot run alone: leave its outputs unknown
            continue
        for node, value in zip(flat.outs, outs, strict=True):
            values[id(node)] = value
    return values


def _draw_site(node: Node) -> Site:
    """The site of the draw nearest upstream of a noise value (its own site without one)."""
    queue, seen = [node], set()
    while queue:
        current = queue.pop(0)
        flat = current.producer
        if flat is None or id(current) in seen:
            continue
        seen.add(id(current))
        if flat.eqn.primitive.name in DRAWS or "threefry" in str(flat.eqn.params.get("name", "")):
            return flat.site
        queue.extend(flat.ins)
    return node.producer.site


def _ancestors(targets: Sequence[Node]) -> set[int]:
    seen: set[int] = set()
    stack = list(targets)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.producer is not None:
            stack.extend(node.producer.ins)
    return seen


def _apply(flat: FlatEqn, args: list[Any]) -> list[Any]:
    """One equation on concrete values, as ``jax.core.eval_jaxpr`` runs it."""
    prim = flat.eqn.primitive
    params = prim.get_bind_params(flat.eqn.params)
    subfuns: tuple = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    with flat.eqn.ctx.manager:
        out = prim.bind(*subfuns, *args, **params)
    return list(out) if prim.multiple_results else [out]


def _constant(node: Node) -> bool:
    return node.value is not None and not isinstance(node.value, jax_core.Tracer)


def _dummy_keys(aval: Any) -> Any:
    """A function making :data:`KEYS` fixed keys of ``aval``'s type (inside the evaluation)."""
    dtype = str(getattr(aval, "dtype", ""))
    if dtype == THREEFRY_DTYPE and aval.shape == ():
        return lambda: jax.random.split(jax.random.key(0), KEYS)
    if dtype == "uint32" and tuple(aval.shape) == (2,):
        return lambda: jax.random.key_data(jax.random.split(jax.random.key(0), KEYS))
    return None


def _prefix_of(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(short) == len(long) and all(s <= t for s, t in zip(short, long, strict=True))


def _equal_prefix(long: Any, short: Any) -> bool:
    """Equal bits on the short value's extent (axis 0 runs over the keys)."""
    a, b = _bits(long), _bits(short)
    return bool(np.array_equal(a[tuple(slice(0, n) for n in b.shape)], b))


def _bits(value: Any) -> np.ndarray:
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    array = np.asarray(value)
    if array.dtype.kind == "f" or array.dtype.kind == "c":
        array = (
            array.view(f"u{array.dtype.itemsize}")
            if array.dtype.itemsize in (1, 2, 4, 8)
            else array
        )
    return array


def _structural(long: Sequence[Draw], short: Sequence[Draw]) -> list[Finding]:
    """``random_bits`` draws in loops, branches or device maps: compare their strides."""
    a = [d for d in long if not d.ctx.top and d.eqn.primitive.name == "random_bits"]
    b = [d for d in short if not d.ctx.top and d.eqn.primitive.name == "random_bits"]
    if len(a) != len(b):
        return []
    out = []
    for x, y in zip(a, b, strict=True):
        if len(x.shape) == len(y.shape) and not _stable_strides(x.shape, y.shape):
            out.append(_unstable(x.site, x.shape, y.shape))
    return out


def _stable_strides(long: Sequence[int], short: Sequence[int]) -> bool:
    """Element ``idx`` of ``short`` has the flat index it has in ``long``."""
    for k, size in enumerate(short):
        if size > 1 and math.prod(long[k + 1 :]) != math.prod(short[k + 1 :]):
            return False
    return True


def _unstable(site: Site, long: Sequence[int], short: Sequence[int]) -> Finding:
    return finding(
        "padding_unstable",
        f"this draw's bits depend on the padded length: traced at two lengths, its noise of "
        f"shape {tuple(short)} is not the prefix of the one of shape {tuple(long)}, so an "
        "example padded to another length (another bucket, microbatch or packing) gets "
        "other noise on the same tokens. A mask drawn as one array over a non-leading "
        "length axis, such as Flax attention dropout's (heads, L, L), does this.",
        site,
    )
