"""Tests of the functional dropout and the masked select every drop-in shares."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit import equinox as ueqx
from unsplit import linen as ulinen
from unsplit import nnx as unnx
from unsplit._src import masks
from unsplit._src.dropout.functional import BroadcastDimsError, dropout

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (4, 8, 16))


def kept(y):
    return np.asarray(y != 0)


# --- the function ---


# keep_mask(KEY, (4, 8), 0.3) rows as binary digits: the functional dropout's bits, pinned.
GOLDEN_DROPOUT_ROWS = [0b11111110, 0b10111100, 0b01011111, 0b00111101]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64])
def test_scaling_and_dtype_like_flax(dtype):
    x = X.astype(dtype) + jnp.asarray(5, dtype)  # no exact zeros in x
    y = jax.jit(dropout, static_argnums=2)(KEY, x, 0.3)
    assert y.dtype == dtype and y.shape == x.shape
    mask = np.asarray(masks.keep_mask(KEY, x.shape, 0.3))
    np.testing.assert_array_equal(kept(y), mask)
    # As flax, inputs / keep_prob in x's dtype; keep_prob is the one the threshold gives.
    keep = masks.keep_threshold(0.3) / 2**16
    assert keep != 0.7 and abs(keep - 0.7) <= 2**-17
    want = jax.jit(lambda x: x / keep)(x)
    np.testing.assert_array_equal(np.asarray(y)[mask], np.asarray(want)[mask])


def test_golden_dropout_bits_pinned():
    y = np.asarray(dropout(KEY, jnp.ones((4, 8)), 0.3))
    assert [int("".join(str(int(b)) for b in row != 0), 2) for row in y] == GOLDEN_DROPOUT_ROWS


def dropouts(rate):
    """``fn(key, x)`` for the function and each drop-in layer, all at ``rate``."""
    linen_layer = ulinen.Dropout(rate, deterministic=False)
    return {
        "function": lambda key, x: dropout(key, x, rate),
        "linen": lambda key, x: linen_layer.apply({}, x, rngs={"dropout": key}),
        "nnx": lambda key, x: unnx.Dropout(rate)(x, rngs=key),
        "equinox": lambda key, x: ueqx.Dropout(rate)(x, key=key),
        "equinox_traced_p": lambda key, x: eqx.filter_jit(lambda m, x: m(x, key=key))(
            ueqx.Dropout(jnp.float32(rate)), x
        ),
    }


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.999, 0.99999, 1 - 1e-6])
def test_expectation_is_exact_at_every_rate(rate):
    """E[y] == x: kept elements are x / p for p the keep probability the threshold gives.

    Exact by construction (p * (1 / p) == 1 in float32 up to one rounding); checked
    on the values every drop-in produces, and on the kept fraction (binomial
    interval, false failure 1e-7 per case).
    """
    threshold = masks.keep_threshold(rate)
    p = threshold / 2**16
    assert threshold >= 1 and abs(p * np.float32(1 / np.float32(p)) - 1) <= 2**-23
    x = jnp.ones((256, 1024))
    for name, fn in dropouts(rate).items():
        y = np.asarray(fn(KEY, x))
        values = set(np.unique(y).tolist())
        assert values <= {0.0, float(np.float32(1) / np.float32(p))}, (name, values)
        kept_count = int(np.count_nonzero(y))
        low, high = stats_interval(x.size, p)
        assert low <= kept_count <= high, (name, kept_count, x.size * p)


def stats_interval(n, p):
    from scipy import stats

    return stats.binom.interval(1 - 1e-7, n, p)


def test_biased_rounding_is_gone_at_rate_099999():
    """Issue 14: the mean at rate 0.99999 was 1.6 (threshold 1, scale 1 / 1e-5)."""
    y = dropout(KEY, jnp.ones((64, 1024)), 0.99999)
    assert set(np.unique(np.asarray(y)).tolist()) <= {0.0, 65536.0}


def test_rate_zero_is_the_identity_and_rate_one_is_zeros():
    assert dropout(KEY, X, 0.0) is X
    assert dropout(KEY, X, 1e-7) is not X  # rounds to keep-all: scale 1, so y == x exactly
    np.testing.assert_array_equal(dropout(KEY, X, 1e-7), X)
    zeros = dropout(KEY, X.astype(jnp.bfloat16), 1.0)
    assert zeros.dtype == jnp.bfloat16 and not np.any(np.asarray(zeros, np.float32))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(dropout(KEY, x, 1.0))))(X)
    assert np.all(np.isfinite(grad)) and not np.any(grad)


def test_broadcast_dims_share_the_mask():
    x = jnp.ones((4, 8, 16))
    y = np.asarray(dropout(KEY, x, 0.5, broadcast_dims=(0, -1)))
    assert np.all(y == y[:1, :, :1])
    mask = np.asarray(masks.keep_mask(KEY, (1, 8, 1), 0.5))
    np.testing.assert_array_equal(y != 0, np.broadcast_to(mask, x.shape))


def test_prefix_stable_when_the_input_is_padded_longer():
    short = jnp.ones((5, 16))
    long = jnp.ones((9, 16))
    np.testing.assert_array_equal(dropout(KEY, long, 0.5)[:5], dropout(KEY, short, 0.5))


def test_gradient_regenerates_the_same_mask():
    w = jax.random.normal(jax.random.key(2), X.shape)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(dropout(KEY, x, 0.25) * w)))(X)
    mask = np.asarray(masks.keep_mask(KEY, X.shape, 0.25))
    want = np.where(mask, np.asarray(jax.jit(lambda w: w / 0.75)(w)), 0.0)
    np.testing.assert_array_equal(grad, want)
    # No mask-sized residual: the backward pass draws it again from the key.
    _, vjp = jax.vjp(lambda x: dropout(KEY, x, 0.25), X)
    assert all(leaf.size <= 2 for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "size"))
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
        (lambda: dropout(KEY, X, 0.1, broadcast_dims=(3,)), IndexError, r"broadcast_dims=\(3,\)"),
        (lambda: dropout(KEY, X, 0.1, broadcast_dims=(-4,)), ValueError, r"in \[-3, 2\]"),
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


def test_broadcast_dims_accept_numpy_integers_and_fail_like_flax():
    y = dropout(KEY, jnp.ones((4, 8)), 0.5, broadcast_dims=(np.int64(0),))
    assert np.all(np.asarray(y) == np.asarray(y)[:1])
    # Flax's layers raise IndexError for an axis the input does not have; so does unsplit,
    # whose error is also a ValueError with the fix.
    assert issubclass(BroadcastDimsError, IndexError) and issubclass(BroadcastDimsError, ValueError)
    with pytest.raises(IndexError):
        nn.Dropout(0.5, broadcast_dims=(5,), deterministic=False).apply(
            {}, X, rngs={"dropout": KEY}
        )


def test_docs_examples_run():
    """Every python block of docs/dropout.md runs as written (user code: standard promotion)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    if not (root / "pyproject.toml").exists():
        pytest.skip("not run from the source tree")
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "dropout.md").read_text(), re.S)
    assert len(blocks) >= 4
    for block in blocks:
        with jax.numpy_dtype_promotion("standard"):
            exec(compile(block, "docs/dropout.md", "exec"), {})
