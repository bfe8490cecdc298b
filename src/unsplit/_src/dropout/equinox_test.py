"""Equinox's semantics of ``eqx.nn.Dropout``, checked on Equinox's class and on unsplit's.

Every test runs twice, on ``equinox.nn.Dropout`` and on ``unsplit.equinox.Dropout``:
whatever Equinox's layer passes, unsplit's must pass. The checks are those of
Equinox's own Dropout tests (``tests/test_nn.py``, ``test_tree.py``'s
``inference_mode``), written anew, plus the behaviour its source defines (a
``p`` that is an array or traced, ``stop_gradient`` on ``p``, dtypes). Where
Equinox's bits would be asserted, the property is checked instead.
"""

import dataclasses
import inspect
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unsplit import equinox as ueqx
from unsplit._src import masks

LAYERS = [pytest.param(eqx.nn.Dropout, id="equinox"), pytest.param(ueqx.Dropout, id="unsplit")]
X = jax.random.normal(jax.random.key(0), (3, 4, 5))
KEY = jax.random.key(1)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_elements_are_dropped_or_divided_by_the_keep_probability(Dropout):
    y = Dropout()(X, key=KEY)  # p = 0.5: the threshold gives exactly 0.5
    assert jnp.all((y == 0) | (y == X / 0.5)) and jnp.any(y == 0) and jnp.any(y != 0)
    other = Dropout()(X, key=jax.random.key(2))
    assert jnp.any((y == 0) != (other == 0))
    np.testing.assert_array_equal(y, Dropout()(X, key=KEY))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_inference_from_the_call_the_field_and_tree_at(Dropout):
    dropout = Dropout()
    assert jnp.all(dropout(X, key=KEY, inference=True) == X)
    assert jnp.all(dropout(X, inference=True) == X)  # no key needed
    frozen = Dropout(inference=True)
    assert jnp.all(frozen(X) == X)
    thawed = eqx.tree_at(lambda d: d.inference, frozen, replace=False)
    assert jnp.any(thawed(X, key=jax.random.PRNGKey(0)) != X)  # legacy keys work too
    assert jnp.any(frozen(X, key=KEY, inference=False) != X)  # the call wins


