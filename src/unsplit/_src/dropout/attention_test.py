"""Tests of the attention drop-ins: Flax's semantics, the per-coordinate mask, padding, memory."""

import functools
import inspect

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from unsplit import linen as ulinen
from unsplit import nnx as unnx
from unsplit._src import masks, random
from unsplit._src import test_util as testing
from unsplit._src.dropout import attention
from unsplit._src.dropout.attention import attention_dropout

KEY = jax.random.key(0)
FUNCTIONS = {  # ours: Flax's
    "linen": (ulinen.dot_product_attention, nn.dot_product_attention),
    "nnx": (unnx.dot_product_attention, nnx.dot_product_attention),
}


def qkv(batch=(2,), length=6, heads=3, depth=4, seed=1):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (*batch, length, heads, depth)) for k in keys]


def parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_same_signature_as_flax(api):
    ours, theirs = FUNCTIONS[api]
    assert parameters(ours) == parameters(theirs)


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_without_dropout_it_is_flax_and_needs_no_rng(api):
    ours, theirs = FUNCTIONS[api]
    q, k, v = qkv()
    mask = jnp.tril(jnp.ones((6, 6), bool))
    for kwargs in [{}, {"dropout_rate": 0.3, "deterministic": True}, {"mask": mask}]:
        np.testing.assert_array_equal(ours(q, k, v, **kwargs), theirs(q, k, v, **kwargs))


def reference(api, q, k, v, key, rate, broadcast, **kwargs):
    """Flax's attention with unsplit's grid mask applied by hand to Flax's weights."""
    weights_fn = (
        nn.dot_product_attention_weights
        if api == "linen"
        else nnx.nn.attention.dot_product_attention_weights
    )
    weights = weights_fn(q, k, deterministic=True, **kwargs)
    shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
    threshold = masks.keep_threshold(rate)
    mask = random.grid_lanes16(key, shape) < threshold
    dropped = jnp.where(mask, weights / (threshold / 2**16), 0.0)
    return jnp.einsum("...hqk,...khd->...qhd", dropped, v)


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_dropout_path_is_flax_with_the_grid_mask(api, broadcast):
    ours, _ = FUNCTIONS[api]
    q, k, v = qkv()
    mask = jnp.tril(jnp.ones((6, 6), bool))
    got = ours(q, k, v, mask=mask, dropout_rng=KEY, dropout_rate=0.4, broadcast_dropout=broadcast)
    want = reference(api, q, k, v, KEY, 0.4, broadcast, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def dropped_weights(fn, length, real, *, heads=2, batch=(), broadcast=False, key=KEY, rate=0.5):
    """The dropped weights ``[batch..., heads, q, k]`` seen through the output.

    Queries and keys are zero, so each query's weights are uniform (``1/real``)
    over the ``real`` unmasked keys; values are one-hot per key position, so
    output ``[..., q, h, j]`` is the dropped weight of (h, q, key j).
    """
    q = jnp.zeros((*batch, length, heads, 4))
    v = jnp.broadcast_to(jnp.eye(length)[:, None, :], (*batch, length, heads, length))
    mask = jnp.broadcast_to(jnp.arange(length) < real, (length, length))
    attend = functools.partial(fn, dropout_rate=rate, broadcast_dropout=broadcast)
    out = jax.jit(lambda q, v, mask, key: attend(q, q, v, mask=mask, dropout_rng=key))(
        q, v, mask, key
    )
    return np.asarray(jnp.moveaxis(out, -2, -3)) * real  # kept: 1 / p, dropped: 0


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_padding_to_twice_the_length_keeps_the_mask_on_real_positions(api):
    ours, theirs = FUNCTIONS[api]
    short = dropped_weights(ours, 8, 8)
    padded = dropped_weights(ours, 16, 8)
    np.testing.assert_array_equal(padded[:, :8, :8], short)
    assert set(np.unique(short).tolist()) == {0.0, 2.0}
    # Flax's mask is drawn by flat index, so padding changes it.
    assert np.any(dropped_weights(theirs, 16, 8)[:, :8, :8] != dropped_weights(theirs, 8, 8))


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_broadcast_dropout_shares_the_mask_over_batch_and_heads(api):
    ours, _ = FUNCTIONS[api]
    shared = dropped_weights(ours, 8, 8, heads=3, batch=(2,), broadcast=True)
    assert np.all(shared == shared[:1, :1])
    # It is the mask of batch row 0, head 0 of the unshared layout.
    own = dropped_weights(ours, 8, 8, heads=3, batch=(2,))
    np.testing.assert_array_equal(shared[0, 0], own[0, 0])
    assert np.any(own[0, 0] != own[0, 1]) and np.any(own[0, 0] != own[1, 0])


def test_a_batched_call_gives_row_b_the_mask_of_fold_in_key_b():
    batched = dropped_weights(ulinen.dot_product_attention, 8, 8, batch=(3,))
    for b in range(3):
        row = dropped_weights(ulinen.dot_product_attention, 8, 8, key=jax.random.fold_in(KEY, b))
        np.testing.assert_array_equal(batched[b], row)


def test_vmap_over_example_keys_equals_one_example_at_a_time():
    q, k, v = qkv(batch=(3,))
    keys = jax.random.split(KEY, 3)
    fn = functools.partial(ulinen.dot_product_attention, dropout_rate=0.3)
    batched = jax.vmap(lambda q, k, v, r: fn(q, k, v, dropout_rng=r))(q, k, v, keys)
    for i in range(3):
        np.testing.assert_allclose(batched[i], fn(q[i], k[i], v[i], dropout_rng=keys[i]), 1e-6)


@pytest.mark.parametrize("rate", [0.1, 0.999, 1 - 1e-6])
def test_kept_weights_are_scaled_by_the_keep_probability_used(rate):
    p = masks.keep_threshold(rate) / 2**16
    y = attention_dropout(
        KEY, jnp.ones((4, 256, 256)), rate, broadcast_dropout=False, dtype=jnp.float32
    )
    assert set(np.unique(np.asarray(y)).tolist()) <= {0.0, float(np.float32(1 / np.float32(p)))}


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_rate_one_drops_every_weight_without_nans(api):
    ours, theirs = FUNCTIONS[api]
    q, k, v = qkv()
    refused = raised(lambda: theirs(q, k, v, dropout_rng=KEY, dropout_rate=1.0))
    if refused:  # Flax's nnx refuses rate 1 since 0.12.12: so do we, with its error
        assert raised(lambda: ours(q, k, v, dropout_rng=KEY, dropout_rate=1.0)) is refused
        return

    def total(q):
        return jnp.sum(ours(q, k, v, dropout_rng=KEY, dropout_rate=1.0))

    value, grad = jax.value_and_grad(total)(q)
    assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0)


