"""A grouped optimizer update whose sums across an FSDP group are unsplit's, in a fixed order."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src.bitwise.blocked import rewrite
from unsplit._src.bitwise.fsdp import fixed_order_update
from unsplit._src.bitwise.update import FixedOrderFallback, GroupedUpdate

# optax mixes floats and int32; the update compiled as users get it (XLA's default level,
# products rounded: canonical_dots.cpu_options), not at the suite's level 0.
pytestmark = pytest.mark.usefixtures("standard_promotion", "users_chunk_level")

KEYS = jax.random.split(jax.random.key(3), 6)
PARAMS = {
    "w1": jax.random.normal(KEYS[0], (16, 32)),
    "b": jax.random.normal(KEYS[1], (32,)),
    "w2": jax.random.normal(KEYS[2], (32, 8)),
}
GRADS = {k: jax.random.normal(KEYS[3 + i], v.shape) for i, (k, v) in enumerate(PARAMS.items())}
OPTIMIZERS = {
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),  # factored
}


def mesh_of(data, size=4):
    devices = np.array(jax.devices()[: data * size]).reshape(data, size)
    return Mesh(devices, ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)


def fsdp(tree, mesh):
    """Every leaf split over ``fsdp`` along its first dimension where it divides (as the
    optimizer state of FSDP params is), others replicated."""

    def put(x):  # two rows or more per device: a block of one is refused (values.block_count)
        split = np.ndim(x) and np.shape(x)[0] % (2 * mesh.shape["fsdp"]) == 0
        return jax.device_put(x, NamedSharding(mesh, P("fsdp") if split else P()))

    return jax.tree.map(put, tree)


def updater(tx, traces=None):
    def update(params, opt_state, grads):
        if traces is not None:  # a trace of the update (the first call's, for each group)
            traces.append(1)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def run(name, data, size=4):
    mesh = mesh_of(data, size)
    tx = OPTIMIZERS[name]()
    update = GroupedUpdate(updater(tx), mesh, outputs=2, axes=("fsdp",))
    params, opt_state = update(fsdp(PARAMS, mesh), fsdp(tx.init(PARAMS), mesh), fsdp(GRADS, mesh))
    assert update.fallback is None
    return update, jax.device_get((params, opt_state))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_update_has_the_same_bits_for_groups_of_2_4_and_8_devices(name):
    # Every sum over an FSDP-split dimension is one of canonical blocks, whatever the
    # group's size (each leaf's first dimension, 16 or 32, has 8 of them).
    two, four, eight = (run(name, 8 // size, size)[1] for size in (2, 4, 8))
    assert unsplit.testing.bits_equal(two, four)
    assert unsplit.testing.bits_equal(two, eight)


def test_a_sum_over_a_leaf_held_whole_in_one_group_and_split_in_others_has_one_order():
    # A group of 8 holds an 8-element leaf whole (one element per device is refused), groups
    # of 2 and 4 hold it split: its sum is the canonical blocks' tree in all three. Found
    # with Adafactor (its 8-element factor's mean), whose w2 update differed in 7 elements.
    eps = 2.0**-24
    v = np.array([1, eps, eps, eps, -1, eps, eps, eps], np.float32)
    adjacent = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
    halves = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
    assert adjacent != halves  # the data tells the two orders apart

    def update(params, opt_state, grads):
        return {"v": params["v"] - jnp.sum(grads["v"])}, opt_state

    sums = []
    for size in (2, 4, 8):
        mesh = mesh_of(8 // size, size)
        grouped = GroupedUpdate(update, mesh, outputs=2, axes=("fsdp",))
        zero = {"v": np.zeros(8, np.float32)}
        params, _ = grouped(fsdp(zero, mesh), fsdp({"n": np.zeros(())}, mesh), fsdp({"v": v}, mesh))
        assert grouped.fallback is None
        sums.append(-np.asarray(params["v"]))
    for got in sums:
        np.testing.assert_array_equal(got, np.full(8, adjacent, np.float32))


def test_the_update_holds_no_all_reduce_and_xlas_does():
    update, _ = run("clip+adamw", 2)
    program = next(iter(update._programs.values()))  # every group's, in one program
    tx = OPTIMIZERS["clip+adamw"]()
    args = fsdp((PARAMS, tx.init(PARAMS), GRADS), update.mesh)
    hlo = program.lower(*args).compile().as_text()
    assert "all-gather" in hlo or "collective-permute" in hlo  # partials moved, then added
    assert "all-reduce" not in hlo and "reduce-scatter" not in hlo
    # Negative control: the same update as XLA partitions it adds the norm's partials by an
    # all-reduce (in the collectives' order).
    xla = jax.jit(updater(tx), out_shardings=jax.tree.map(lambda x: x.sharding, args[:2]))
    assert "all-reduce" in xla.lower(*args).compile().as_text()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_update_is_optax_on_whole_arrays_with_the_same_bits_on_every_data_degree(name):
    tx = OPTIMIZERS[name]()
    expected = jax.jit(updater(tx))(PARAMS, tx.init(PARAMS), GRADS)
    _, two = run(name, 2)
    for got, want in zip(jax.tree.leaves(two), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert unsplit.testing.bits_equal(run(name, 1)[1], two)  # the same group size: same bits
    if name == "clip+adamw":  # the clip clipped: the norm of the grads is far above 0.1
        assert float(optax.tree.norm(GRADS)) > 10


def test_a_second_call_runs_the_compiled_programs(monkeypatch):
    traces, evaluations = [], []
    run_jaxpr = rewrite.Rewrite.run

    def counted(self, *args):
        evaluations.append(1)
        return run_jaxpr(self, *args)

    monkeypatch.setattr(rewrite.Rewrite, "run", counted)
    mesh, tx = mesh_of(2), OPTIMIZERS["clip+adamw"]()
    update = GroupedUpdate(updater(tx, traces), mesh, outputs=2, axes=("fsdp",))
    state = fsdp(PARAMS, mesh), fsdp(tx.init(PARAMS), mesh)
    once = update(*state, fsdp(GRADS, mesh))
    counts = len(traces), len(evaluations)
    assert counts[0] == 1 and counts[1] >= 1  # traced on the first call: one program, both groups
    twice = update(*once, fsdp(GRADS, mesh))
    assert (len(traces), len(evaluations)) == counts  # the second call traced nothing
    assert not unsplit.testing.bits_equal(jax.device_get(once), jax.device_get(twice))


def test_an_update_the_rewrite_cannot_run_falls_back_to_xla_with_a_warning():
    # A cumulative sum along the split dimension: not elementwise, not a reduction.
    mesh = mesh_of(2)
    w = jax.random.normal(KEYS[0], (16, 4))
    update = GroupedUpdate(lambda w: (w - jnp.cumsum(w, axis=0),), mesh, outputs=1, axes=("fsdp",))
    with pytest.warns(FixedOrderFallback, match=r"cumsum on a split dimension.*Fix"):
        (got,) = update(fsdp(w, mesh))
    assert "cumsum" in update.fallback
    np.testing.assert_allclose(got, w - jnp.cumsum(w, axis=0), rtol=1e-6)
    assert got.sharding.spec == P("fsdp")


def group(fn, *arrays, specs):
    gmesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
    args = [jax.device_put(x, NamedSharding(gmesh, s)) for x, s in zip(arrays, specs, strict=True)]
    return fixed_order_update.program(lambda *a: (fn(*a),), gmesh, args, specs, (specs[0],))(*args)[
        0
    ]


X = jax.random.normal(KEYS[4], (16, 8))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: x * jnp.vdot(x, y),  # ravel (a reshape keeping blocks) + a contraction
        lambda x, y: x @ (y.T @ x)[:, :8].T @ jnp.eye(8),  # dots contracting the split dim
        lambda x, y: x / jnp.max(jnp.abs(y)) + jnp.min(y, axis=0)[None],  # pmax / pmin
        lambda x, y: jnp.where(jnp.all(y < 9) & jnp.any(y > 2), x, -x),  # reduce_and / _or
        lambda x, y: x.reshape(32, 4).reshape(16, 8) + jnp.mean(y.T, axis=1)[None, :],
        lambda x, y: jax.lax.cond(jnp.sum(y) > 0, lambda a: a * 2, jnp.zeros_like, x),
        lambda x, y: jax.lax.while_loop(lambda a: jnp.sum(a * a) > 1, lambda a: a / 2, x + y),
        lambda x, y: (x @ x.T) @ y / 64,  # two free dims over one axis: one side gathered
    ],
)
def test_rewritten_equations_give_the_whole_arrays_values(fn):
    y = jax.random.normal(KEYS[5], X.shape)
    got = group(fn, X, y, specs=(P("fsdp"), P("fsdp")))
    np.testing.assert_allclose(got, jax.jit(fn)(X, y), rtol=1e-5, atol=1e-6)
    again = group(fn, X, y, specs=(P("fsdp"), P()))  # a replicated operand sliced to blocks
    np.testing.assert_allclose(again, got, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "fn,what",
    [
        (lambda x: x.reshape(128)[None] + 0, "reshape"),  # dim 1 split: its blocks mix
        (lambda x: jnp.sort(x, axis=0), "sort"),
        (lambda x: x[1:] + 0, "slice"),
    ],
)
def test_equations_that_mix_a_split_dimension_are_refused(fn, what):
    with pytest.raises(fixed_order_update.Unsupported, match=what):
        group(fn, X, specs=(P(None, "fsdp"),) if what == "reshape" else (P("fsdp"),))
