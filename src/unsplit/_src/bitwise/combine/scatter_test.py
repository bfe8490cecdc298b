"""Grad sums left in the params' shards: the same bits as the all-gathered total's shards."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src.bitwise import plan as plan_lib
from unsplit._src.bitwise import reduce
from unsplit._src.bitwise.combine import pairwise, scatter
from unsplit._src.bitwise.combine import program as combine

pytestmark = pytest.mark.xdist_group("bitwise")
KEY = jax.random.key(3)
WIDTH, HIDDEN = 128, 512  # 65,536 elements per matrix: large leaves (a vector each)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def loss_fn(params, x, key):
    p = {k: v.astype(x.dtype) for k, v in params.items()}  # bf16 params computed in f32
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    h = unsplit.dropout(key, h, 0.1)
    return jnp.mean((h @ p["w2"] + p["b2"] - x) ** 2)


def _problem(mesh, specs, rows=32, dtype=np.float32):
    rng = np.random.default_rng(0)
    host = {
        "w1": rng.normal(size=(WIDTH, HIDDEN)).astype(np.float32) / np.sqrt(WIDTH),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(size=(HIDDEN, WIDTH)).astype(np.float32) / np.sqrt(HIDDEN),
        "b2": np.zeros(WIDTH, np.float32),
    }
    host = {k: v.astype(dtype) for k, v in host.items()}
    x = rng.normal(size=(rows, WIDTH)).astype(np.float32)
    if mesh is None:
        return host, x
    params = {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in host.items()}
    return params, jax.device_put(x, NamedSharding(mesh, P("data")))


def _runner(mesh, specs):
    params, x = _problem(mesh, specs)
    step = unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=True, chunk_size=4)
    out = step(params, x, KEY)
    (runner,) = step._engine._plans.values()
    return runner, params, out


FSDP = {"w1": P("data", None), "w2": P("data", None)}


@pytest.mark.parametrize("groups", [2, 4, 8, 16])
def test_bit_reversal_is_a_permutation_that_undoes_itself(groups):
    order = [scatter.bit_reversed(g, groups) for g in range(groups)]
    assert sorted(order) == list(range(groups))
    assert [scatter.bit_reversed(g, groups) for g in order] == list(range(groups))


def test_the_pairwise_pieces_put_in_order_are_each_groups_piece_of_the_tree():
    mesh = _mesh((8,), ("data",))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 8 * 32)).astype(np.float32)

    def pieces(put_in_order):
        def local(v):
            piece = pairwise.reduce_scatter(v, "data", 8)
            return scatter.in_order(piece, "data", 8) if put_in_order else piece

        program = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        data = jax.device_put(x.reshape(-1), NamedSharding(mesh, P("data")))
        return np.asarray(jax.jit(program)(data))

    total = reduce.combine({(g, 1): jnp.asarray(x[g]) for g in range(8)}, 8, pairwise.add)
    want = np.asarray(total)
    np.testing.assert_array_equal(pieces(True).view(np.uint32), want.view(np.uint32))
    # Negative control: as the reduce-scatters leave them, group 1 holds piece 4.
    assert not np.array_equal(pieces(False), want)


@pytest.mark.parametrize(
    ("shape", "names"), [((8,), ("data",)), ((4, 2), ("data", "model")), ((2,), ("data",))]
)
def test_fsdp_grads_come_out_of_the_reduce_scatter_in_their_shards(shape, names):
    mesh = _mesh(shape, names)
    runner, params, got = _runner(mesh, FSDP)
    which = scatter.layouts(runner.plan)
    flat = runner.plan.sums_flat
    by_name = {name: which[flat.slots[i][0]] for i, name in enumerate(sorted(params))}
    assert by_name == {"b1": "whole", "b2": "whole", "w1": "shard", "w2": "shard"}
    reference = unsplit.value_and_grad(loss_fn, bitwise=True, chunk_size=4)(
        *_problem(None, {}), KEY
    )
    assert unsplit.testing.bits_equal(got, reference)
    for name, grad in got[1].items():
        assert grad.sharding.is_equivalent_to(params[name].sharding, grad.ndim), name


def _largest_all_gather(compiled) -> int:
    sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"f32\[([\d,]*)\][^\n]*? all-gather(?:-start)?\(", compiled)
    ]
    return max(sizes, default=0)


def test_the_fsdp_step_never_all_gathers_a_scattered_total():
    mesh = _mesh((8,), ("data",))
    fsdp, _, _ = _runner(mesh, FSDP)
    replicated, _, _ = _runner(mesh, {})
    slots = fsdp.combine_slots()
    assert _largest_all_gather(fsdp.fused.lower(*slots).compile().as_text()) < WIDTH * HIDDEN
    # Negative control: replicated params need the whole total on every device.
    text = replicated.fused.lower(*replicated.combine_slots()).compile().as_text()
    assert _largest_all_gather(text) == WIDTH * HIDDEN


def test_only_leaves_split_over_exactly_the_groups_axes_are_scattered(monkeypatch):
    mesh = _mesh((4, 2), ("data", "model"))
    # Replicated or split over the model axis: all-gathered.
    for specs in ({}, {"w1": P(None, "model"), "w2": P("model", None)}):
        runner, _, _ = _runner(mesh, specs)
        assert scatter.SHARD not in scatter.layouts(runner.plan)
    monkeypatch.setattr(plan_lib, "_DIRECT_ELEMENTS", 1 << 30)  # no leaf alone: none
    runner, _, _ = _runner(mesh, FSDP)
    assert set(scatter.layouts(runner.plan)) == {scatter.WHOLE}


@pytest.mark.parametrize(
    ("data", "rows", "chunk", "spec", "dtype"),
    [(8, 32, 4, P(), np.float32), (8, 32, 4, P(), jnp.bfloat16), (2, 32, 4, P(), np.float32),
     (8, 32, 4, P("data", None), jnp.bfloat16),
     # 3 chunks per group: two blocks each, the general (all_to_all) combine
     (8, 48, 2, P(), np.float32), (8, 48, 2, P("data", None), np.float32)],
)  # fmt: skip
def test_large_totals_divided_as_pieces_then_gathered_give_one_devices_bits(
    data, rows, chunk, spec, dtype
):
    """The division (and the cast to the params' dtype) runs on each group's piece before
    the all-gather, by pairs and by the general path; an FSDP leaf's piece is its grad."""
    mesh = _mesh((data,), ("data",))
    params, x = _problem(mesh, {"w1": spec, "w2": spec}, rows=rows, dtype=dtype)
    step = unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=True, chunk_size=chunk)
    got = step(params, x, KEY)
    (runner,) = step._engine._plans.values()
    plan = runner.plan
    kinds = {scatter.layouts(plan)[plan.sums_flat.slots[i][0]] for i in (2, 3)}
    assert kinds == {scatter.SHARD if spec != P() else scatter.PIECE}
    assert combine._pairwise(plan) == (rows == 32)
    host, hx = _problem(None, {}, rows=rows, dtype=dtype)
    reference = unsplit.value_and_grad(loss_fn, bitwise=True, chunk_size=chunk)(host, hx, KEY)
    assert unsplit.testing.bits_equal(got, reference)
    assert got[1]["w1"].dtype == jnp.dtype(dtype)
    assert got[1]["w1"].sharding.is_equivalent_to(params["w1"].sharding, 2)


def test_a_piece_is_divided_with_its_zeros_written_plus_zero():
    # As the unpack writes every total's: the paths' totals may differ in zeros' signs alone.
    piece = jnp.array([-0.0, 0.0, -3.0, 5.0], jnp.float32)
    out = np.asarray(jax.jit(scatter.divided, static_argnums=2)(piece, jnp.float32(2), jnp.float32))
    np.testing.assert_array_equal(out, [0.0, 0.0, -1.5, 2.5])
    assert not np.signbit(out[:2]).any()
