"""The audit's rules beyond the corpus: edge cases, control flow, and its helpers."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import unsplit
from unsplit._src.audit import finding as audit_finding
from unsplit._src.audit import padding as audit_padding
from unsplit._src.audit import trace as audit_trace

KEY = jax.random.key(0)
X = jnp.ones((8, 6, 4))  # a batch of 8 examples of shape (6, 4)
W = jnp.ones(4)


def _audit(loss_fn, params=W, batch=X, **kwargs):
    return [(f.kind, f.line) for f in unsplit.audit(loss_fn, params, batch, KEY, **kwargs)]


def _line(offset=0):
    """The caller's line number plus ``offset``."""
    import inspect

    return inspect.currentframe().f_back.f_lineno + offset


def test_a_key_from_the_examples_data_alone_is_foreign():
    def loss_fn(w, x, key):
        own = jax.random.key(jnp.sum(x).astype(jnp.int32))
        return jnp.sum(x @ w) + jnp.sum(jax.random.normal(own, (3,)))

    (finding,) = unsplit.audit(loss_fn, W, X, KEY)
    assert finding.kind == "foreign_key" and "made inside the loss" in finding.message


def test_nnx_module_captured_by_the_loss():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    net = Net(nnx.Rngs(0))

    def loss_fn(w, x, key):
        return jnp.sum(net(x) @ w)

    (finding,) = unsplit.audit(loss_fn, W, X, KEY)
    assert finding.kind == "foreign_key" and "nnx.Rngs" in finding.message
    assert finding.file == __file__


def test_state_returned_in_aux_is_not_dropped():
    model = nn.BatchNorm(use_running_average=False)
    variables = model.init(jax.random.key(1), jnp.ones((6, 4)))

    def keeps(v, x, key):
        out, updates = model.apply(v, x, mutable=["batch_stats"])
        return jnp.sum(out), updates

    def drops(v, x, key):
        out, _ = model.apply(v, x, mutable=["batch_stats"])
        return jnp.sum(out)

    assert unsplit.audit(keeps, variables, X, KEY, has_aux=True) == []
    (finding,) = unsplit.audit(drops, variables, X, KEY)
    assert finding.kind == "dropped_state" and "batch_stats" in finding.message


def test_batchnorm_over_a_named_axis_reads_other_examples():
    model = nn.BatchNorm(use_running_average=False, axis_name="batch")
    variables = model.init(jax.random.key(1), jnp.ones((6, 4)))

    def loss_fn(v, x, key):
        out, _ = model.apply(v, x, mutable=["batch_stats"])
        return jnp.sum(out)

    findings = unsplit.audit(loss_fn, variables, X, KEY)
    assert sorted(f.kind for f in findings) == ["cross_example", "dropped_state"]
    assert "'batch'" in next(f.message for f in findings if f.kind == "cross_example")


def test_draws_inside_loops_and_branches_are_followed():
    def loss_fn(w, x, key):
        def layer(h, i):
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape)
            return jnp.where(keep, h, 0.0), None

        h, _ = jax.lax.scan(layer, x, jnp.arange(3))
        h = jax.lax.cond(jnp.sum(h) > 0, lambda: h, lambda: -h)
        fixed = jax.lax.fori_loop(0, 2, lambda i, k: jax.random.fold_in(k, i), jax.random.key(3))
        return jnp.sum(h @ w) + jnp.sum(jax.random.normal(fixed, (2,)))  # a foreign draw

    line = _line(-2)
    assert _audit(loss_fn) == [("foreign_key", line)]


def test_padding_draws_inside_a_scan_use_the_stride_rule():
    def loss_fn(w, x, key):
        length = x.shape[0]

        def layer(h, i):
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, (length, length))
            return h + jnp.sum(jnp.where(keep, x @ x.T, 0.0)), None

        total, _ = jax.lax.scan(layer, 0.0, jnp.arange(2))
        return total + jnp.sum(w)

    assert [k for k, _ in _audit(loss_fn)] == ["padding_unstable"]