def raised(call):
    """The type of the exception ``call()`` raises, or None."""
    try:
        call()
    except Exception as error:  # the type is what is compared
        return type(error)
    return None


def error_type(call):
    error = raised(call)
    if error is None:
        raise AssertionError("no error")
    return error


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_errors_are_flax_own(api):
    ours, theirs = FUNCTIONS[api]
    q, k, v = qkv()
    cases = [
        lambda f: f(q, k, v, dropout_rate=0.1),  # no dropout_rng
        lambda f: f(q, k, v[..., :5, :, :], dropout_rate=0.1),  # no dropout_rng, bad lengths
        lambda f: f(q, k, v[..., :5, :, :], dropout_rng=KEY, dropout_rate=0.1),  # k, v lengths
        lambda f: f(q, k[0], v, dropout_rng=KEY, dropout_rate=0.1),  # ranks
    ]
    if api == "linen":
        einsum = functools.partial(jnp.einsum)
        cases += [
            lambda f: f(q, k, v, dropout_rng=KEY, dropout_rate=0.1, qk_attn_weights_einsum=einsum),
            lambda f: f(
                q,
                k,
                v,
                dropout_rng=KEY,
                dropout_rate=0.1,
                precision="highest",
                qk_attn_weights_einsum=einsum,
                attn_weights_value_einsum=einsum,
            ),
        ]
    for case in cases:
        assert error_type(lambda c=case: c(ours)) is error_type(lambda c=case: c(theirs))
    # A missing key: Flax's error type (TypeError, or ValueError since Flax 0.12.12 in nnx),
    # with the fix spelled out.
    flax_error = error_type(lambda: theirs(q, k, v, dropout_rate=0.1))
    with pytest.raises(flax_error, match=r"got dropout_rng=None\. Fix: pass dropout_rng=key"):
        ours(q, k, v, dropout_rate=0.1)
    # A rate above 1: Flax's error where Flax checks it, else ours (Flax would compute garbage).
    flax_error = raised(lambda: theirs(q, k, v, dropout_rng=KEY, dropout_rate=1.5))
    with pytest.raises(flax_error or ValueError, match=None if flax_error else r"rate=1.5\. Fix"):
        ours(q, k, v, dropout_rng=KEY, dropout_rate=1.5)


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_dtypes_follow_flax(api):
    ours, theirs = FUNCTIONS[api]
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv())
    got = ours(q, k, v, dropout_rng=KEY, dropout_rate=0.2)
    want = theirs(q, k, v, dropout_rng=KEY, dropout_rate=0.2)
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    f32 = ours(q, k, v, dropout_rng=KEY, dropout_rate=0.2, dtype=jnp.float32)
    assert f32.dtype == theirs(q, k, v, dropout_rng=KEY, dropout_rate=0.2, dtype=jnp.float32).dtype


