"""Flax's semantics of ``flax.nnx.Dropout``, checked on Flax's class and on unsplit's.

Every test runs twice, on ``flax.nnx.Dropout`` and on ``unsplit.nnx.Dropout``:
whatever Flax's layer passes, unsplit's must pass. The checks are those of
Flax's own tests that build an NNX ``Dropout`` (``tests/nnx/nn/stochastic_test.py``,
``module_test.py``, ``rngs_test.py``, ``graph_utils_test.py``, ``summary_test.py``,
``spmd_test.py``, ``transforms_test.py``, ``nn/recurrent_test.py``), written anew;
where Flax asserts its exact random bits, the property they stand for is
checked instead (other keys give other masks, the same key the same mask).
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from unsplit import nnx as unnx

LAYERS = [pytest.param(nnx.Dropout, id="flax"), pytest.param(unnx.Dropout, id="unsplit")]
X = jnp.ones((1, 10))


def block(Dropout, *, with_rngs=True):
    """Flax's test block: Linear, Dropout and BatchNorm, from ``nnx.Rngs(0)`` (one stream)."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 5, rngs=rngs)
            self.dropout = Dropout(0.5, deterministic=False, rngs=rngs if with_rngs else None)
            self.batch_norm = nnx.BatchNorm(10, use_running_average=False, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    return Block(nnx.Rngs(0))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_stored_stream_and_call_time_stream_give_the_same_masks_under_jit(Dropout):
    traces = 0
    stored = Dropout(rate=0.5, deterministic=False, rngs=nnx.Rngs(dropout=0))
    bare = Dropout(rate=0.5, deterministic=False)
    stream = nnx.Rngs(dropout=0).fork()

    @nnx.jit
    def call(layer, x, rngs=None):
        nonlocal traces
        traces += 1
        return layer(x, rngs=rngs)

    assert stored.rngs.count[...] == 0
    for step in (1, 2):
        a, b = call(stored, X), call(bare, X, rngs=stream)
        assert stored.rngs.count[...] == step and stream.dropout.count[...] == step
        np.testing.assert_array_equal(a, b)
    assert traces == 2


@pytest.mark.parametrize("Dropout", LAYERS)
def test_other_seeds_other_masks_and_call_time_rngs_take_precedence(Dropout):
    first = Dropout(rate=0.5, deterministic=False, rngs=nnx.Rngs(dropout=0))
    second = Dropout(rate=0.5, deterministic=False, rngs=nnx.Rngs(dropout=1))
    a, b = first(X), second(X)
    assert np.any(np.asarray(a) != np.asarray(b))
    np.testing.assert_array_equal(a, second(X, rngs=nnx.Rngs(dropout=0).fork()))
    key = jax.random.key(5)
    np.testing.assert_array_equal(first(X, rngs=key), second(X, rngs=key))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_deterministic_precedence_and_missing_rngs(Dropout):
    layer = Dropout(rate=0.5, deterministic=False)
    assert layer(X, deterministic=True) is X  # the call's flag wins, no rngs needed
    layer.set_attributes(deterministic=True)
    assert layer(X) is X
    dropped = layer(X, deterministic=False, rngs=nnx.Rngs(dropout=0))
    assert np.any(np.asarray(dropped) == 0)
    layer.set_attributes(deterministic=False)
    with pytest.raises(ValueError, match="`deterministic` is False, but no `rngs` argument"):
        layer(X)
    unset = Dropout(rate=0.5, deterministic=None)
    with pytest.raises(ValueError, match="No `deterministic` argument was provided to Dropout"):
        unset(X)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_views_set_deterministic(Dropout):
    layer = Dropout(rate=0.5, deterministic=False)
    assert nnx.view(layer, deterministic=True)(X) is X
    train = nnx.view(layer, deterministic=False)
    with pytest.raises(ValueError, match="no `rngs` argument was provided to Dropout"):
        train(X)
    assert np.any(np.asarray(train(X, rngs=nnx.Rngs(dropout=0))) == 0)
    model = block(Dropout)
    evaluating = nnx.view(model, only=nnx.Dropout, deterministic=True)
    assert evaluating.dropout.deterministic and not evaluating.batch_norm.use_running_average
    assert evaluating.linear.kernel is model.linear.kernel
    with pytest.raises(ValueError, match=r"Unused keys found in nnx.view: \['unknown'\]"):
        nnx.view(model, deterministic=True, unknown=True)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_set_attributes_and_with_attributes_filter_on_flax_type(Dropout):
    model = block(Dropout, with_rngs=False)
    model.set_attributes(nnx.Dropout, deterministic=True)
    assert model.dropout.deterministic and not model.batch_norm.use_running_average
    model = block(Dropout, with_rngs=False)
    copy = nnx.with_attributes(model, only=nnx.Dropout, deterministic=True)
    assert copy.dropout.deterministic and not model.dropout.deterministic
    with pytest.raises(ValueError, match=r"at least one instance .*\['unknown'\]"):
        model.set_attributes(deterministic=True, unknown=True)
    model.set_attributes(deterministic=True, unknown=True, raise_if_not_found=False)
    assert model.dropout.deterministic


@pytest.mark.parametrize("Dropout", LAYERS)
def test_train_and_eval(Dropout):
    model = block(Dropout)
    model.eval()
    assert model.dropout.deterministic and model.dropout(X) is X
    model.train()
    assert not model.dropout.deterministic and np.any(np.asarray(model.dropout(X)) == 0)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_one_default_stream_is_enough(Dropout):
    rngs = nnx.Rngs(0)
    layer = Dropout(0.5, rngs=rngs)  # no 'dropout' stream: forks 'default'
    assert rngs.default.count[...] == 1 and layer.rngs.tag == "default"
    a, b = layer(X), layer(X)
    assert np.any(np.asarray(a) != np.asarray(b)) and layer.rngs.count[...] == 2
    bare = Dropout(0.5)
    np.testing.assert_array_equal(bare(X, rngs=nnx.Rngs(3)), bare(X, rngs=nnx.Rngs(dropout=3)))
    named = Dropout(0.5, rng_collection="noise", rngs=nnx.Rngs(0, noise=1))
    assert named.rngs.tag == "noise"
    np.testing.assert_array_equal(
        bare(X, rngs=nnx.Rngs(0, dropout=1)), bare(X, rngs=nnx.Rngs(dropout=1))
    )


def error_type(call):
    try:
        call()
    except Exception as error:
        return type(error)
    raise AssertionError("no error")


def test_errors_are_flax_own():
    cases = [
        lambda D: D(0.5, rngs=3),
        lambda D: D(0.5, deterministic=False)(X, rngs=3),
        lambda D: D(0.5, rngs=nnx.Rngs(params=0)),  # no 'dropout' and no 'default' stream
        lambda D: D(0.5, deterministic=False)(X, rngs=nnx.Rngs(params=0)),
        lambda D: D(0.5, deterministic=False)(jnp.ones(3, jnp.int32), rngs=jax.random.key(0)),
    ]
    for case in cases:
        theirs = error_type(functools.partial(case, nnx.Dropout))
        assert error_type(functools.partial(case, unnx.Dropout)) is theirs
    with pytest.raises(TypeError, match=r"but got <class 'int'>\. Fix: "):
        unnx.Dropout(0.5, rngs=3)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_rate_zero_and_one_dtypes_and_broadcast_dims(Dropout):
    rngs = nnx.Rngs(0)
    x = jnp.ones((6, 8))
    assert Dropout(0.0, rngs=rngs)(x) is x
    zeros = Dropout(1.0)(x.astype(jnp.float16))
    assert zeros.dtype == jnp.float16 and not np.any(np.asarray(zeros))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        assert Dropout(0.3, rngs=rngs)(x.astype(dtype)).dtype == dtype
    shared = np.asarray(Dropout(0.5, broadcast_dims=(0,), rngs=rngs)(x))
    assert np.all(shared == shared[:1]) and 0 < np.count_nonzero(shared[0]) < 8


@pytest.mark.parametrize("Dropout", LAYERS)
def test_jit_advances_a_passed_default_stream(Dropout):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 2, rngs=rngs)
            self.dropout = Dropout(0.5, deterministic=False)

        def __call__(self, x, rngs):
            return self.dropout(self.linear(x), rngs=rngs)

    rngs = nnx.Rngs(0)
    model = Model(rngs)
    assert rngs["default"].count[...] == 2  # kernel and bias

    @nnx.jit
    def twice(model, x, rngs):
        return model(model(x, rngs), rngs)

    twice(model, jnp.ones((2, 2)), rngs)
    assert rngs["default"].count[...] == 4  # one key per dropout call


