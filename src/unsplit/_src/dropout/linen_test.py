"""Flax's semantics of ``flax.linen.Dropout``, checked on Flax's class and on unsplit's.

Every test runs twice, on ``flax.linen.Dropout`` and on ``unsplit.linen.Dropout``:
whatever Flax's layer passes, unsplit's must pass. The checks are those of
Flax's own tests that build a linen ``Dropout`` (``tests/linen/linen_test.py``
``StochasticTest``, ``linen_module_test.py``'s default-rng tests,
``summary_test.py``), written anew; where Flax asserts its exact random bits,
the property they stand for is checked instead (other keys give other masks,
the same key gives the same mask).
"""

import dataclasses
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors

from unsplit import linen as ulinen
from unsplit._src import masks

LAYERS = [pytest.param(nn.Dropout, id="flax"), pytest.param(ulinen.Dropout, id="unsplit")]
KEY = jax.random.key(0)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_other_keys_other_masks_and_deterministic_ignores_keys(Dropout):
    layer = Dropout(rate=0.5)
    k1, k2 = jax.random.split(KEY)
    ones = jnp.ones((20, 20))
    a = layer.apply({}, ones, deterministic=False, rngs={"dropout": k1})
    b = layer.apply({}, ones, deterministic=False, rngs={"dropout": k2})
    assert np.any(np.asarray(a) != np.asarray(b))
    again = layer.apply({}, ones, deterministic=False, rngs={"dropout": k1})
    np.testing.assert_array_equal(a, again)
    a = layer.apply({}, ones, deterministic=True, rngs={"dropout": k1})
    b = layer.apply({}, ones, deterministic=True, rngs={"dropout": k2})
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, ones)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_kept_fraction_is_one_minus_rate_within_four_sigma(Dropout):
    rates = [float(r) for r in np.arange(0.1, 1.0, 0.1)]
    trials, shape = 10, (100, 100)

    @jax.jit
    def kept_counts(keys):  # one program for every rate: one compile
        counts = []
        for rate, key in zip(rates, keys, strict=True):
            layer = Dropout(rate=rate, deterministic=False)
            ys = jax.vmap(lambda k, layer=layer: layer.apply({}, jnp.ones(shape), rng=k))(
                jax.random.split(key, trials)
            )
            counts.append(jnp.sum(ys > 0))
        return jnp.stack(counts)

    n = trials * shape[0] * shape[1]
    counts = np.asarray(kept_counts(jax.random.split(KEY, len(rates))))
    for rate, kept in zip(rates, counts, strict=True):
        delta = 4 * np.sqrt(rate * (1 - rate) / n)
        assert abs(kept / n - (1 - rate)) < delta, (rate, kept / n)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_rate_zero_is_the_input_rate_one_is_zeros_with_finite_gradients(Dropout):
    x = jnp.ones((20, 20))
    y = Dropout(rate=0.0).apply({}, x, deterministic=False, rngs={"dropout": KEY})
    np.testing.assert_array_equal(y, x)
    none = Dropout(rate=1.0)
    np.testing.assert_array_equal(
        none.apply({}, x, deterministic=False, rngs={"dropout": KEY}), np.zeros((20, 20))
    )

    def total(x):
        return jnp.sum(none.apply({}, x, deterministic=False, rngs={"dropout": KEY}))

    assert not np.any(np.isnan(jax.grad(total)(x)))
    # Neither rate draws, so neither needs a key.
    assert Dropout(rate=0.0, deterministic=False).apply({}, x) is x
    assert not np.any(np.asarray(Dropout(rate=1.0, deterministic=False).apply({}, x)))


BROADCAST_CASES = {  # ndim, broadcast_dims, slice sharing one mask entry
    "2d_rows": (2, (1,), lambda y, i: y[i, :]),
    "2d_cols": (2, (0,), lambda y, i: y[:, i]),
    "3d_planes": (3, (1, 2), lambda y, i: y[i]),
    "3d_middle": (3, (1,), lambda y, i, j: y[i, :, j]),
    "4d_cubes": (4, (0, 2, 3), lambda y, i: y[:, i]),
    "4d_leading": (4, (0, 1), lambda y, i, j: y[:, :, i, j]),
    "4d_last": (4, (3,), lambda y, i, j, k: y[i, j, k, :]),
}


