"""Every bad input gets a clear error: what was expected, what arrived, the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit

KEY = jax.random.key(0)
W = jnp.ones((3,), jnp.float32)
X = jnp.ones((8, 3), jnp.float32)


def loss(w, x, key):
    return jnp.sum(x * w * jax.random.uniform(key, x.shape))


def weighted_loss(w, x, key):
    return jnp.sum(x * w * jax.random.uniform(key, x.shape)), jnp.sum(x)


def test_batch_not_divisible_by_devices_times_microbatches():
    mesh = jax.make_mesh((2,), ("data",))
    step = unsplit.value_and_grad(loss, microbatches=3, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"batch size 8 is not divisible by devices x microbatches = 2 x 3 = 6\. Fix",
    ):
        step(W, X, KEY)


def test_mesh_first_axis_does_not_divide_batch():
    mesh = jax.make_mesh((8,), ("data",))
    step = unsplit.value_and_grad(loss, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"batch axes 'data' of the mesh have 8 devices, which does not divide the batch size 12",
    ):
        step(W, jnp.ones((12, 3)), KEY)


def test_leaves_with_different_leading_sizes():
    step = unsplit.value_and_grad(lambda w, ex, k: loss(w, ex["a"], k))
    with pytest.raises(ValueError, match=r"different leading sizes \(\['a'\]: 8, \['b'\]: 4\)"):
        step(W, {"a": X, "b": jnp.ones((4, 3))}, KEY)


@pytest.mark.parametrize("bitwise", [False, True])
@pytest.mark.parametrize("leaf", [np.array(["a"] * 8), np.array([object()] * 8, dtype=object)])
def test_a_batch_leaf_of_strings_or_objects_is_refused_with_the_fix(bitwise, leaf):
    step = unsplit.value_and_grad(lambda w, ex, k: loss(w, ex["x"], k), bitwise=bitwise)
    with pytest.raises(TypeError, match=r"batch leaf \['name'\] has dtype .*Fix: turn it into"):
        step(W, {"x": X, "name": leaf}, KEY)


def test_scalar_leaf_and_empty_batch():
    step = unsplit.value_and_grad(loss)
    with pytest.raises(ValueError, match=r"is a scalar; every leaf needs the global batch"):
        step(W, {"x": X, "t": jnp.float32(1.0)}, KEY)
    with pytest.raises(ValueError, match=r"batch has no array leaves"):
        step(W, {}, KEY)


@pytest.mark.parametrize("ids", [np.arange(4), np.arange(16).reshape(8, 2)], ids=["short", "2d"])
def test_ids_of_the_wrong_shape(ids):
    with pytest.raises(ValueError, match=r"ids must have shape \(B,\) = \(8,\).*got shape"):
        unsplit.value_and_grad(loss)(W, X, KEY, ids=ids)


def test_float_ids():
    with pytest.raises(TypeError, match=r"ids must be an integer array.*got dtype=float32"):
        unsplit.value_and_grad(loss)(W, X, KEY, ids=jnp.arange(8, dtype=jnp.float32))


def test_negative_host_ids():
    with pytest.raises(ValueError, match=r"non-negative.*got min\(ids\)=-1"):
        unsplit.value_and_grad(loss)(W, X, KEY, ids=np.arange(8) - 1)


def test_device_ids_are_not_read_back_and_wrap_like_fold_in():
    # Checking a JAX array's values would wait for the device; they wrap modulo 2**32.
    wrapped = unsplit.value_and_grad(loss)(W, X, KEY, ids=jnp.arange(8, dtype=jnp.int32) - 1)
    same = unsplit.value_and_grad(loss)(W, X, KEY, ids=(np.arange(8) - 1) % 2**32)
    assert float(wrapped[0]) == float(same[0])


@pytest.mark.parametrize("key", [0, jnp.zeros((2,), jnp.float32), jax.random.split(KEY, 2)])
def test_key_that_is_not_a_prng_key(key):
    with pytest.raises(
        (TypeError, ValueError), match=r"key must be a (PRNG key made by|single key)"
    ):
        unsplit.value_and_grad(loss)(W, X, key)


def test_rbg_key_refused_by_the_step():
    with pytest.raises(TypeError, match=r"'rbg' PRNG implementation"):
        unsplit.value_and_grad(loss)(W, X, jax.random.key(0, impl="rbg"))


def test_loss_fn_returning_a_non_scalar():
    step = unsplit.value_and_grad(lambda w, x, k: x * w)
    with pytest.raises(
        ValueError, match=r"must be a scalar for ONE example; got shape \(3,\).*Fix"
    ):
        step(W, X, KEY)


def test_weighted_loss_fn_not_returning_a_pair():
    step = unsplit.value_and_grad(loss, weighted=True)
    with pytest.raises(
        TypeError, match=r"weighted=True, loss_fn must return a pair.*got an array of shape \(\)"
    ):
        step(W, X, KEY)
    triple = unsplit.value_and_grad(lambda w, x, k: (1.0, 2.0, 3.0), weighted=True)
    with pytest.raises(TypeError, match=r"got a tuple of length 3"):
        triple(W, X, KEY)


def test_unweighted_loss_fn_returning_a_pair_suggests_weighted():
    step = unsplit.value_and_grad(weighted_loss)
    with pytest.raises(TypeError, match=r"Fix: pass weighted=True"):
        step(W, X, KEY)


def test_weighted_pair_with_non_scalar_weight():
    step = unsplit.value_and_grad(lambda w, x, k: (jnp.sum(x * w), x), weighted=True)
    with pytest.raises(ValueError, match=r"weight \(the second element.*got shape \(3,\)"):
        step(W, X, KEY)


def test_integer_loss():
    step = unsplit.value_and_grad(lambda w, x, k: jnp.sum(x.astype(jnp.int32)))
    with pytest.raises(TypeError, match=r"floating-point scalar.*got dtype=int32"):
        step(W, X, KEY)


def zero_weight_loss(w, x, k):
    return jnp.sum(x * w), 0.0 * jnp.sum(x)


def test_zero_total_weight_gives_nan_on_device():
    loss, grads = unsplit.value_and_grad(zero_weight_loss, weighted=True)(W, X, KEY)
    assert np.isnan(loss) and np.all(np.isnan(grads))


def test_zero_total_weight_checked_raises_with_the_cause():
    step = unsplit.value_and_grad(zero_weight_loss, weighted=True, checked=True)
    with pytest.raises(FloatingPointError, match=r"total weight of the global batch is 0"):
        step(W, X, KEY)


@pytest.mark.parametrize("bad", [0, -2])
def test_microbatches_below_one(bad):
    with pytest.raises(ValueError, match=rf"microbatches must be >= 1.*got microbatches={bad}"):
        unsplit.value_and_grad(loss, microbatches=bad)


@pytest.mark.parametrize("bad", [2.0, True, "4"])
def test_microbatches_not_an_int(bad):
    with pytest.raises(TypeError, match=r"microbatches must be an int >= 1"):
        unsplit.value_and_grad(loss, microbatches=bad)


def test_mesh_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh or None; got list"):
        unsplit.value_and_grad(loss, mesh=jax.devices())


def test_loss_fn_not_callable():
    with pytest.raises(TypeError, match=r"loss_fn must be a function"):
        unsplit.value_and_grad("loss")


def test_chunk_size_without_bitwise():
    with pytest.raises(ValueError, match=r"chunk_size=4 only applies with bitwise=True"):
        unsplit.value_and_grad(loss, chunk_size=4)
