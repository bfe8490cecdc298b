"""Tests of dropout: Flax parity (linen and NNX), gradients, dtypes, errors, memory."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit import linen as ulinen
from unsplit import nnx as unnx
from unsplit._src import random, transformer
from unsplit._src.dropout import dropout

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (4, 8, 16))


def kept(y):
    return np.asarray(y != 0)


# --- the function ---


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_scaling_and_dtype_like_flax(dtype):
    x = X.astype(dtype) + jnp.asarray(5, dtype)  # no exact zeros in x
    y = jax.jit(dropout, static_argnums=2)(KEY, x, 0.3)
    assert y.dtype == dtype and y.shape == x.shape
    mask = np.asarray(random.keep_mask(KEY, x.shape, 0.3))
    np.testing.assert_array_equal(kept(y), mask)
    want = jax.jit(lambda x: x / 0.7)(x)  # flax: inputs / keep_prob in x's dtype
    np.testing.assert_array_equal(np.asarray(y)[mask], np.asarray(want)[mask])


def test_rate_zero_is_the_identity_and_rate_one_is_zeros():
    assert dropout(KEY, X, 0.0) is X
    zeros = dropout(KEY, X.astype(jnp.bfloat16), 1.0)
    assert zeros.dtype == jnp.bfloat16 and not np.any(np.asarray(zeros, np.float32))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(dropout(KEY, x, 1.0))))(X)
    assert np.all(np.isfinite(grad)) and not np.any(grad)


def test_broadcast_dims_share_the_mask():
    x = jnp.ones((4, 8, 16))
    y = np.asarray(dropout(KEY, x, 0.5, broadcast_dims=(0, -1)))
    assert np.all(y == y[:1, :, :1])
    mask = np.asarray(random.keep_mask(KEY, (1, 8, 1), 0.5))
    np.testing.assert_array_equal(y != 0, np.broadcast_to(mask, x.shape))


def test_prefix_stable_when_the_input_is_padded_longer():
    short = jnp.ones((5, 16))
    long = jnp.ones((9, 16))
    np.testing.assert_array_equal(dropout(KEY, long, 0.5)[:5], dropout(KEY, short, 0.5))


def test_gradient_regenerates_the_same_mask():
    w = jax.random.normal(jax.random.key(2), X.shape)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(dropout(KEY, x, 0.25) * w)))(X)
    mask = np.asarray(random.keep_mask(KEY, X.shape, 0.25))
    want = np.where(mask, np.asarray(jax.jit(lambda w: w / 0.75)(w)), 0.0)
    np.testing.assert_array_equal(grad, want)
    bf16 = jax.grad(lambda x: jnp.sum(dropout(KEY, x, 0.25)).astype(jnp.float32))
    assert jax.eval_shape(bf16, X.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_vmap_gives_each_example_its_own_key():
    keys = unsplit.example_keys(KEY, jnp.arange(4))
    batched = jax.jit(jax.vmap(lambda k, x: dropout(k, x, 0.5)))(keys, X)
    for i in range(4):
        np.testing.assert_array_equal(batched[i], dropout(keys[i], X[i], 0.5))
    assert np.any(kept(batched[0]) != kept(batched[1]))


def test_explicit_sharding_gives_the_unsharded_result():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = jnp.arange(8 * 6 * 16, dtype=jnp.float32).reshape(8, 6, 16) + 1
    keys = unsplit.example_keys(KEY, jnp.arange(8))
    cases = {  # name: (fn, key, key spec, x, x spec)
        "global": (lambda k, x: dropout(k, x, 0.5), KEY, P(), x, P("data", None, "model")),
        "broadcast": (
            lambda k, x: dropout(k, x, 0.5, broadcast_dims=(1,)),
            KEY,
            P(),
            x,
            P("data", None, "model"),
        ),
        "odd_last_axis": (
            lambda k, x: dropout(k, x, 0.5),
            KEY,
            P(),
            x[..., :6],
            P("data", "model", None),
        ),
        "per_example": (
            jax.vmap(lambda k, x: dropout(k, x, 0.5)),
            keys,
            P("data"),
            x,
            P("data", None, None),
        ),
    }
    for name, (fn, key, key_spec, value, spec) in cases.items():
        want = jax.jit(fn)(key, value)
        with jax.set_mesh(mesh):
            key = jax.device_put(key, NamedSharding(mesh, key_spec))
            got = jax.jit(fn)(key, jax.device_put(value, NamedSharding(mesh, spec)))
        assert jax.typeof(got).sharding.spec == spec, name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: dropout(KEY, X, -0.1), ValueError, r"rate must be in \[0, 1\].*rate=-0.1"),
        (lambda: dropout(KEY, X, 1.5), ValueError, r"got rate=1.5\. Fix"),
        (lambda: dropout(KEY, X, float("nan")), ValueError, r"rate=nan"),
        (lambda: dropout(KEY, X, "0.1x"), TypeError, r"rate must be a number"),
        (lambda: jax.jit(lambda r: dropout(KEY, X, r))(0.1), TypeError, "static Python float"),
        (lambda: dropout(KEY, jnp.ones(4, jnp.int32), 0.1), TypeError, "dtype=int32. Fix"),
        (lambda: dropout(KEY, X, 0.1, broadcast_dims=(3,)), ValueError, r"broadcast_dims=\(3,\)"),
        (lambda: dropout(None, X, 0.1), TypeError, r"key must be a PRNG key"),
        (lambda: dropout(jax.random.key(0, impl="rbg"), X, 0.1), TypeError, "'rbg' PRNG"),
    ],
)
def test_errors_say_what_arrived_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_no_more_compiled_temp_memory_than_flax():
    x = jnp.ones((16, 64, 128))
    ct = jnp.ones_like(x)

    def flax_fn(key, x):
        return nn.Dropout(0.1, deterministic=False).apply({}, x, rngs={"dropout": key})

    def ours(key, x):
        return dropout(key, x, 0.1)

    def fwd_bwd(fn):
        def run(key, x, ct):
            y, vjp = jax.vjp(lambda x: fn(key, x), x)
            return y, vjp(ct)[0]

        return run

    def temp(fn, *args):
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp(ours, KEY, x) <= temp(flax_fn, KEY, x)
    assert temp(fwd_bwd(ours), KEY, x, ct) <= temp(fwd_bwd(flax_fn), KEY, x, ct)


# --- linen ---


def linen_pair(**fields):
    return nn.Dropout(**fields), ulinen.Dropout(**fields)


def test_linen_is_a_flax_dropout_with_the_same_fields():
    theirs, ours = linen_pair(rate=0.2)
    assert isinstance(ours, nn.Dropout)
    assert (ours.rate, ours.broadcast_dims, ours.deterministic, ours.rng_collection) == (
        theirs.rate,
        theirs.broadcast_dims,
        theirs.deterministic,
        theirs.rng_collection,
    )


@pytest.mark.parametrize(
    ("fields", "call"),
    [
        ({"rate": 0.5, "deterministic": True}, {}),
        ({"rate": 0.5}, {"deterministic": True}),
        ({"rate": 0.0, "deterministic": False}, {}),
        ({"rate": 1.0, "deterministic": False}, {}),
    ],
)
def test_linen_deterministic_rate_zero_and_one_like_flax(fields, call):
    rngs = {"dropout": KEY}
    theirs, ours = linen_pair(**fields)
    want = theirs.apply({}, X, rngs=rngs, **call)
    got = ours.apply({}, X, rngs=rngs, **call)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_linen_scaling_shapes_and_broadcast_dims_like_flax():
    rngs = {"dropout": KEY}
    x = X + 5.0
    for fields in [{"rate": 0.3}, {"rate": 0.3, "broadcast_dims": (0, 2)}]:
        theirs, ours = linen_pair(deterministic=False, **fields)
        want = np.asarray(jax.jit(theirs.apply)({}, x, rngs=rngs))
        got = np.asarray(jax.jit(ours.apply)({}, x, rngs=rngs))
        assert got.shape == want.shape
        np.testing.assert_allclose(got[got != 0], (x / 0.7)[got != 0], rtol=1e-6)
        np.testing.assert_allclose(want[want != 0], (x / 0.7)[want != 0], rtol=1e-6)
        if "broadcast_dims" in fields:
            assert np.all((got != 0) == (got[:1, :, :1] != 0))


def test_linen_rng_argument_and_rng_collection():
    layer = ulinen.Dropout(0.5, deterministic=False)
    np.testing.assert_array_equal(layer.apply({}, X, rng=KEY), dropout(KEY, X, 0.5))
    named = ulinen.Dropout(0.5, deterministic=False, rng_collection="noise")
    assert named.apply({}, X, rngs={"noise": KEY}).shape == X.shape


def test_linen_merge_param_errors_like_flax():
    theirs, ours = linen_pair(rate=0.5)
    for layer in (theirs, ours):
        with pytest.raises(ValueError, match='"deterministic" must be passed'):
            layer.apply({}, X, rngs={"dropout": KEY})


def test_linen_refuses_the_silent_params_fallback():
    theirs, ours = linen_pair(rate=0.5, deterministic=False)
    theirs.apply({}, X, rngs={"params": KEY})  # flax silently uses 'params'
    with pytest.raises(
        flax_errors.InvalidRngError, match=r"rng_collection='dropout'.*\['params'\]"
    ):
        ours.apply({}, X, rngs={"params": KEY})
    with pytest.raises(flax_errors.InvalidRngError, match=r"Fix: pass rngs=\{'dropout': key\}"):
        ours.apply({}, X)


def test_linen_transformer_train_step_traces():
    """unsplit's Dropout as the test transformer's dropout_cls (traced, not compiled: fast)."""
    config = transformer.TransformerConfig(length=8, layers=1)
    model = transformer.Transformer(config, dropout_cls=ulinen.Dropout)
    tokens = jnp.zeros((8,), jnp.int32)
    params = jax.eval_shape(lambda: model.init(KEY, tokens, train=False)["params"])
    example = {"inputs": tokens, "targets": tokens, "mask": jnp.ones(8)}
    step = jax.value_and_grad(transformer.mean_loss(model))
    loss, grads = jax.eval_shape(step, params, example, KEY)
    assert loss.shape == () and jax.tree.structure(grads) == jax.tree.structure(params)


# --- nnx ---


def test_nnx_stream_is_forked_and_advanced_like_flax():
    theirs = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    ours = unnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    assert isinstance(ours, nnx.Dropout)
    same_key = jax.random.key_data(theirs.rngs.key[...]) == jax.random.key_data(ours.rngs.key[...])
    assert bool(jnp.all(same_key))
    first, second = ours(X), ours(X)
    theirs(X), theirs(X)
    assert int(ours.rngs.count[...]) == int(theirs.rngs.count[...]) == 2
    assert np.any(kept(first) != kept(second))
    np.testing.assert_array_equal(first, dropout(jax.random.fold_in(ours.rngs.key[...], 0), X, 0.5))


def test_nnx_call_time_rngs_take_precedence():
    layer = unnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    np.testing.assert_array_equal(layer(X, rngs=KEY), dropout(KEY, X, 0.5))
    stream = nnx.Rngs(dropout=4)
    layer(X, rngs=stream)
    layer(X, rngs=stream.dropout)
    assert int(stream.dropout.count[...]) == 2
    assert int(layer.rngs.count[...]) == 0


def test_nnx_deterministic_train_eval_and_view_like_flax():
    ours = unnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    assert ours(X, deterministic=True) is X
    ours.eval()
    assert ours(X) is X and ours(X, deterministic=False).shape == X.shape
    ours.train()
    assert np.any(np.asarray(ours(X)) == 0)
    assert nnx.view(ours, deterministic=True)(X) is X
    ours.set_attributes(nnx.Dropout, deterministic=True)  # filters on the flax type
    assert ours.deterministic is True
    assert unnx.Dropout(0.0, rngs=nnx.Rngs(dropout=0))(X) is X
    zeros = unnx.Dropout(1.0)(X.astype(jnp.float16))
    assert zeros.dtype == jnp.float16 and not np.any(np.asarray(zeros))


def test_nnx_jit_advances_the_stream():
    layer = unnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    step = nnx.jit(lambda layer, x: layer(x))
    a, b = step(layer, X), step(layer, X)
    assert int(layer.rngs.count[...]) == 2
    assert np.any(kept(a) != kept(b))


def test_nnx_refuses_the_silent_default_fallback():
    nnx.Dropout(0.5, rngs=nnx.Rngs(0))  # flax silently uses 'default'
    with pytest.raises(ValueError, match=r"rng_collection='dropout'.*\['default'\].*nnx.Rngs\(0, "):
        unnx.Dropout(0.5, rngs=nnx.Rngs(0))
    layer = unnx.Dropout(0.5)
    with pytest.raises(ValueError, match=r"passed at call has the streams \['params'\]"):
        layer(X, rngs=nnx.Rngs(params=0))
    default = unnx.Dropout(0.5, rng_collection="default", rngs=nnx.Rngs(0))
    assert default(X).shape == X.shape


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: unnx.Dropout(0.5)(X), ValueError, "no `rngs` argument was provided"),
        (lambda: unnx.Dropout(0.5, deterministic=None)(X), ValueError, "deterministic=None"),
        (lambda: unnx.Dropout(0.5, rngs=3), TypeError, "got int. Fix"),
        (lambda: unnx.Dropout(0.5)(X, rngs=3), TypeError, "got int. Fix"),
        (lambda: unnx.Dropout(-1.0), ValueError, r"rate=-1.0"),
    ],
)
def test_nnx_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