@pytest.mark.parametrize("Dropout", LAYERS)
def test_deprecated_deterministic_aliases(Dropout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dropout = Dropout()
        assert jnp.all(dropout(X, key=KEY, deterministic=True) == X)
        assert jnp.all(dropout(X, deterministic=True) == X)
        frozen = Dropout(deterministic=True)
        assert frozen.deterministic and jnp.all(frozen(X) == X)
        thawed = eqx.tree_at(lambda d: d.deterministic, frozen, replace=False)
        assert jnp.any(thawed(X, key=KEY) != X)
    with pytest.warns(UserWarning, match="deprecated"):
        dropout(X, deterministic=True)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_inference_mode_switches_every_dropout(Dropout):
    model = eqx.nn.Sequential([eqx.nn.Linear(5, 5, key=KEY), Dropout(0.3)])
    frozen = eqx.nn.inference_mode(model)
    assert model.layers[1].inference is False and frozen.layers[1].inference is True
    y = frozen(X[0, 0])
    np.testing.assert_array_equal(y, eqx.nn.inference_mode(frozen, value=True)(X[0, 0]))
    assert eqx.nn.inference_mode(frozen, value=False).layers[1].inference is False


@pytest.mark.parametrize("Dropout", LAYERS)
def test_a_key_is_required_when_not_in_inference(Dropout):
    with pytest.raises(RuntimeError, match="Dropout requires a key when running in non-determ"):
        Dropout()(X)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_python_zero_never_draws_an_array_zero_keeps_everything(Dropout):
    assert Dropout(p=0.0)(X) is X  # no key needed
    y = Dropout(p=jnp.float32(0.0))(X, key=KEY)
    np.testing.assert_array_equal(y, X)
    with pytest.raises(RuntimeError):
        Dropout(p=jnp.float32(0.0))(X)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_traced_p_under_filter_jit_and_jax_jit(Dropout):
    dropout = Dropout(p=jnp.float32(0.5))
    y = eqx.filter_jit(lambda d, x, k: d(x, key=k))(dropout, X, KEY)
    assert jnp.all((y == 0) | (y == X / 0.5)) and jnp.any(y == 0)
    # jax.jit traces every leaf; a static inference flag keeps it usable.
    y = jax.jit(lambda p, x, k: Dropout(p=p, inference=False)(x, key=k))(0.5, X, KEY)
    assert y.dtype == X.dtype and jnp.all((y == 0) | (y == X / 0.5))
    rates = jnp.array([0.1, 0.9])
    kept = jax.vmap(lambda p: jnp.mean(Dropout(p=p)(jnp.ones(4096), key=KEY) != 0))(rates)
    np.testing.assert_allclose(kept, [0.9, 0.1], atol=0.03)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_output_dtype_is_that_of_x_over_keep(Dropout):
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        assert Dropout(0.3)(X.astype(dtype), key=KEY).dtype == dtype  # weak Python p
        traced = jax.jit(lambda p, x: Dropout(p)(x, key=KEY))(0.3, X.astype(dtype))
        assert traced.dtype == dtype  # a traced Python float stays weak
    assert Dropout(jnp.float32(0.3))(X, key=KEY).dtype == jnp.float32


@pytest.mark.parametrize("Dropout", LAYERS)
def test_no_gradient_flows_into_p(Dropout):
    def loss(p):
        return jnp.sum(Dropout(p)(X, key=KEY))

    assert float(jax.grad(loss)(jnp.float32(0.3))) == 0.0
    grad_x = jax.grad(lambda x: jnp.sum(Dropout(0.5)(x, key=KEY)))(X)
    y = Dropout(0.5)(X, key=KEY)
    np.testing.assert_array_equal(grad_x, jnp.where(y != 0, 2.0, 0.0))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_vmap_over_keys_gives_each_example_its_mask(Dropout):
    keys = jax.random.split(KEY, 3)
    ys = jax.vmap(lambda k, x: Dropout()(x, key=k))(keys, X)
    for i in range(3):
        np.testing.assert_array_equal(ys[i], Dropout()(X[i], key=keys[i]))
    assert jnp.any((ys[0] == 0) != (ys[1] == 0))


def test_same_fields_signatures_and_equinox_type():
    assert issubclass(ueqx.Dropout, eqx.nn.Dropout) and ueqx.Dropout.__name__ == "Dropout"
    assert [f.name for f in dataclasses.fields(ueqx.Dropout())] == ["p", "inference"]
    for method in ("__init__", "__call__"):
        ours, theirs = getattr(ueqx.Dropout, method), getattr(eqx.nn.Dropout, method)
        assert parameters(ours) == parameters(theirs), method


def parameters(fn):
    """Names, kinds and defaults of a signature (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


# --- unsplit's own: the bits, and where Equinox's result is not usable ---


def test_bits_are_unsplit_prefix_stable_mask():
    y = ueqx.Dropout(0.3)(jnp.ones((4, 8)), key=KEY)
    np.testing.assert_array_equal(y != 0, masks.keep_mask(KEY, (4, 8), 0.3))
    long = ueqx.Dropout(0.3)(jnp.ones((9, 8)), key=KEY)
    np.testing.assert_array_equal(long[:4], y)


def test_p_one_gives_zeros_and_zero_gradients():
    for p in (1.0, jnp.float32(1.0)):
        y, grad = jax.value_and_grad(lambda x, p=p: jnp.sum(ueqx.Dropout(p)(x, key=KEY)))(X)
        assert float(y) == 0.0 and np.all(np.asarray(grad) == 0.0)


def test_a_concrete_p_outside_zero_one_is_an_error_with_the_fix():
    with pytest.raises(ValueError, match=r"got rate=1.5\. Fix"):
        ueqx.Dropout(1.5)(X, key=KEY)
    with pytest.raises(RuntimeError, match=r"Fix: call it with key="):
        ueqx.Dropout()(X)
