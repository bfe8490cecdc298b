"""Reduce-scatters of two devices: the canonical tree's bits, checked before they are used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src.bitwise import reduce
from unsplit._src.bitwise.combine import pairwise
from unsplit._src.bitwise.combine import program as combine


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _values(devices, size, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(devices, size)).astype(np.float32) * 10.0 ** rng.integers(-3, 4, size)
    x[:, :16] = np.float32(0.0)  # +0: a collective may add -0 + -0 into +0 (a zero buffer)
    return x


def _tree(rows):
    return reduce.combine({(g, 1): rows[g] for g in range(len(rows))}, len(rows), jnp.add)


@pytest.mark.parametrize(
    ("shape", "names", "leading"),
    [((2,), ("data",), 1), ((4, 2), ("data", "model"), 1), ((8,), ("data",), 1),
     ((2, 4), ("proc", "data"), 2)],
)  # fmt: skip
def test_reduce_scatter_then_all_gather_is_the_canonical_tree(shape, names, leading):
    mesh = _mesh(shape, names)
    groups = int(np.prod(shape[:leading]))
    per_group = int(np.prod(shape[leading:]))
    size = 8 * 64
    x = _values(groups * per_group, size).reshape(groups, per_group, size)
    axes = names[:leading] if leading > 1 else names[0]
    every = P(names)
    program = jax.jit(
        jax.shard_map(
            lambda v: pairwise.all_gather(pairwise.reduce_scatter(v, axes, groups), axes, groups),
            mesh=mesh, in_specs=every, out_specs=every, check_vma=False,
        )
    )  # fmt: skip
    got = np.asarray(program(jax.device_put(x.reshape(-1), NamedSharding(mesh, every))))
    got = got.reshape(groups, per_group, size)
    for j in range(per_group):  # each model shard: its own groups' tree
        want = np.asarray(jax.jit(_tree)([jnp.asarray(x[g, j]) for g in range(groups)]))
        for g in range(groups):
            np.testing.assert_array_equal(got[g, j].view(np.uint32), want.view(np.uint32))
    assert pairwise.exact(mesh, leading, np.float32)


def test_a_psum_of_the_same_rows_is_not_the_canonical_tree():
    """Negative control: XLA's reduce-scatter over all eight devices adds in its own order."""
    mesh = _mesh((8,), ("data",))
    x = _values(8, 8 * 4096, seed=1)
    program = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.all_gather(jax.lax.psum_scatter(v, "data", tiled=True), "data",
                                         tiled=True),
            mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False,
        )
    )  # fmt: skip
    got = np.asarray(program(jax.device_put(x.reshape(-1), NamedSharding(mesh, P("data")))))
    want = np.asarray(jax.jit(_tree)([jnp.asarray(r) for r in x]))
    assert not np.array_equal(got.reshape(8, -1)[0].view(np.uint32), want.view(np.uint32))


def test_the_check_tells_another_tree_apart(monkeypatch):
    """Pairs in the mirrored order (distance 4 first): two-device adds, another tree."""
    mesh = _mesh((8,), ("data",))
    original = pairwise.pairs
    monkeypatch.setattr(pairwise, "pairs", lambda groups, level: original(groups, 2 - level))
    pairwise._verdict.cache_clear()
    try:
        assert not pairwise.exact(mesh, 1, np.float32)
    finally:
        pairwise._verdict.cache_clear()


def test_a_jax_without_pairs_of_devices_gets_the_general_path(monkeypatch):
    def refused(*args):
        raise NotImplementedError("axis_index_groups is not supported")

    monkeypatch.setattr(pairwise, "reduce_scatter", refused)
    pairwise._verdict.cache_clear()
    try:
        assert not pairwise.exact(_mesh((4,), ("data",)), 1, np.float32)
        assert any("axis_index_groups" in why for why in pairwise._REFUSED.values())
    finally:
        pairwise._verdict.cache_clear()
        pairwise._REFUSED.clear()


def test_no_pairwise_path_for_groups_that_are_no_power_of_two():
    assert [pairwise.levels(g) for g in (1, 2, 3, 4, 6, 8)] == [None, 1, None, 2, None, 3]
    assert not pairwise.exact(_mesh((6,), ("data",)), 1, np.float32)


