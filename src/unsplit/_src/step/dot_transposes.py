"""A dot whose only use is a transpose of its output, run as the dot of swapped operands.

JAX's transpose rule for ``dot_general`` writes a weight's gradient as a dot whose
output dims come out the other way round, then a ``transpose`` (``x @ w``'s
gradient for ``w`` is ``dot(g, x)`` transposed). XLA folds that transpose into the
dot's output layout; bitwise mode cannot let it (each dot is fenced, so that XLA
neither merges nor reorders it: :mod:`~unsplit._src.bitwise.canonical_dots`,
:mod:`~unsplit._src.bitwise.blocked.rules`), and the transpose was then copied
element by element, fused into the flat gradient vector's pack: 118 ms for a
1024 x 4096 weight on 8 simulated devices (the degrees benchmark's MLP), more
than its dots. The dot of the swapped operands computes the transposed
output directly (each element the same products, ``b * a`` for ``a * b``).

:func:`folded` wraps an equation rewrite for one jaxpr: such a dot and its
transpose become one dot of the swapped operands, given to the rewrite as a
``dot_general`` equation (the transpose's output variable).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from unsplit._src.step import dot_transposes
    >>> from unsplit._src.step import jaxpr_eval
    >>> def weight_grad(g, x):  # contracts the batch dim: (3, 5), then transposed
    ...     return jax.lax.dot_general(g, x, (((0,), (0,)), ((), ()))).T
    >>> closed = jax.make_jaxpr(weight_grad)(jnp.ones((8, 3)), jnp.ones((8, 5)))
    >>> seen = []
    >>> def rewrite(eqn, invals):
    ...     seen.append(eqn.primitive.name)
    ...     return jaxpr_eval.bind(eqn, invals)
    >>> run = dot_transposes.folded(closed.jaxpr, rewrite)
    >>> args = [jnp.ones((8, 3)), jnp.ones((8, 5))]
    >>> out = jaxpr_eval.evaluate(closed.jaxpr, closed.consts, args, run)
    >>> out[0].shape, seen  # one dot, of the swapped operands
    ((5, 3), ['dot_general'])
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

from jax.extend import core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src.step.jaxpr_eval import Rewrite


def _swapping_permutation(eqn: core.JaxprEqn) -> tuple[int, ...]:
    """The permutation of a dot's output that puts its right free dims before its left."""
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    lhs, rhs = (len(cast(Any, v.aval).shape) for v in eqn.invars)
    nb, nlf = len(lb), lhs - len(lc) - len(lb)
    nrf = rhs - len(lc) - len(lb)
    return (*range(nb), *range(nb + nlf, nb + nlf + nrf), *range(nb, nb + nlf))


def _swapped(dot: core.JaxprEqn, transpose: core.JaxprEqn) -> core.JaxprEqn:
    """The dot of ``dot``'s operands swapped, whose output is ``transpose``'s."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    params = {**dot.params, "dimension_numbers": ((rc, lc), (rb, lb))}
    precision = params.get("precision")
    if isinstance(precision, tuple):
        params["precision"] = precision[::-1]
    sharding = params.get("out_sharding")
    if isinstance(sharding, NamedSharding):
        perm = transpose.params["permutation"]
        spec = (*sharding.spec, *([None] * (len(perm) - len(sharding.spec))))
        params["out_sharding"] = NamedSharding(sharding.mesh, P(*(spec[p] for p in perm)))
    return dot.replace(invars=dot.invars[::-1], params=params, outvars=transpose.outvars)


def _pairs(jaxpr: core.Jaxpr) -> dict[int, core.JaxprEqn]:
    """Each foldable dot's and transpose's equation (by ``id``) -> its partner."""
    uses: Counter = Counter(
        v for e in jaxpr.eqns for v in e.invars if not isinstance(v, core.Literal)
    )
    uses.update(v for v in jaxpr.outvars if not isinstance(v, core.Literal))
    made = {e.outvars[0]: e for e in jaxpr.eqns if e.primitive.name == "dot_general"}
    pairs: dict[int, core.JaxprEqn] = {}
    for e in jaxpr.eqns:
        if e.primitive.name != "transpose" or isinstance(e.invars[0], core.Literal):
            continue
        dot = made.get(e.invars[0])
        if dot is None or uses[e.invars[0]] != 1:
            continue
        if tuple(e.params["permutation"]) == _swapping_permutation(dot):
            pairs[id(dot)], pairs[id(e)] = e, dot
    return pairs


_SWAPPED: dict[int, core.JaxprEqn] = {}  # id -> each swapped dot equation (held: ids stay unique)


def is_swapped(eqn: core.JaxprEqn) -> bool:
    """Whether ``eqn`` is a dot :func:`folded` made by swapping another's operands (a rewrite
    that chooses by operand order, e.g. which operand's split a contracted pair keeps,
    chooses as for the original dot)."""
    return _SWAPPED.get(id(eqn)) is eqn


def folded(jaxpr: core.Jaxpr, rewrite: Rewrite) -> Rewrite:
    """``rewrite`` for ``jaxpr``'s equations, each foldable dot-then-transpose pair given
    to it as one ``dot_general`` of the swapped operands (see the module docstring)."""
    pairs = _pairs(jaxpr)
    if not pairs:
        return rewrite
    done: dict[int, Any] = {}

    def run(eqn: core.JaxprEqn, invals: list[Any]) -> Any:
        partner = pairs.get(id(eqn))
        if partner is None:
            return rewrite(eqn, invals)
        if eqn.primitive.name == "transpose":
            return done.pop(id(eqn))
        swapped = _swapped(eqn, partner)
        _SWAPPED[id(swapped)] = swapped
        try:
            out = rewrite(swapped, invals[::-1])
        finally:
            del _SWAPPED[id(swapped)]
        done[id(partner)] = out
        return out  # read only by the transpose, which takes ``out`` as it is

    return run
