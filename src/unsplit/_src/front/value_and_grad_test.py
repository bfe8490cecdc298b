"""value_and_grad: schedule invariance with negative controls for the naive schemes, and a
clear error for each mistake a user can make with a step, in every mode."""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.front import value_and_grad as step_lib
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


# ---- never silently wrong: each mistake a user can make gets a clear error, every mode --

KEY0 = jax.random.key(0)
W3 = np.ones((3,), np.float32)
X8 = np.ones((8, 3), np.float32)


def masked_loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return jnp.sum(jnp.where(keep, x, 0.0) * w)


def masked_weighted(w, ex, key):
    return masked_loss(w, ex["x"], key), ex["weight"]


@pytest.mark.parametrize("bitwise", [False, True])
def test_an_empty_batch_is_refused_with_the_same_message_in_every_mode(bitwise):
    step = unsplit.value_and_grad(masked_loss, bitwise=bitwise)
    with pytest.raises(ValueError, match=r"the global batch has 0 examples"):
        step(W3, np.ones((0, 3), np.float32), KEY0)


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
        unsplit.value_and_grad(lambda w, x, k: out(x))(W3, X8, KEY0)


def test_a_bool_weight_says_to_cast_it():
    step = unsplit.value_and_grad(lambda w, x, k: (masked_loss(w, x, k), x[0] > 0), weighted=True)
    with pytest.raises(TypeError, match=r"must be a number \(e.g. a token count\); got dtype=bool"):
        step(W3, X8, KEY0)


def test_nested_python_lists_as_a_batch_say_to_convert():
    with pytest.raises(TypeError, match=r"Python number inside nested Python lists.*Fix: convert"):
        unsplit.value_and_grad(masked_loss)(W3, [[1.0, 2.0, 3.0]] * 8, KEY0)


def test_a_captured_step_key_is_refused_at_the_first_call():
    captured = jax.random.key(42)

    def careless(w, x, key):  # draws from the captured key instead of its own
        return jnp.sum(x * w * jax.random.uniform(captured, x.shape))

    with pytest.raises(unsplit.AuditError, match=r"foreign_key"):
        unsplit.value_and_grad(careless)(W3, X8, KEY0)


def test_audit_true_warns_on_padding_only_findings():
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
    assert np.isfinite(float(unsplit.value_and_grad(attention_loss)(params, batch, KEY0)[0]))
    with pytest.warns(unsplit.PaddingWarning, match=r"padding_unstable"):
        unsplit.value_and_grad(attention_loss, audit=True)(params, batch, KEY0)


@pytest.mark.parametrize("bitwise", [False, True])
@pytest.mark.parametrize(
    "total,message",
    [(0.0, r"total weight of the global batch is 0.0"), (-1.0, r"is -1.0"), (np.inf, r"is inf")],
)
def test_checked_mode_raises_with_the_cause(bitwise, total, message):
    batch = {"x": X8, "weight": np.full((8,), total / 8, np.float32)}
    step = unsplit.value_and_grad(masked_weighted, weighted=True, bitwise=bitwise, checked=True)
    with pytest.raises(FloatingPointError, match=message):
        step(W3, batch, KEY0)
    unchecked = unsplit.value_and_grad(masked_weighted, weighted=True, bitwise=bitwise)
    assert np.isnan(float(unchecked(W3, batch, KEY0)[0]))  # the documented default: nan


def test_checked_mode_names_a_nan_loss_and_works_inside_jit():
    def nan_loss(w, x, key):
        return jnp.log(jnp.sum(x * w) - 3.0)  # log(0) = -inf

    step = unsplit.value_and_grad(nan_loss, checked=True)
    with pytest.raises(FloatingPointError, match=r"loss_fn itself returned inf or nan"):
        step(W3, X8, KEY0)
    with pytest.raises(Exception, match=r"loss_fn itself returned inf or nan"):
        jax.block_until_ready(jax.jit(step)(W3, X8, KEY0))