def test_positive_zeros_changes_only_values_equal_to_zero():
    x = jnp.array([-0.0, 0.0, -1.5, 2.0, jnp.inf, -jnp.inf, -1e-40], jnp.float32)
    y, ints = jax.jit(pairwise.positive_zeros)([x, jnp.array([-3, 0, 4])])
    y = np.asarray(y)
    assert not np.signbit(y[0]) and not np.signbit(y[1])
    np.testing.assert_array_equal(y[2:6].view(np.uint32), np.asarray(x)[2:6].view(np.uint32))
    # a subnormal: +0 where the program flushes it (XLA:CPU), else itself
    assert y[6] == np.float32(-1e-40) or (y[6] == 0 and not np.signbit(y[6]))
    np.testing.assert_array_equal(np.asarray(ints), [-3, 0, 4])


def test_a_zeros_sign_never_changes_a_sum_that_is_not_zero():
    """Why the tree's adds leave zeros' signs as they come: paths that write -0 + -0
    differently (a collective into a zero buffer) give totals that differ in zeros alone,
    which the unpack writes +0."""
    x = jnp.array([1.5, -2.0, 3e-38, -3e-38, jnp.inf, -jnp.inf, 7.0], jnp.float32)
    add = jax.jit(pairwise.add)
    for zero in (0.0, -0.0):
        out = np.asarray(add(x, jnp.full_like(x, zero)))
        np.testing.assert_array_equal(out.view(np.uint32), np.asarray(x).view(np.uint32))
    # Zero sums keep a sign that depends on the operands: -0 + -0 is -0 here.
    zeros = np.asarray(add(jnp.array([-0.0, -0.0, 0.0]), jnp.array([-0.0, 0.0, -0.0])))
    assert list(np.signbit(zeros)) == [True, False, False]
    assert not np.signbit(np.asarray(jax.jit(pairwise.positive_zero)(zeros))).any()


def _loss(params, x, key):
    h = unsplit.dropout(key, jnp.tanh(x @ params["w"]), 0.25)
    # relu(-h) * 0 makes grads of exactly -0 in some elements: the signed zeros case
    return jnp.mean(h @ params["v"]) + jnp.mean(jax.nn.relu(-h) * 0.0 * params["b"])


@pytest.mark.parametrize("data", [2, 4, 8])
def test_a_step_by_pairs_gives_the_bits_of_the_general_combine_and_of_one_device(data, monkeypatch):
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(12, 16)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(16,)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(16, 12)), jnp.float32)
    key = jax.random.key(3)
    mesh = _mesh((data,), ("data",))
    used = []
    original = pairwise.reduce_scatter
    monkeypatch.setattr(
        pairwise, "reduce_scatter", lambda *a: used.append(1) or original(*a)
    )  # fmt: skip

    def step(**kw):  # a new loss function each time: its own programs
        return unsplit.value_and_grad(lambda *a: _loss(*a), bitwise=True, chunk_size=2, **kw)

    one = step()(params, x, key)
    by_pairs = step(mesh=mesh)(params, x, key)
    assert used, "the combine did not take the pairwise path"
    monkeypatch.setattr(combine, "_pairwise", lambda plan: False)
    general = step(mesh=mesh)(params, x, key)
    assert unsplit.testing.bits_equal(by_pairs, general)
    assert unsplit.testing.bits_equal(by_pairs, one)


@pytest.mark.parametrize("chunk_size", [16, 2])
def test_grads_of_exactly_minus_zero_come_out_plus_zero_at_every_chunk_count(chunk_size):
    """The chunk programs' sums enter the tree as computed and the unpack writes the total's
    zeros +0 (one chunk in all meets no add): the sign never depends on how many adds ran
    or which path ran them. Negative control: ``jax.grad`` gives these grads as -0."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(12, 3)), jnp.float32), "b": jnp.ones(16)}
    x = jnp.asarray(rng.normal(size=(16, 12)), jnp.float32)

    def loss(params, x, key):
        h = unsplit.dropout(key, x @ params["w"], 0.25)
        return jnp.mean(h) + jnp.sum(params["b"]) * jnp.float32(-0.0)  # d/db: -0

    _, grads = unsplit.value_and_grad(loss, bitwise=True, chunk_size=chunk_size)(
        params, x, jax.random.key(0)
    )
    assert np.all(np.asarray(grads["b"]) == 0) and not np.signbit(grads["b"]).any()
    plain = jax.grad(lambda p: loss(p, x[0], jax.random.key(0)))(params)
    assert np.signbit(plain["b"]).all()