def test_gradients_regenerate_the_mask_and_match_the_reference():
    q, k, v = qkv()
    ct = jax.random.normal(jax.random.key(9), q.shape)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * ct)

    ours = functools.partial(
        ulinen.dot_product_attention, dropout_rng=KEY, dropout_rate=0.3, broadcast_dropout=False
    )
    ref = functools.partial(reference, "linen", key=KEY, rate=0.3, broadcast=False)
    got = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("broadcast", [True, False])
def test_no_more_compiled_temp_memory_than_flax(broadcast):
    q, k, v = qkv(batch=(4,), length=64, heads=4, depth=16)
    ct = jnp.ones_like(q)

    def attend(fn, key, q, k, v):
        return fn(q, k, v, dropout_rng=key, dropout_rate=0.1, broadcast_dropout=broadcast)

    def fwd_bwd(fn):
        def run(key, q, k, v, ct):
            y, vjp = jax.vjp(functools.partial(attend, fn, key), q, k, v)
            return y, vjp(ct)

        return run

    def temp(fn, *args):
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    def fwd(fn):
        return functools.partial(attend, fn)

    for wrap, args in [(fwd, (KEY, q, k, v)), (fwd_bwd, (KEY, q, k, v, ct))]:
        ours = temp(wrap(ulinen.dot_product_attention), *args)
        theirs = temp(wrap(nn.dot_product_attention), *args)
        assert ours <= theirs, (wrap.__name__, ours, theirs)


def test_a_shared_mask_is_hashed_at_its_own_shape():
    """broadcast_dropout: one hash per 4 weights of one (q, k) mask, not per batch row and head."""

    q, k, v = qkv(batch=(4,), length=16, heads=2)
    jaxpr = jax.make_jaxpr(
        lambda key: ulinen.dot_product_attention(q, k, v, dropout_rng=key, dropout_rate=0.1)
    )(KEY)
    assert testing.threefry_sizes(jaxpr.jaxpr) == [
        1,
        1,
        16 * 16 // 4,
    ]  # fold in (0, 0), then the mask


# --- as attention_fn of Flax's attention modules ---


def linen_layer(attention_fn, **kwargs):
    return nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, dropout_rate=0.2, attention_fn=attention_fn, **kwargs
    )


def test_linen_module_with_our_attention_fn():
    x = jax.random.normal(KEY, (2, 6, 8))
    ours, theirs = linen_layer(ulinen.dot_product_attention), linen_layer(nn.dot_product_attention)
    params = theirs.init(KEY, x, deterministic=False)  # only a 'params' stream: falls back
    assert jax.tree.structure(ours.init(KEY, x, deterministic=False)) == jax.tree.structure(params)
    np.testing.assert_array_equal(
        ours.apply(params, x, deterministic=True), theirs.apply(params, x, deterministic=True)
    )

    def train(key):
        return ours.apply(params, x, deterministic=False, rngs={"dropout": key})

    np.testing.assert_array_equal(train(KEY), train(KEY))
    assert np.any(np.asarray(train(KEY) != train(jax.random.key(7))))
    given = functools.partial(ours.apply, params, x, deterministic=False, dropout_rng=KEY)
    np.testing.assert_array_equal(given(), given(rngs={"dropout": KEY}))  # dropout_rng wins
    sown = [
        layer.apply(
            params,
            x,
            deterministic=False,
            rngs={"dropout": KEY},
            sow_weights=True,
            mutable=["intermediates"],
        )[1]
        for layer in (ours, theirs)
    ]
    jax.tree.map(np.testing.assert_array_equal, *sown)  # Flax's weights, before dropout


