"""Users' models as they are: any params pytree, aux outputs, stateful layers, no host sync."""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import unsplit
from unsplit._src import test_util as testing

KEY = jax.random.key(7)
TOL = 1e-5


def mesh_of(n):
    return jax.make_mesh((n,), ("data",))


def xy_batch(b=16, d=4, classes=3):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(b, d)).astype(np.float32), "y": np.arange(b) % classes}


# ---------------------------------------------------------------- has_aux


def aux_loss(w, ex, key):
    keep = jax.random.bernoulli(key, 0.7, ex["x"].shape)
    logits = jnp.where(keep, ex["x"] / 0.7, 0.0) @ w
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, ex["y"])
    return loss, {"pred": jnp.argmax(logits), "logits": logits}


@pytest.mark.parametrize("devices,microbatches", [(1, 1), (1, 4), (4, 1), (2, 2), (8, 2)])
def test_aux_is_stacked_in_global_batch_order_for_every_schedule(devices, microbatches):
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)
    batch = xy_batch()
    (ref_loss, ref_aux), ref_grads = unsplit.value_and_grad(aux_loss, has_aux=True)(w, batch, KEY)
    mesh = None if devices == 1 else mesh_of(devices)
    step = unsplit.value_and_grad(aux_loss, has_aux=True, microbatches=microbatches, mesh=mesh)
    (loss, aux), grads = step(w, batch, KEY)
    assert aux["logits"].shape == (16, 3) and aux["pred"].shape == (16,)
    np.testing.assert_allclose(aux["logits"], ref_aux["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux["pred"], ref_aux["pred"])
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    assert testing.rel_l2(grads, ref_grads) <= TOL
    # Per example: example i's logits come from its own key, fold_in(KEY, i).
    one = aux_loss(w, jax.tree.map(lambda x: x[5], batch), jax.random.fold_in(KEY, 5))
    np.testing.assert_allclose(np.asarray(aux["logits"])[5], one[1]["logits"], rtol=1e-5, atol=1e-6)
    if mesh is not None:
        assert aux["logits"].sharding.spec[0] == "data"


def test_weighted_aux_pair():
    def loss(w, ex, key):
        value = jnp.sum(ex["x"] @ w)
        return (value, jnp.float32(2.0)), value

    (loss_value, aux), _ = unsplit.value_and_grad(loss, weighted=True, has_aux=True)(
        jnp.ones((4, 3)), xy_batch(), KEY
    )
    np.testing.assert_allclose(float(loss_value), float(jnp.sum(aux)) / 32, rtol=1e-6)


def test_has_aux_requires_a_pair():
    step = unsplit.value_and_grad(lambda w, ex, k: jnp.sum(ex["x"] @ w), has_aux=True)
    with pytest.raises(TypeError, match=r"with has_aux=True, loss_fn must return a pair \(loss"):
        step(jnp.ones((4, 3)), xy_batch(), KEY)


# ---------------------------------------------------------------- any pytree


class EqxMLP(eqx.Module):
    lin1: eqx.nn.Linear
    lin2: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    steps_seen: jax.Array  # an integer leaf: no gradient, passed through
    scale: float  # a Python float leaf: static

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(4, 16, key=k1)
        self.lin2 = eqx.nn.Linear(16, 3, key=k2)
        self.dropout = eqx.nn.Dropout(0.3)
        self.steps_seen = jnp.zeros((), jnp.int32)
        self.scale = 1.0

    def __call__(self, x, key):
        h = self.dropout(jax.nn.relu(self.lin1(x)), key=key)
        return self.lin2(h) * self.scale


def eqx_loss(model, ex, key):
    logits = model(ex["x"], key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ex["y"])


def test_equinox_module_int_leaves_get_none_and_apply_updates_works():
    model = EqxMLP(jax.random.key(0))
    batch = xy_batch()
    ref_loss, ref_grads = eqx.filter_value_and_grad(
        lambda m: jnp.mean(
            jax.vmap(eqx_loss, in_axes=(None, 0, 0))(
                m, batch, unsplit.example_keys(KEY, jnp.arange(16))
            )
        )
    )(model)
    step = unsplit.value_and_grad(eqx_loss, microbatches=2, mesh=mesh_of(4))
    loss, grads = step(model, batch, KEY)
    assert grads.steps_seen is None and grads.scale is None
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert testing.rel_l2(grads, ref_grads) <= TOL
    assert abs(float(loss) - float(ref_loss)) <= TOL * float(ref_loss)
    opt = optax.adam(1e-2)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        state = opt.init(eqx.filter(model, eqx.is_inexact_array))
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
    new = eqx.apply_updates(model, updates)
    assert not np.allclose(new.lin1.weight, model.lin1.weight)
    assert int(new.steps_seen) == 0


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.do = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(nnx.relu(self.l1(x))))


def nnx_loss(model, ex, key):
    nnx.reseed(model, dropout=key)  # this example's key drives the module's dropout
    return optax.softmax_cross_entropy_with_integer_labels(model(ex["x"]), ex["y"])


def test_nnx_module_with_rng_state_and_nnx_optimizer():
    model = NNXMLP(nnx.Rngs(params=0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = xy_batch()
    ref_loss, ref_grads = unsplit.value_and_grad(nnx_loss)(model, batch, KEY)
    loss, grads = unsplit.value_and_grad(nnx_loss, microbatches=2, mesh=mesh_of(4))(
        model, batch, KEY
    )
    assert grads.do.rngs.key.get_value() is None and grads.do.rngs.count.get_value() is None
    assert testing.rel_l2(grads, ref_grads) <= TOL
    assert abs(float(loss) - float(ref_loss)) <= TOL * float(ref_loss)
    before = np.asarray(model.l1.kernel[...])
    with jax.numpy_dtype_promotion("standard"):
        optimizer.update(model, grads)
    assert not np.allclose(model.l1.kernel[...], before)
    # The module's own rng stream was not advanced by the step (keys come from ids).
    assert int(model.do.rngs.count[...]) == 0


def test_nnx_state_from_split_works_too():
    model = NNXMLP(nnx.Rngs(params=0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(state, ex, key):  # the whole state goes in: its rng leaves get None
        return nnx_loss(nnx.merge(graphdef, *state), ex, key)

    _, (grads, rest_grads) = unsplit.value_and_grad(loss, mesh=mesh_of(2))(
        (params, rest), xy_batch(), KEY
    )
    assert isinstance(grads, nnx.State)
    assert all(g is None for g in jax.tree.leaves(rest_grads, is_leaf=lambda x: x is None))
    ref = unsplit.value_and_grad(nnx_loss)(model, xy_batch(), KEY)[1]
    assert testing.rel_l2(grads, nnx.state(ref, nnx.Param)) <= TOL


def test_unhashable_non_array_leaf_gets_a_clear_error():
    class Thing:  # a non-array leaf that cannot be a compile-time constant
        __hash__ = None

    step = unsplit.value_and_grad(lambda p, ex, k: jnp.sum(ex["x"] @ p["w"]))
    with pytest.raises(TypeError, match=r"neither an array nor hashable"):
        step({"w": jnp.ones((4, 3)), "t": Thing()}, xy_batch(), KEY)


# ---------------------------------------------------------------- stateful layers


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return jnp.sum(nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x)) ** 2)


def test_linen_batchnorm_update_is_a_clear_error():
    net = LinenBN()
    variables = net.init(jax.random.key(0), jnp.ones((4, 3)), train=False)

    def loss(v, ex, key):
        out, _ = net.apply(v, ex, mutable=["batch_stats"])  # the update is dropped
        return out

    batch = np.ones((8, 4, 3), np.float32)
    with pytest.raises(
        unsplit.DroppedStateError, match=r"BatchNorm layer 'BatchNorm_0' updates its 'batch_stats'"
    ):
        unsplit.value_and_grad(loss)(variables, batch, KEY)
    # Frozen statistics are fine.
    frozen = unsplit.value_and_grad(lambda v, ex, k: net.apply(v, ex, train=False))
    assert np.isfinite(float(frozen(variables, batch, KEY)[0]))


def test_nnx_batchnorm_update_is_a_clear_error_and_eval_mode_works():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return jnp.sum(self.bn(self.lin(x)) ** 2)

    model = M(nnx.Rngs(0))
    batch = np.ones((8, 4, 3), np.float32)
    step = unsplit.value_and_grad(lambda m, ex, k: m(ex))
    with pytest.raises(unsplit.DroppedStateError, match=r"params\.bn\.mean"):
        step(model, batch, KEY)
    model.eval()
    assert np.isfinite(float(step(model, batch, KEY)[0]))


def test_sown_intermediates_are_not_state_updates():
    class Sower(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            self.sow("intermediates", "h", h)
            return jnp.sum(h)

    net = Sower()
    variables = net.init(jax.random.key(0), jnp.ones(3))
    loss = lambda v, ex, k: net.apply(v, ex, mutable=["intermediates"])[0]  # noqa: E731
    assert np.isfinite(float(unsplit.value_and_grad(loss)(variables, np.ones((4, 3)), KEY)[0]))


# ---------------------------------------------------------------- weights, host sync


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("total", [0.0, -3.0, np.inf, np.nan])
def test_invalid_total_weight_gives_nan_on_device(total, microbatches):
    def loss(p, ex, key):  # p["unused"]: a leaf the loss never reaches (its grad: 0 or nan)
        return jnp.sum(ex["x"] @ p["w"]), ex["w"]

    params = {"w": jnp.ones((4, 3)), "unused": jnp.ones((2,))}
    batch = {**xy_batch(8), "w": np.full((8,), total / 8, np.float32)}
    for fn in (lambda s: s, jax.jit):
        step = unsplit.value_and_grad(
            loss, weighted=True, microbatches=microbatches, mesh=mesh_of(2)
        )
        value, grads = fn(step)(params, batch, KEY)
        assert np.isnan(float(value))
        assert all(np.all(np.isnan(g)) for g in jax.tree.leaves(grads))
    batch["w"] = np.ones((8,), np.float32)
    value, grads = step(params, batch, KEY)
    assert np.isfinite(float(value)) and np.all(grads["unused"] == 0)


def test_the_step_never_reads_from_the_device():
    model, params, batch = testing.problem()
    params = jax.device_put(params)
    step = unsplit.value_and_grad(
        unsplit.models.token_loss(model), weighted=True, microbatches=2, mesh=mesh_of(2)
    )
    step(params, batch, KEY)  # compile
    with jax.transfer_guard_device_to_host("disallow"):
        loss, _ = step(params, batch, jax.random.fold_in(KEY, 1))
        step(params, batch, KEY, ids=jnp.arange(64))
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("flag", ["weighted", "has_aux", "bitwise"])
def test_flags_must_be_bool(flag):
    with pytest.raises(TypeError, match=rf"{flag} must be True or False; got 'False'"):
        unsplit.value_and_grad(lambda w, ex, k: jnp.sum(w), **{flag: "False"})


# ---------------------------------------------------------------- scan carries


class LSTMClassifier(nn.Module):
    @functools.partial(
        nn.scan, variable_broadcast="params", split_rngs={"params": False}, in_axes=0, out_axes=0
    )
    @nn.compact
    def scan_cell(self, carry, x):
        return nn.OptimizedLSTMCell(16)(carry, x)

    @nn.compact
    def __call__(self, tokens, train=True):
        x = nn.Dropout(0.2, deterministic=not train)(nn.Embed(50, 8)(tokens))
        zero = (jnp.zeros((16,)), jnp.zeros((16,)))  # a scan carry built from a constant
        _, hs = self.scan_cell(zero, x)
        return nn.Dense(2)(hs[-1])


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_linen_scan_with_a_constant_carry_on_a_mesh(axis_type):
    model = LSTMClassifier()
    params = model.init(jax.random.key(0), jnp.zeros((10,), jnp.int32), train=False)["params"]

    def loss(p, ex, key):
        logits = model.apply({"params": p}, ex["t"], rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, ex["y"])

    rng = np.random.default_rng(0)
    batch = {"t": rng.integers(0, 50, (16, 10)), "y": np.arange(16) % 2}
    types = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
    mesh = jax.make_mesh((4,), ("data",), axis_types=(types[axis_type],))
    ref = unsplit.value_and_grad(loss)(params, batch, KEY)
    out = unsplit.value_and_grad(loss, microbatches=2, mesh=mesh)(params, batch, KEY)
    assert abs(float(out[0]) - float(ref[0])) <= TOL * float(ref[0])
    assert testing.rel_l2(out[1], ref[1]) <= TOL