@pytest.mark.parametrize("Dropout", LAYERS)
def test_split_merge_and_jax_vmap_over_dropout_keys(Dropout):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs
            self.dropout = Dropout(0.5, deterministic=False)
            self.linear = nnx.Linear(2, 16, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x), rngs=self.rngs)

    model = Model(nnx.Rngs(params=0, dropout=1))
    graphdef, params, counts, dropout_keys, param_keys = nnx.split(
        model, nnx.Param, nnx.RngCount, "dropout", "params"
    )
    keys = jax.tree.map(lambda k: jax.random.split(k, 4), dropout_keys)
    params = jax.tree.map(lambda p: jnp.stack([p] * 4), params)

    @functools.partial(jax.vmap, in_axes=(0, 0, None, None, 0), out_axes=(0, None))
    def forward(params, dropout_keys, param_keys, counts, x):
        model = nnx.merge(graphdef, params, dropout_keys, param_keys, counts)
        y = model(x)
        return y, nnx.split(model, nnx.Param, nnx.RngCount, ...)[2]

    y, counts = forward(params, keys, param_keys, counts, jnp.ones((4, 1, 2)))
    nnx.update(model, counts)
    assert y.shape == (4, 1, 16) and model.rngs["dropout"].count[...] == 1
    assert np.any(np.asarray(y[0] == 0) != np.asarray(y[1] == 0))  # split keys, other masks