@pytest.mark.parametrize("case", list(BROADCAST_CASES))
@pytest.mark.parametrize("Dropout", LAYERS)
def test_broadcast_dims_share_one_mask_entry(Dropout, case):
    ndim, dims, cut = BROADCAST_CASES[case]
    layer = Dropout(rate=0.5, broadcast_dims=dims, deterministic=False)
    y = np.asarray(layer.apply({}, jnp.ones((10,) * ndim), rngs={"dropout": KEY}))
    free = ndim - len(dims)
    sizes = set()
    for index in np.ndindex(*(10,) * free):
        part = cut(y, *index)
        sizes.add(float(part.sum()))
        assert part.sum() in (0.0, 2.0 * part.size)  # all dropped or all kept (scale 2)
    assert len(sizes) == 2  # and the shared entries are not all alike


@pytest.mark.parametrize("Dropout", LAYERS)
def test_the_same_key_passed_as_rng_gives_the_same_mask(Dropout):
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            key = self.make_rng("dropout")
            a = Dropout(rate=0.5, deterministic=False)(x, rng=key)
            b = Dropout(rate=0.5, deterministic=False)(x, rng=jax.random.clone(key))
            return a, b

    a, b = Twice().apply({}, jnp.ones((20, 20)), rngs={"dropout": KEY})
    np.testing.assert_array_equal(a, b)


def dense_dropout_model(Dropout):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, add_dropout=False, add_noise=False):
            x = nn.Dense(16)(x)
            x = Dropout(0.5)(x, deterministic=not add_dropout)
            if add_noise:
                x += jax.random.normal(self.make_rng("params"))
            return x

    return Model()


@pytest.mark.parametrize("Dropout", LAYERS)
def test_training_mode_init_with_one_key_falls_back_to_params(Dropout):
    model = dense_dropout_model(Dropout)
    k0, k1, k2 = jax.random.split(KEY, 3)
    x = jax.random.normal(k0, (10, 8))
    model.init(k1, x, add_dropout=True)  # no 'dropout' stream: make_rng uses 'params'
    variables = model.init({"params": k1}, x)
    jax.tree.map(np.testing.assert_array_equal, variables, model.init(k1, x))
    for add_dropout, add_noise in [(True, False), (False, True), (True, True)]:
        a = model.apply(variables, x, add_dropout=add_dropout, add_noise=add_noise, rngs=k2)
        b = model.apply(
            variables, x, add_dropout=add_dropout, add_noise=add_noise, rngs={"params": k2}
        )
        np.testing.assert_array_equal(a, b)
    with pytest.raises(flax_errors.InvalidRngError, match=r"RNGs should be of shape \(2,\)"):
        model.init("test", x)
    with pytest.raises(ValueError, match=r"should be a ``jax\.PRNGKey``"):
        model.apply(variables, x, rngs={"params": "test"})


@pytest.mark.parametrize("Dropout", LAYERS)
def test_the_params_fallback_draws_what_a_dropout_stream_of_that_key_draws(Dropout):
    class Sub(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = Dropout(0.8)(nn.Dense(8)(x), deterministic=not train)
            return x + jax.random.normal(self.make_rng("noise"), x.shape)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = Sub()(nn.Dense(16)(x), train)
            return Dropout(0.5)(x, deterministic=not train)

    k0, k1, k2 = jax.random.split(KEY, 3)
    x = jax.random.normal(k0, (10, 4))
    model = Model()
    variables = model.init({"params": k1}, x, train=False)
    fallback = model.apply(variables, x, train=True, rngs={"params": k1})
    explicit = model.apply(variables, x, train=True, rngs={"dropout": k1, "noise": k1})
    np.testing.assert_array_equal(fallback, explicit)
    other = model.apply(variables, x, train=True, rngs={"dropout": k2, "noise": k1})
    assert np.any(np.asarray(other != explicit))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_rng_collection_names_the_stream(Dropout):
    layer = Dropout(0.5, deterministic=False, rng_collection="noise")
    x = jnp.ones((8, 8))
    a = layer.apply({}, x, rngs={"noise": KEY})
    np.testing.assert_array_equal(a, layer.apply({}, x, rngs={"noise": KEY}))
    np.testing.assert_array_equal(a, layer.apply({}, x, rngs={"params": KEY}))  # fallback
    with pytest.raises(flax_errors.InvalidRngError):  # no stream at all
        layer.apply({}, x)


def error_of(call):
    try:
        call()
    except Exception as error:
        return type(error), str(error)
    raise AssertionError("no error")


def test_deterministic_rules_and_errors_are_flax_own():
    x = jnp.ones((4, 4))
    for fields, call in [({}, {}), ({"deterministic": True}, {"deterministic": False})]:
        theirs = error_of(lambda f=fields, c=call: nn.Dropout(0.5, **f).apply({}, x, **c))
        ours = error_of(lambda f=fields, c=call: ulinen.Dropout(0.5, **f).apply({}, x, **c))
        assert ours == theirs and theirs[0] is ValueError
    for Dropout in (nn.Dropout, ulinen.Dropout):
        assert Dropout(0.5, deterministic=True).apply({}, x) is x
        assert Dropout(0.5).apply({}, x, deterministic=True) is x


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64])
def test_dtypes_and_shapes_like_flax(dtype):
    x = (jax.random.normal(KEY, (3, 5, 7)) + 5).astype(dtype)
    outs = [
        Dropout(0.3, deterministic=False).apply({}, x, rngs={"dropout": KEY})
        for Dropout in (nn.Dropout, ulinen.Dropout)
    ]
    assert outs[0].dtype == outs[1].dtype == dtype and outs[0].shape == outs[1].shape
    # Kept values are x / keep_prob in x's dtype; unsplit's keep_prob is the threshold's.
    ours = np.asarray(outs[1])
    want = np.asarray(x / (masks.keep_threshold(0.3) / 2**16))
    np.testing.assert_array_equal(ours[ours != 0], want[ours != 0])