def test_a_batch_on_a_mesh_with_mesh_none_is_refused():
    mesh = jax.make_mesh((4,), ("data",))
    batch = jax.device_put(X8, NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"sharded over 4 devices .* mesh=None, which runs on one"):
        unsplit.value_and_grad(masked_loss)(W3, batch, KEY0)


def test_a_batch_on_a_bigger_mesh_than_the_steps_is_moved():
    big = jax.make_mesh((8,), ("data",))
    small = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    batch = jax.device_put(X8, NamedSharding(big, P("data")))
    reference = unsplit.value_and_grad(masked_loss)(W3, X8, KEY0)
    with pytest.warns(UserWarning, match=r"batch is not placed on the step's mesh"):
        out = unsplit.value_and_grad(masked_loss, mesh=small)(W3, batch, KEY0)
    np.testing.assert_allclose(out[0], reference[0], rtol=1e-6)


def test_out_of_memory_gets_the_microbatches_hint(monkeypatch):
    step = unsplit.value_and_grad(masked_loss, microbatches=2)

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")

    monkeypatch.setattr(step, "_engine", exhausted)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ran out of device memory.*microbatches"):
        step(W3, X8, KEY0)


@pytest.mark.parametrize("bitwise", [False, True])
def test_dropping_a_step_frees_its_loss_function(bitwise):
    def make():
        def fresh(w, x, key):
            return masked_loss(w, x, key)

        return fresh

    fn = make()
    dead = weakref.ref(fn)
    step = unsplit.value_and_grad(fn, bitwise=bitwise)
    step(W3, X8, KEY0)
    del step, fn
    gc.collect()
    assert dead() is None


def test_settings_are_validated_at_construction():
    with pytest.raises(TypeError, match=r"checked must be True or False"):
        unsplit.value_and_grad(masked_loss, checked=1)
    with pytest.raises(ValueError, match=r"batch_axes must be distinct axes of the mesh"):
        unsplit.value_and_grad(masked_loss, mesh=jax.make_mesh((2,), ("data",)), batch_axes="model")
    with pytest.raises(ValueError, match=r"names mesh axes, but mesh=None"):
        step_lib.value_and_grad(masked_loss, batch_axes="data")


def test_traced_ids_into_a_bitwise_step_get_the_jit_error():
    step = unsplit.value_and_grad(masked_loss, bitwise=True)
    with pytest.raises(TypeError, match=r"cannot run inside jax.jit.*Fix: use train = unsplit"):
        jax.jit(lambda ids: step(W3, X8, KEY0, ids))(jnp.arange(8))


def test_a_batch_on_a_bigger_mesh_is_moved_in_bitwise_mode_too():
    big = jax.make_mesh((8,), ("data",))
    small = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    batch = jax.device_put(np.ones((16, 3), np.float32), NamedSharding(big, P("data")))
    step = unsplit.value_and_grad(masked_loss, mesh=small, bitwise=True, chunk_size=2)
    reference = step(W3, np.ones((16, 3), np.float32), KEY0)
    with pytest.warns(UserWarning, match=r"batch is not placed on the step's mesh"):
        out = step(W3, batch, KEY0)
    assert unsplit.testing.bits_equal(out, reference)


@pytest.mark.parametrize("mesh", [None, "data"])
def test_numpy_batches_of_a_seen_shape_do_not_retrace(mesh):
    traces = []

    def counting(w, ex, key):
        traces.append(1)
        return masked_loss(w, ex["x"].astype(jnp.float32), key) + 0.0 * jnp.sum(ex["t"]).astype(
            jnp.float32
        )

    mesh = jax.make_mesh((8,), ("data",)) if mesh else None
    step = unsplit.value_and_grad(counting, mesh=mesh, microbatches=2)

    def batch(scale):  # new NumPy arrays each call: float64 and int64, as a data loader gives
        return {"x": np.ones((16, 3)) * scale, "t": np.arange(32).reshape(16, 2)}

    step(W3, batch(1.0), KEY0)
    first = len(traces)
    step(W3, batch(2.0), jax.random.key(9))
    assert len(traces) == first