def test_nnx_module_with_our_attention_fn():
    x = jax.random.normal(KEY, (2, 6, 8))

    def layer(attention_fn, **kwargs):
        return nnx.MultiHeadAttention(
            num_heads=4, in_features=8, dropout_rate=0.2, decode=False,
            attention_fn=attention_fn, rngs=nnx.Rngs(0), **kwargs,
        )  # fmt: skip

    ours, theirs = layer(unnx.dot_product_attention), layer(nnx.dot_product_attention)
    np.testing.assert_array_equal(ours(x, deterministic=True), theirs(x, deterministic=True))
    a, b = ours(x, deterministic=False), ours(x, deterministic=False)
    assert np.any(np.asarray(a != b)) and ours.rngs.count[...] == 2
    gqa, gqa_flax = (layer(fn, num_kv_heads=2) for fn in FUNCTIONS["nnx"])
    np.testing.assert_array_equal(gqa(x, deterministic=True), gqa_flax(x, deterministic=True))
    assert gqa(x, deterministic=False).shape == (2, 6, 8)
    ours(x, deterministic=False, sow_weights=True)
    theirs(x, deterministic=False, sow_weights=True)
    np.testing.assert_array_equal(
        nnx.pop(ours, nnx.Intermediate)["attention_weights"][0],
        nnx.pop(theirs, nnx.Intermediate)["attention_weights"][0],
    )


@pytest.mark.parametrize("broadcast", [True, False])
def test_explicit_sharding_gives_the_unsharded_result(broadcast):
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v = qkv(batch=(4,), heads=2)

    def attend(q, k, v, key):
        return ulinen.dot_product_attention(
            q, k, v, dropout_rng=key, dropout_rate=0.5, broadcast_dropout=broadcast
        )

    want = jax.jit(attend)(q, k, v, KEY)
    with jax.set_mesh(mesh):
        spec = P("data", None, "model", None)
        sharded = [jax.sharding.reshard(x, spec) for x in (q, k, v)]
        got = jax.jit(attend)(*sharded, KEY)
    assert jax.typeof(got).sharding.spec == spec
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_head_major_value_contraction_is_flax_einsum(batch):
    w = jax.nn.softmax(jax.random.normal(jax.random.key(3), (*batch, 4, 6, 5)), axis=-1)
    v = jax.random.normal(jax.random.key(4), (*batch, 5, 4, 8))
    got = attention.weights_times_value(jnp.einsum, w, v)
    want = jnp.einsum("...hqk,...khd->...qhd", w, v)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_users_own_einsums_get_flax_subscripts():
    q, k, v = qkv()
    seen = []

    def einsum(subscripts, *operands):
        seen.append(subscripts)
        return jnp.einsum(subscripts, *operands)

    ulinen.dot_product_attention(
        q,
        k,
        v,
        dropout_rng=KEY,
        dropout_rate=0.3,
        qk_attn_weights_einsum=einsum,
        attn_weights_value_einsum=einsum,
    )
    assert seen == ["...qhd,...khd->...hqk", "...hqk,...khd->...qhd"]


@pytest.mark.parametrize("api", list(FUNCTIONS))
def test_with_dropout_the_value_contraction_runs_head_major(api):
    """No transpose of the weights [batch, heads, q, k]: XLA's CPU matmuls run them as stored."""
    ours, _ = FUNCTIONS[api]
    q, k, v = qkv(batch=(2,), length=16, heads=3, depth=4)
    attend = functools.partial(ours, dropout_rng=KEY, dropout_rate=0.1, broadcast_dropout=False)

    def eqns(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from eqns(sub)

    weights_shape = (2, 3, 16, 16)
    value_dot = next(
        e
        for e in eqns(jax.make_jaxpr(attend)(q, k, v).jaxpr)
        if e.primitive.name == "dot_general" and tuple(e.invars[0].aval.shape) == weights_shape
    )
    _, batch_dims = value_dot.params["dimension_numbers"]
    assert batch_dims == ((0, 1), (0, 1))  # (batch, heads) lead in both operands
