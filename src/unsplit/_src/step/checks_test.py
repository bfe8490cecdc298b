"""Never silently wrong: each mistake a user can make with a step gets a clear error (or the
correct result), in every mode. The multi-process and CLI cases are in reliability_test.py."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import value_and_grad as step_lib

KEY = jax.random.key(0)
W = np.ones((3,), np.float32)
X = np.ones((8, 3), np.float32)


def loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return jnp.sum(jnp.where(keep, x, 0.0) * w)


def weighted(w, ex, key):
    return loss(w, ex["x"], key), ex["weight"]


@pytest.mark.parametrize("bitwise", [False, True])
def test_an_empty_batch_is_refused_with_the_same_message_in_every_mode(bitwise):
    step = unsplit.value_and_grad(loss, bitwise=bitwise)
    with pytest.raises(ValueError, match=r"the global batch has 0 examples"):
        step(W, np.ones((0, 3), np.float32), KEY)


@pytest.mark.parametrize(
    "out,message",
    [
        (lambda x: None, r"got None \(did loss_fn forget to return\?\)"),
        (lambda x: {"loss": jnp.sum(x)}, r"got a dict with keys \['loss'\]"),
        (lambda x: "loss", r"must be a scalar array; got str"),
    ],
)
def test_a_loss_that_returns_no_scalar(out, message):
    with pytest.raises(TypeError, match=message):
        unsplit.value_and_grad(lambda w, x, k: out(x))(W, X, KEY)


def test_a_bool_weight_says_to_cast_it():
    step = unsplit.value_and_grad(lambda w, x, k: (loss(w, x, k), x[0] > 0), weighted=True)
    with pytest.raises(TypeError, match=r"must be a number \(e.g. a token count\); got dtype=bool"):
        step(W, X, KEY)


def test_nested_python_lists_as_a_batch_say_to_convert():
    with pytest.raises(TypeError, match=r"Python number inside nested Python lists.*Fix: convert"):
        unsplit.value_and_grad(loss)(W, [[1.0, 2.0, 3.0]] * 8, KEY)


def test_a_captured_step_key_is_refused_at_the_first_call():
    captured = jax.random.key(42)

    def careless(w, x, key):  # draws from the captured key instead of its own
        return jnp.sum(x * w * jax.random.uniform(captured, x.shape))

    with pytest.raises(unsplit.AuditError, match=r"foreign_key"):
        unsplit.value_and_grad(careless)(W, X, KEY)


def test_audit_true_raises_on_any_finding():
    from flax import linen as nn

    class Attention(nn.Module):  # Flax's attention dropout: padding-unstable draws
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(num_heads=1, dropout_rate=0.5)(
                x, x, deterministic=False
            )

    model = Attention()
    params = model.init(jax.random.key(0), jnp.ones((4, 2)))

    def attention_loss(p, x, key):
        return jnp.sum(model.apply(p, x, rngs={"dropout": key}))

    batch = np.ones((8, 4, 2), np.float32)
    assert np.isfinite(float(unsplit.value_and_grad(attention_loss)(params, batch, KEY)[0]))
    with pytest.raises(unsplit.AuditError, match=r"padding_unstable"):
        unsplit.value_and_grad(attention_loss, audit=True)(params, batch, KEY)


@pytest.mark.parametrize("bitwise", [False, True])
@pytest.mark.parametrize(
    "total,message",
    [(0.0, r"total weight of the global batch is 0.0"), (-1.0, r"is -1.0"), (np.inf, r"is inf")],
)
def test_checked_mode_raises_with_the_cause(bitwise, total, message):
    batch = {"x": X, "weight": np.full((8,), total / 8, np.float32)}
    step = unsplit.value_and_grad(weighted, weighted=True, bitwise=bitwise, checked=True)
    with pytest.raises(FloatingPointError, match=message):
        step(W, batch, KEY)
    unchecked = unsplit.value_and_grad(weighted, weighted=True, bitwise=bitwise)
    assert np.isnan(float(unchecked(W, batch, KEY)[0]))  # the documented default: nan


def test_checked_mode_names_a_nan_loss_and_works_inside_jit():
    def nan_loss(w, x, key):
        return jnp.log(jnp.sum(x * w) - 3.0)  # log(0) = -inf

    step = unsplit.value_and_grad(nan_loss, checked=True)
    with pytest.raises(FloatingPointError, match=r"loss_fn itself returned inf or nan"):
        step(W, X, KEY)
    with pytest.raises(Exception, match=r"loss_fn itself returned inf or nan"):
        jax.block_until_ready(jax.jit(step)(W, X, KEY))


def test_a_batch_on_a_mesh_with_mesh_none_is_refused():
    mesh = jax.make_mesh((4,), ("data",))
    batch = jax.device_put(X, NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"sharded over 4 devices .* mesh=None, which runs on one"):
        unsplit.value_and_grad(loss)(W, batch, KEY)


def test_a_batch_on_a_bigger_mesh_than_the_steps_is_moved():
    big = jax.make_mesh((8,), ("data",))
    small = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    batch = jax.device_put(X, NamedSharding(big, P("data")))
    reference = unsplit.value_and_grad(loss)(W, X, KEY)
    with pytest.warns(UserWarning, match=r"batch is not placed on the step's mesh"):
        out = unsplit.value_and_grad(loss, mesh=small)(W, batch, KEY)
    np.testing.assert_allclose(out[0], reference[0], rtol=1e-6)


def test_out_of_memory_gets_the_microbatches_hint(monkeypatch):
    step = unsplit.value_and_grad(loss, microbatches=2)

    def exhausted(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")

    monkeypatch.setattr(step, "_impl", exhausted)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ran out of device memory.*microbatches"):
        step(W, X, KEY)


@pytest.mark.parametrize("bitwise", [False, True])
def test_dropping_a_step_frees_its_loss_function(bitwise):
    def make():
        def fresh(w, x, key):
            return loss(w, x, key)

        return fresh

    fn = make()
    dead = weakref.ref(fn)
    step = unsplit.value_and_grad(fn, bitwise=bitwise)
    step(W, X, KEY)
    del step, fn
    gc.collect()
    assert dead() is None


def test_settings_are_validated_at_construction():
    with pytest.raises(TypeError, match=r"checked must be True or False"):
        unsplit.value_and_grad(loss, checked=1)
    with pytest.raises(ValueError, match=r"batch_axes must be distinct axes of the mesh"):
        unsplit.value_and_grad(loss, mesh=jax.make_mesh((2,), ("data",)), batch_axes="model")
    with pytest.raises(ValueError, match=r"names mesh axes, but mesh=None"):
        step_lib.value_and_grad(loss, batch_axes="data")