def test_integer_inputs_fail_in_both_with_the_same_error_type():
    x = jnp.ones((4,), jnp.int32)
    theirs, ours = (
        error_of(lambda D=D: D(0.5, deterministic=False).apply({}, x, rngs={"dropout": KEY}))
        for D in (nn.Dropout, ulinen.Dropout)
    )
    assert ours[0] is theirs[0]  # TypePromotionError under strict promotion, else TypeError


def test_same_fields_signature_and_flax_type():
    ours, theirs = ulinen.Dropout, nn.Dropout
    assert issubclass(ours, theirs) and ours.__name__ == "Dropout"
    fields = [(f.name, f.default) for f in dataclasses.fields(theirs)]
    assert [(f.name, f.default) for f in dataclasses.fields(ours)] == fields
    assert parameters(ours.__call__) == parameters(theirs.__call__)


def parameters(fn):
    """Names, kinds and defaults of a signature (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


class ConvBlock(nn.Module):
    """Flax's summary-test block: a Dropout declared in setup and reused."""

    Dropout: type

    def setup(self):
        self.conv = nn.Conv(4, (3, 3))
        self.dropout = self.Dropout(0.5)

    def __call__(self, x, training):
        return nn.relu(self.dropout(self.conv(x), deterministic=not training))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_names_in_summaries_and_auto_names(Dropout):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = ConvBlock(Dropout, name="block1")(x, training=True)
            return Dropout(0.5, deterministic=True)(x)

    x = jnp.ones((1, 6, 6, 3))
    rngs = {"dropout": jax.random.key(0), "params": jax.random.key(1)}
    table = Net().tabulate(rngs, x, console_kwargs={"width": 200})
    rows = [line for line in table.splitlines() if "Dropout" in line]
    assert any("block1/dropout" in row and "Dropout" in row for row in rows), table
    assert any("Dropout_0" in row for row in rows), table
    assert not any("LinenDropout" in row for row in table.splitlines())
    names = {}

    class Recorder(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = Dropout(0.5, deterministic=True)
            y = layer(x)
            names["auto"] = layer.name
            return y

    Recorder().init(KEY, x)
    assert names["auto"] == "Dropout_0"


@pytest.mark.parametrize("Dropout", LAYERS)
def test_a_reused_block_shows_one_dropout_path_per_call(Dropout):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Dropout(0.5, deterministic=True)(nn.Dense(3)(x))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = Block()
            return block(block(x))

    table = Net().tabulate(KEY, jnp.ones((2, 3)), show_repeated=True, console_kwargs={"width": 200})
    assert sum("Block_0/Dropout_0" in line for line in table.splitlines()) == 2


@pytest.mark.parametrize("Dropout", LAYERS)
def test_lifted_scan_and_vmap_split_or_share_the_dropout_stream(Dropout):
    class Step(nn.Module):
        @nn.compact
        def __call__(self, carry, x):
            return carry, Dropout(0.5, deterministic=False)(x)

    def masks(split):
        scan = nn.scan(
            Step,
            variable_broadcast="params",
            split_rngs={"params": False, "dropout": split},
            length=4,
        )
        return np.asarray(scan().apply({}, None, jnp.ones((4, 32)), rngs={"dropout": KEY})[1])

    split, shared = masks(True), masks(False)
    assert np.any(split[0] != split[1]) and np.all(shared == shared[:1])
    vmapped = nn.vmap(Dropout, in_axes=0, variable_axes={}, split_rngs={"dropout": True})(
        0.5, deterministic=False
    )
    rows = np.asarray(vmapped.apply({}, jnp.ones((4, 32)), rngs={"dropout": KEY}))
    assert np.any(rows[0] != rows[1])