@pytest.mark.parametrize("Dropout", LAYERS)
def test_reseed_repeats_the_masks(Dropout):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 8, rngs=rngs)
            self.dropout = Dropout(0.5, deterministic=False, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    model = Model(nnx.Rngs(params=0, dropout=42))
    first = model(jnp.ones((1, 2)))
    nnx.reseed(model, dropout=42)
    np.testing.assert_array_equal(first, model(jnp.ones((1, 2))))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_name_in_repr_view_info_iter_modules_and_tabulate(Dropout):
    model = block(Dropout)
    modules = list(nnx.iter_modules(model))
    names = {type(m).__name__ for _, m in modules}
    assert "Dropout" in names and all(not n.endswith("NNXDropout") for n in names)
    assert sum(isinstance(m, nnx.Dropout) for _, m in modules) == 1
    children = dict(nnx.iter_children(model))
    assert type(children["dropout"]).__name__ == "Dropout"
    assert "dropout=Dropout(" in repr(model).replace(" ", "")
    assert nnx.view_info(model).count("Dropout:") == 1
    assert "Dropout:" in nnx.view_info(model, only=nnx.Dropout)
    table = nnx.tabulate(model, jnp.ones((1, 2)), console_kwargs={"width": 200})
    assert "Dropout" in table and "NNXDropout" not in table


@pytest.mark.parametrize("Dropout", LAYERS)
def test_eval_shape_builds_an_abstract_layer(Dropout):
    layer = nnx.eval_shape(lambda: Dropout(0.5, rngs=nnx.Rngs(0)))
    assert type(layer) is Dropout and layer.rngs.key.shape == ()


@pytest.mark.parametrize("Dropout", LAYERS)
def test_out_sharding_follows_the_input_on_an_explicit_mesh(Dropout):
    mesh = jax.make_mesh((2, 2), ("X", "Y"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        x = jax.sharding.reshard(jnp.arange(8.0).reshape(2, 4), P("X", None))
        for layer in (
            Dropout(0.5, deterministic=False, rngs=nnx.Rngs(0)),
            Dropout(0.5, deterministic=False, broadcast_dims=(1,), rngs=nnx.Rngs(0)),
        ):
            assert "float32[2@X,4]" in str(jax.typeof(layer(x)))
            jitted = jax.jit(lambda x, rngs, layer=layer: layer(x, rngs=rngs))
            assert "float32[2@X,4]" in str(jax.typeof(jitted(x, nnx.Rngs(0))))


@pytest.mark.parametrize("Dropout", LAYERS)
def test_vmapped_construction_and_scanned_calls(Dropout):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 3, rngs=rngs)
            self.dropout = Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(nnx.gelu(self.linear(x))), None

    @nnx.split_rngs(splits=5)
    @nnx.vmap(in_axes=0, axis_size=5)
    def create(rngs):
        return MLP(rngs)

    @nnx.scan(in_axes=(0, nnx.Carry))
    def forward(model, x):
        return model(x)

    model = create(nnx.Rngs(0))
    assert model.linear.kernel.shape == (5, 3, 3) and model.dropout.rngs.key.shape == (5,)
    y, _ = forward(model, jnp.ones((1, 3)))
    assert y.shape == (1, 3)


@pytest.mark.parametrize("Dropout", LAYERS)
def test_vmap_with_state_axes_gives_each_member_its_own_mask(Dropout):
    class Member(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 16, rngs=rngs)
            self.dropout = Dropout(0.5, deterministic=False, rngs=rngs)

        def __call__(self, x):
            return self.dropout(nnx.relu(self.linear(x)) + 1.0)

    axes = nnx.StateAxes({(nnx.Param, nnx.RngState): 0, ...: None})
    rngs = nnx.Rngs(0)
    with nnx.split_rngs(rngs, splits=5):
        members = nnx.vmap(lambda rngs: Member(rngs), in_axes=0, out_axes=axes)(rngs)
    forward = nnx.vmap(lambda m, x: m(x), in_axes=(axes, 0))
    y = np.asarray(forward(members, jnp.ones((5, 1, 3))))
    again = np.asarray(forward(members, jnp.ones((5, 1, 3))))
    assert y.shape == (5, 1, 16)
    assert np.any((y[0] == 0) != (y[1] == 0))  # members draw other masks
    assert np.any((y == 0) != (again == 0))  # and the streams advanced


@pytest.mark.parametrize("Dropout", LAYERS)
def test_recurrent_dropout_with_a_broadcast_stream(Dropout):
    class Cell(nnx.OptimizedLSTMCell):
        def __init__(self, rngs):
            super().__init__(in_features=4, hidden_features=8, rngs=rngs)
            self.recurrent_dropout = Dropout(
                0.25, deterministic=False, rng_collection="recurrent_dropout", rngs=rngs
            )

        def __call__(self, carry, x):
            h, c = super().__call__(carry, x)
            return jax.tree.map(self.recurrent_dropout, h), c

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lstm = nnx.RNN(Cell(rngs), broadcast_rngs="recurrent_dropout")
            self.dropout = Dropout(0.2, deterministic=False, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.lstm(x))

    model = Model(nnx.Rngs(0, recurrent_dropout=1))
    assert model.lstm.cell.recurrent_dropout.rngs.count[...] == 0
    assert model(jnp.ones((2, 5, 4))).shape == (2, 5, 8)
    assert model.lstm.cell.recurrent_dropout.rngs.count[...] == 1


def test_same_constructor_call_signature_and_flax_type():
    assert issubclass(unnx.Dropout, nnx.Dropout) and unnx.Dropout.__name__ == "Dropout"
    for method in ("__init__", "__call__"):
        ours, theirs = getattr(unnx.Dropout, method), getattr(nnx.Dropout, method)
        assert parameters(ours) == parameters(theirs), method


def parameters(fn):
    """Names, kinds and defaults of a signature (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
