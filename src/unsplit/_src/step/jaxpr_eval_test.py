"""A jaxpr run again: the same values as the function, each equation through the rewrite."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from unsplit._src.step import jaxpr_eval


def run(fn, rewrite, *args, eqn_context=False):
    closed = jax.make_jaxpr(fn)(*args)
    return jaxpr_eval.evaluate(
        closed.jaxpr, closed.consts, jax.tree.leaves(args), rewrite, eqn_context=eqn_context
    )


def as_it_is(eqn, invals):
    return jaxpr_eval.bind(eqn, invals)


def test_binding_every_equation_gives_the_functions_values():
    table = np.arange(3.0, dtype=np.float32)  # a constant of the jaxpr

    def fn(x, y):
        s, i = jax.lax.sort((x * 2.0 + table, y), num_keys=1)  # several results
        return jnp.sum(s) + 1.0, i  # a literal

    x, y = jnp.array([3.0, 1.0, 2.0]), jnp.arange(3)
    got = run(fn, as_it_is, x, y)
    want = fn(x, y)
    assert float(got[0]) == float(want[0])
    np.testing.assert_array_equal(got[1], want[1])


def swap_sin_for_cos(eqn, invals):
    """The tests' rewrite: ``sin`` computed as ``cos``, in nested jaxprs too."""
    if eqn.primitive.name == "sin":
        return jnp.cos(*invals)

    def retrace(jaxpr, consts):
        return jaxpr_eval.retrace(jaxpr, consts, again)

    params = {k: jaxpr_eval.nested(v, retrace) for k, v in eqn.params.items()}
    return jaxpr_eval.bind(eqn, invals, params)


def again(jaxpr, consts, *args):
    return jaxpr_eval.evaluate(jaxpr, consts, args, swap_sin_for_cos)


def test_the_rewrite_reaches_the_equations_of_nested_jaxprs():
    def fn(x):
        def body(c, _):
            return c + jnp.sin(c), None  # a scan's body: a ClosedJaxpr parameter

        branches = jax.lax.cond(x > 0, jnp.sin, jnp.cos, x)  # a tuple of ClosedJaxprs
        looped, _ = jax.lax.scan(body, x, None, length=2)
        remat = jax.checkpoint(jnp.sin)(x)  # a constant-free Jaxpr parameter
        return jnp.sin(x), branches, looped, remat

    x = jnp.float32(0.5)
    got = run(fn, swap_sin_for_cos, x)
    c = x + jnp.cos(x)
    want = [jnp.cos(x), jnp.cos(x), c + jnp.cos(c), jnp.cos(x)]
    for g, w in zip(got, want, strict=True):
        assert float(g) == float(w)


def test_other_parameters_are_kept_as_they_are():
    marker = object()
    assert jaxpr_eval.nested(marker, lambda j, c: (j, c)) is marker
    assert jaxpr_eval.nested((1, "a"), lambda j, c: (j, c)) == (1, "a")


def test_eqn_context_runs_each_rewrite_in_the_context_it_was_traced_in():
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Explicit,))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        closed = jax.make_jaxpr(jnp.sin)(1.0)
    seen = []

    def record(eqn, invals):
        seen.append(jax.sharding.get_abstract_mesh())
        return invals[0]  # not computed: an eager op refuses to run on an abstract mesh

    for eqn_context in (True, False):
        jaxpr_eval.evaluate(closed.jaxpr, closed.consts, [1.0], record, eqn_context=eqn_context)
    assert seen[0] == mesh.abstract_mesh
    assert seen[1].empty  # without it, the caller's context: no mesh here
