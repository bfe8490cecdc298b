"""Schedule invariance of value_and_grad, with negative controls for the naive schemes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.models import transformer as tf

TOL = 1e-5  # relative L2, float32
KEY = jax.random.fold_in(jax.random.key(0), 7)  # a step key


def loss_fn(model, weighted):
    return tf.token_loss(model) if weighted else tf.mean_loss(model)


def mesh_of(devices, axis_type=AxisType.Explicit):
    return jax.make_mesh((devices,), ("data",), axis_types=(axis_type,))


@functools.cache
def reference(weighted):
    model, params, batch = testing.problem()
    return unsplit.value_and_grad(loss_fn(model, weighted), weighted=weighted)(params, batch, KEY)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_invariant_over_devices_and_microbatches(devices, microbatches, weighted):
    model, params, batch = testing.problem()
    step = unsplit.value_and_grad(
        loss_fn(model, weighted),
        weighted=weighted,
        microbatches=microbatches,
        mesh=mesh_of(devices),
    )
    loss, grads = step(params, batch, KEY)
    ref_loss, ref_grads = reference(weighted)
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    assert testing.rel_l2(grads, ref_grads) <= TOL
    assert jax.tree.structure(grads) == jax.tree.structure(params)


@pytest.mark.parametrize("devices,microbatches", [(4, 2), (8, 1)])
def test_auto_axes_mesh(devices, microbatches):
    model, params, batch = testing.problem()
    mesh = mesh_of(devices, AxisType.Auto)
    step = unsplit.value_and_grad(
        tf.token_loss(model), weighted=True, microbatches=microbatches, mesh=mesh
    )
    loss, grads = step(params, batch, KEY)
    ref_loss, ref_grads = reference(True)
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    assert testing.rel_l2(grads, ref_grads) <= TOL


def test_prefers_presharded_global_arrays():
    model, params, batch = testing.problem()
    mesh = mesh_of(4)
    sharded = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.P("data")))
    step = unsplit.value_and_grad(tf.token_loss(model), weighted=True, microbatches=2, mesh=mesh)
    _, grads = step(params, sharded, KEY)
    assert testing.rel_l2(grads, reference(True)[1]) <= TOL


@pytest.mark.parametrize("devices,microbatches", [(1, 1), (2, 4), (8, 2)])
def test_shuffling_examples_with_their_ids_changes_nothing(devices, microbatches):
    model, params, batch = testing.problem()
    perm = np.random.default_rng(3).permutation(64)
    shuffled = jax.tree.map(lambda x: x[perm], batch)
    step = unsplit.value_and_grad(
        tf.token_loss(model), weighted=True, microbatches=microbatches, mesh=mesh_of(devices)
    )
    loss, grads = step(params, shuffled, KEY, ids=perm)
    ref_loss, ref_grads = reference(True)
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    assert testing.rel_l2(grads, ref_grads) <= TOL
    # Control: shuffling without carrying the ids along does change the noise.
    _, moved = step(params, shuffled, KEY)
    assert testing.rel_l2(moved, ref_grads) > 100 * TOL


def test_record_ids_above_2_32_work_in_a_step():
    model, params, batch = testing.problem()
    ids = np.arange(64, dtype=np.int64) + 2**40
    step = unsplit.value_and_grad(
        tf.token_loss(model), weighted=True, microbatches=4, mesh=mesh_of(2)
    )
    one = unsplit.value_and_grad(tf.token_loss(model), weighted=True)
    _, a = step(params, batch, KEY, ids=ids)
    _, b = one(params, batch, KEY, ids=unsplit.ids64(ids))
    assert testing.rel_l2(a, b) <= TOL
    assert testing.rel_l2(a, reference(True)[1]) > 100 * TOL  # other ids, other noise


def test_padding_an_example_keeps_its_noise_on_shared_tokens():
    # Dropout on (tokens, features) activations is prefix-stable along the token axis:
    # a padded copy of an example sees the same masks on its real tokens.
    config = tf.TransformerConfig(vocab=32, length=24, width=32, heads=2, layers=1,
                                  attention_dropout=0.0, dropout=0.3)  # fmt: skip
    model = tf.Transformer(config)
    params = tf.init_params(model)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (4, 17)).astype(np.int32)
    short = {"inputs": tokens[:, :16], "targets": tokens[:, 1:],
             "mask": np.ones((4, 16), np.float32)}  # fmt: skip
    pad = rng.integers(0, 32, (4, 8)).astype(np.int32)  # junk, masked out
    long = {"inputs": np.concatenate([short["inputs"], pad], 1),
            "targets": np.concatenate([short["targets"], pad], 1),
            "mask": np.concatenate([short["mask"], np.zeros((4, 8), np.float32)], 1)}  # fmt: skip
    step = unsplit.value_and_grad(tf.token_loss(model), weighted=True)
    loss_s, grads_s = step(params, short, KEY)
    loss_l, grads_l = step(params, long, KEY)
    assert abs(float(loss_s) - float(loss_l)) <= TOL * abs(float(loss_s))
    assert testing.rel_l2(grads_l, grads_s) <= 1e-4
    # Control: with another step key the same example gets other noise.
    loss_o, _ = step(params, short, jax.random.fold_in(KEY, 1))
    assert abs(float(loss_o) - float(loss_s)) > 1e-3


def test_repeated_ids_give_tied_noise():
    model, params, batch = testing.problem()
    one = jax.tree.map(lambda x: x[:1], batch)
    two = jax.tree.map(lambda x: np.concatenate([x[:1], x[:1]]), batch)
    step = unsplit.value_and_grad(tf.mean_loss(model))
    loss_one, _ = step(params, one, KEY, ids=np.array([5]))
    loss_tied, _ = step(params, two, KEY, ids=np.array([5, 5]))
    loss_free, _ = step(params, two, KEY, ids=np.array([5, 6]))
    assert float(loss_tied) == pytest.approx(float(loss_one), rel=1e-6)
    assert abs(float(loss_free) - float(loss_one)) > 1e-3


def test_weighted_loss_is_not_a_mean_of_microbatch_means():
    model, params, batch = testing.problem()
    loss, _ = unsplit.value_and_grad(tf.token_loss(model), weighted=True, microbatches=8)(
        params, batch, KEY
    )
    # Recompute both normalizations from per-example (loss_sum, weight) pairs.
    keys = unsplit.example_keys(KEY, jnp.arange(64))
    sums, weights = jax.vmap(tf.token_loss(model), in_axes=(None, 0, 0))(params, batch, keys)
    sums, weights = np.asarray(sums, np.float64), np.asarray(weights, np.float64)
    global_norm = sums.sum() / weights.sum()
    mean_of_means = np.mean(sums.reshape(8, 8).sum(1) / weights.reshape(8, 8).sum(1))
    assert float(loss) == pytest.approx(global_norm, rel=1e-5)
    assert abs(mean_of_means - global_norm) > 10 * TOL * global_norm  # ragged lengths differ


def test_negative_control_per_device_keys_depend_on_device_count():
    # flax.training.common_utils.shard_prng_key: one key per device, batch-level dropout.
    model, params, batch = testing.problem()
    one_device = testing.naive_value_and_grad(model, params, batch, list(jax.random.split(KEY, 1)))
    four_devices = testing.naive_value_and_grad(
        model, params, batch, list(jax.random.split(KEY, 4))
    )
    assert testing.rel_l2(four_devices[1], one_device[1]) > 1000 * TOL


def test_negative_control_one_key_per_microbatch_ties_microbatches():
    # T5X style: the same key for every microbatch gives every microbatch the same masks.
    model, params, batch = testing.problem()
    full = testing.naive_value_and_grad(model, params, batch, [KEY])
    accumulated = testing.naive_value_and_grad(model, params, batch, [KEY] * 8)
    assert testing.rel_l2(accumulated[1], full[1]) > 1000 * TOL


def test_compiled_once_second_call_does_not_retrace():
    model, params, batch = testing.problem()
    traces = []

    def counting_loss(p, example, key):
        traces.append(1)  # runs only while tracing
        return tf.token_loss(model)(p, example, key)

    step = unsplit.value_and_grad(counting_loss, weighted=True, microbatches=2, mesh=mesh_of(2))
    step(params, batch, KEY)
    after_first = len(traces)
    assert after_first > 0
    other = jax.tree.map(lambda x: x[::-1].copy(), batch)
    step(params, other, jax.random.fold_in(KEY, 1))
    step(params, batch, jax.random.fold_in(KEY, 2))
    assert len(traces) == after_first


def test_works_inside_the_callers_jit():
    model, params, batch = testing.problem()
    step = unsplit.value_and_grad(
        tf.token_loss(model), weighted=True, microbatches=2, mesh=mesh_of(2)
    )
    loss, grads = jax.jit(step)(params, batch, KEY)
    assert testing.rel_l2(grads, reference(True)[1]) <= TOL
    assert abs(float(loss) - float(reference(True)[0])) <= TOL * float(reference(True)[0])


def test_bf16_params_keep_their_dtype():
    def loss(w, x, key):
        keep = jax.random.bernoulli(key, 0.8, x.shape)
        return jnp.sum(jnp.where(keep, x, 0.0).astype(jnp.bfloat16) @ w).astype(jnp.float32)

    w = jnp.ones((3, 2), jnp.bfloat16)
    x = jnp.ones((8, 3), jnp.float32)
    loss_value, grads = unsplit.value_and_grad(loss, microbatches=4)(w, x, KEY)
    assert grads.dtype == jnp.bfloat16 and loss_value.dtype == jnp.float32


def test_two_dimensional_mesh_splits_the_batch_over_its_first_axis():
    model, params, batch = testing.problem()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    step = unsplit.value_and_grad(tf.token_loss(model), weighted=True, microbatches=2, mesh=mesh)
    _, grads = step(params, batch, KEY)
    assert testing.rel_l2(grads, reference(True)[1]) <= TOL
    assert jax.tree.leaves(grads)[0].sharding.is_fully_replicated