def test_prefix_stable_draws_pass_the_padding_check():
    def loss_fn(w, x, key):
        k1, k2 = jax.random.split(key)
        h = unsplit.dropout(k1, x, 0.1)  # unsplit's lanes: element i depends on (key, i)
        keep = jax.random.bernoulli(k2, 0.5, x.shape)  # threefry: length on the leading axis
        return jnp.sum(jnp.where(keep, h, 0.0) @ w)

    assert _audit(loss_fn) == []


def test_mean_of_means_in_a_while_loop():
    def step(w, batch):
        def body(carry):
            i, total = carry
            micro = jax.lax.dynamic_slice_in_dim(batch["mask"], i * 4, 4)
            return i + 1, total + jnp.sum(micro * w[0]) / jnp.sum(micro)

        n = batch["mask"].shape[0] // 4
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, jnp.zeros(())))[1]

    batch = {"mask": jnp.ones((16,))}
    (finding,) = unsplit.audit_step(step, W, batch)
    assert finding.kind == "mean_of_means"


def test_a_mean_of_equal_microbatches_by_a_constant_is_not_reported():
    def step(w, batch):
        def body(total, micro):
            return total + jnp.mean(micro["x"] @ w), None

        micro = batch["x"].reshape(4, -1, 4)
        return jax.lax.scan(body, 0.0, {"x": micro})[0] / 4

    assert unsplit.audit_step(step, W, {"x": jnp.ones((16, 4))}) == []


def test_a_global_position_from_axis_index_is_not_a_device_key():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def step(w, x, key):
        def shard(w, x, key):
            ids = jax.lax.axis_index("d") * x.shape[0] + jnp.arange(x.shape[0])
            keys = unsplit.example_keys(key, ids)
            y = jax.vmap(lambda k, e: unsplit.dropout(k, e, 0.1))(keys, x)
            return jax.lax.psum(jnp.sum(y @ w), "d")

        specs = (jax.P(), jax.P("d"), jax.P())
        return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=jax.P())(w, x, key)

    assert unsplit.audit_step(step, W, jnp.ones((8, 4)), KEY) == []


# -- helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((jnp.ones((4, 3)), {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}, KEY), (1,)),
        ((jnp.ones((8, 3)),), (0,)),  # only the first argument: it is the batch
        (({"w": jnp.ones(3), "b": jnp.ones(())}, jnp.ones((8, 2)), jnp.ones(8)), (1, 2)),
        ((jnp.ones((4, 3)), jnp.ones((8, 3)), jnp.ones((5, 3)), jnp.ones((8, 1))), (1, 3)),
        (({"w": jnp.ones(())}, KEY), ()),
    ],
)
def test_infer_batch_argnums(args, expected):
    assert audit_trace.infer_batch_argnums(args) == expected


@pytest.mark.parametrize(
    ("long", "short", "stable"),
    [
        ((8, 4), (4, 4), True),  # length leading: flat indices kept
        ((1, 8, 8), (1, 4, 4), False),  # attention's (1, L, L)
        ((8,), (4,), True),
        ((2, 8), (2, 4), False),  # a non-leading length with a leading axis > 1
        ((1, 8), (1, 4), True),  # the leading axis has size 1
    ],
)
def test_stride_rule(long, short, stable):
    assert audit_padding._stable_strides(long, short) == stable


def test_user_frames_skip_libraries_but_not_models():
    assert audit_finding.is_user_file(__file__)
    assert not audit_finding.is_user_file(jax.__file__)
    assert not audit_finding.is_user_file(nn.__file__)
    assert not audit_finding.is_user_file(os.__file__)
    src = os.path.dirname(audit_finding.__file__)
    assert not audit_finding.is_user_file(os.path.join(src, "keys.py"))
    assert audit_finding.is_user_file(os.path.join(src, "transformer.py"))
