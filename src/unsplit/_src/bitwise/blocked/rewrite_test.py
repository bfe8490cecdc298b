"""The canonical-block rewrite: the same bits at every degree that divides the blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src.bitwise.blocked import rewrite
from unsplit._src.trees import rel_l2

KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (16, 64))  # rows, features
W1 = jax.random.normal(KEYS[1], (64, 256)) / 8  # column parallel
W2 = jax.random.normal(KEYS[2], (256, 64)) / 16  # row parallel
DEGREES = (2, 4, 8)


def gmesh(m, name="model"):
    return jax.make_mesh((m,), (name,), devices=jax.devices()[:m], axis_types=(AxisType.Auto,))


def mlp(w1, w2, x):
    h = jax.nn.gelu(x @ w1)
    y = h @ w2
    return jnp.sum(jax.nn.log_softmax(y) ** 2), y


def megatron(m, fn=mlp, **kw):
    mesh = gmesh(m)
    run = rewrite.program(
        fn, mesh, (W1, W2, X), (P(None, "model"), P("model", None), P()), (P(), P()), **kw
    )
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(
        (W1, W2, X), (P(None, "model"), P("model", None), P()), strict=True)]  # fmt: skip
    return [np.asarray(o) for o in run(*args)]


def grads(w1, w2, x):
    return jax.grad(lambda w1, w2: mlp(w1, w2, x)[0], argnums=(0, 1))(w1, w2)


def test_column_and_row_parallel_forward_gives_the_same_bits_at_every_degree():
    outs = [megatron(m) for m in DEGREES]
    for out in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outs[0], out, strict=True))
    np.testing.assert_allclose(outs[0][1], mlp(W1, W2, X)[1], rtol=1e-5, atol=1e-5)


def test_the_backward_pass_gives_the_same_bits_at_every_degree():
    def run(m):
        mesh = gmesh(m)
        specs = (P(None, "model"), P("model", None), P())
        f = rewrite.program(grads, mesh, (W1, W2, X), specs, (P(None, "model"), P("model", None)))
        args = [
            jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((W1, W2, X), specs, strict=True)
        ]
        return [np.asarray(g) for g in f(*args)]

    outs = [run(m) for m in DEGREES]
    for out in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outs[0], out, strict=True))
    assert rel_l2(outs[0], list(grads(W1, W2, X))) < 1e-5


def test_xla_spmd_partitioning_of_the_same_function_depends_on_the_degree():
    # The negative control: the same contraction left to XLA (partial dots and an
    # all-reduce over the model axis) gives other bits at another degree.
    outs = []
    for m in DEGREES:
        mesh = gmesh(m)
        w2 = jax.device_put(W2, NamedSharding(mesh, P("model", None)))
        h = jax.device_put(jax.nn.gelu(X @ W1), NamedSharding(mesh, P(None, "model")))
        outs.append(np.asarray(jax.jit(lambda h, w: h @ w)(h, w2)))
    assert not all(np.array_equal(outs[0], o) for o in outs[1:])


def test_a_degree_that_does_not_divide_the_blocks_is_refused():
    mesh = gmesh(4)
    with pytest.raises(
        rewrite.BlockError,
        match=r"size 64 .* \(4 devices\) has 2 canonical.* Fix: a degree of at most 2",
    ):
        rewrite.program(lambda x: (jnp.sum(x),), mesh, (X,), (P(None, "model"),), (P(),), blocks=2)


def test_an_op_it_cannot_split_runs_on_whole_operands_with_the_same_bits():
    def cumulative(x):  # a cumsum along the split dimension: gathered, whole
        return (jnp.sum(jnp.cumsum(x, axis=1) * x),)

    outs = []
    for m in DEGREES:
        mesh = gmesh(m)
        run = rewrite.program(cumulative, mesh, (X,), (P(None, "model"),), (P(),))
        outs.append(np.asarray(run(jax.device_put(X, NamedSharding(mesh, P(None, "model"))))[0]))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    np.testing.assert_allclose(outs[0], cumulative(X)[0], rtol=1e-5)
    with pytest.raises(rewrite.Unsupported, match="cumsum"):
        rewrite.program(
            cumulative, gmesh(2), (X,), (P(None, "model"),), (P(),), gather_unsupported=False
        )


def test_scan_and_remat_bodies_are_rewritten_too():
    def layers(w1, w2, x):
        @jax.checkpoint
        def layer(h, _):
            return jax.nn.gelu(h @ w1) @ w2 + h, None

        h, _ = jax.lax.scan(layer, x, None, length=3)
        return (jnp.sum(h**2),)

    def run(m):
        mesh = gmesh(m)
        specs = (P(None, "model"), P("model", None), P())
        f = rewrite.program(layers, mesh, (W1, W2, X), specs, (P(),), gather_unsupported=False)
        args = [
            jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((W1, W2, X), specs, strict=True)
        ]
        return np.asarray(f(*args)[0])

    outs = [run(m) for m in DEGREES]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    np.testing.assert_allclose(outs[0], layers(W1, W2, X)[0], rtol=1e-5)


def test_an_activation_annotation_names_the_split_of_a_sequence_axis():
    outs = []
    for m in DEGREES:
        mesh = gmesh(m, "seq")

        def attention_like(x, mesh=mesh):  # positions split over 'seq' by an annotation
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("seq", None)))
            return (jnp.sum(jnp.tanh(x.T @ x)),)

        f = rewrite.program(attention_like, mesh, (X,), (P(),), (P(),), gather_unsupported=False)
        outs.append(np.asarray(f(X)[0]))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_a_whole_dimensions_sum_adds_its_canonical_blocks_as_a_split_one_does():
    from unsplit._src.bitwise.blocked import rules

    eps = np.float32(2.0**-24)
    x = np.array([1, eps, eps, eps, -1, eps, eps, eps], np.float32)  # 4 blocks of 2
    blocks = [x[0] + x[1], x[2] + x[3], x[4] + x[5], x[6] + x[7]]
    canonical = (blocks[0] + blocks[1]) + (blocks[2] + blocks[3])
    assert float(rules.canonical_sum(jnp.asarray(x), (0,), 8)) == canonical
    assert float(rules.tree_reduce(jnp.asarray(x), (0,))) != canonical  # halves: another order
    rows = np.stack([x, 2 * x])  # one axis at a time, the innermost first
    np.testing.assert_array_equal(
        rules.canonical_sum(jnp.asarray(rows), (1,), 8), [canonical, 2 * canonical]
    )


def test_the_tree_reduce_is_a_fixed_order_of_adds():
    from unsplit._src.bitwise.blocked import rules

    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(rules.tree_reduce(x, (1,)), x.sum(1))
    np.testing.assert_array_equal(rules.tree_reduce(x, (0, 1)), x.sum())
