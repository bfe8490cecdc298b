import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unsplit._src.step import dot_transposes, jaxpr_eval


def _names(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _folded(fn):
    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        rewrite = dot_transposes.folded(closed.jaxpr, jaxpr_eval.bind)
        return jaxpr_eval.evaluate(closed.jaxpr, closed.consts, args, rewrite)

    return run


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def test_a_weight_gradient_is_one_dot_of_the_swapped_operands():
    w, x = jnp.ones((16, 32)) / 7, jnp.arange(8 * 16.0).reshape(8, 16) / 50
    grad = jax.grad(_loss)
    assert "transpose" in _names(grad, w, x)  # JAX writes dot(g, x) then transpose
    assert "transpose" not in _names(_folded(grad), w, x)
    np.testing.assert_allclose(_folded(grad)(w, x)[0], grad(w, x), rtol=1e-6)


@pytest.mark.parametrize("batched", [False, True])
def test_every_permutation_other_than_the_swap_is_left_alone(batched):
    a = jnp.ones((2, 8, 3)) if batched else jnp.ones((8, 3))
    b = jnp.ones((2, 8, 5)) if batched else jnp.ones((8, 5))
    numbers = (((1,), (1,)), ((0,), (0,))) if batched else (((0,), (0,)), ((), ()))

    def swapped(a, b):  # (batch, 3, 5) -> (batch, 5, 3): folded
        out = jax.lax.dot_general(a, b, numbers)
        return jnp.swapaxes(out, -1, -2)

    def moved_batch(a, b):  # the batch dim moved: not the swap, kept as it is
        return jnp.moveaxis(jax.lax.dot_general(a, b, numbers), 0, -1)

    assert "transpose" not in _names(_folded(swapped), a, b)
    np.testing.assert_array_equal(_folded(swapped)(a, b)[0], swapped(a, b))
    if batched:
        assert "transpose" in _names(_folded(moved_batch), a, b)


def test_a_dot_used_twice_is_not_folded():
    def twice(g, x):
        out = jax.lax.dot_general(g, x, (((0,), (0,)), ((), ())))
        return out.T, out

    g, x = jnp.ones((8, 3)), jnp.ones((8, 5))
    assert _names(_folded(twice), g, x).count("transpose") == 1
    got = _folded(twice)(g, x)
    np.testing.assert_array_equal(got[0], twice(g, x)[0])
    np.testing.assert_array_equal(got[1], twice(g, x)[1])


def test_a_per_operand_precision_is_swapped_with_the_operands():
    def fn(g, x):
        prec = (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT)
        return jax.lax.dot_general(g, x, (((0,), (0,)), ((), ())), precision=prec).T

    g, x = jnp.ones((8, 3)), jnp.ones((8, 5))
    closed = jax.make_jaxpr(_folded(fn))(g, x)
    (dot,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dot.params["precision"] == (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST)
