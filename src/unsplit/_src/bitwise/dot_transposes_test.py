import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unsplit._src.bitwise import canonical_dots, dot_transposes
from unsplit._src.step import jaxpr_eval


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


def test_canonical_chunk_programs_compute_weight_gradients_without_a_transpose():
    # The bitwise chunk program fences every dot, so XLA cannot fold the transpose JAX
    # writes after a weight gradient's dot: it was copied element by element (118 ms
    # for a 1024 x 4096 weight on 8 simulated devices). Folded, only the activations'
    # small (8-row) operands are laid out by a transpose; the weight-sized output is not.
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(64, 128)) / 8, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
    fn = jax.jit(canonical_dots.canonicalize(jax.grad(_loss)))
    text = fn.lower(w, x).compile(canonical_dots.CPU_OPTIONS).as_text()
    moved = re.findall(r"f32\[(\d+),(\d+)\]\{[\d,]+\} transpose\(", text)
    assert moved, "expected the activations' operand transposes"
    assert all(8 in (int(m), int(n)) for m, n in moved), moved
    np.testing.assert_allclose(fn(w, x), jax.grad(_loss)(w, x), rtol=1e-5, atol=1e-5)
