"""A loss that holds its own shard_map (a ring attention over "seq") runs in both modes.

The ring (test_util.toy_ring: a scan of ppermutes) is called the way ringattention's README
calls its own, ``shard_map(ring, mesh=mesh, in_specs=P(None, "seq", ...))`` inside the loss,
with and without sharding annotations elsewhere in the loss, on Auto and Explicit meshes;
compared with the same loss with a dense attention on one device.
"""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as tu
from unsplit._src.step import manual

KEY = jax.random.key(3)


def _mesh(data, seq, types=AxisType.Explicit):
    return jax.make_mesh(
        (data, seq), ("data", "seq"), axis_types=(types,) * 2, devices=jax.devices()[: data * seq]
    )


def _run(loss, mesh, bitwise, microbatches=1):
    options = {"chunk_size": 2} if bitwise else {}
    step = unsplit.value_and_grad(
        loss, mesh=mesh, bitwise=bitwise, microbatches=microbatches, **options
    )
    with jax.set_mesh(mesh):
        return jax.device_get(step(tu.ring_params(), tu.ring_batch(), KEY))


def _reference():
    loss = tu.ring_loss(tu.dense_attention, in_region=False)
    step = unsplit.value_and_grad(loss)
    return jax.device_get(step(tu.ring_params(), tu.ring_batch(), KEY))


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


CASES = [
    (AxisType.Auto, None),  # no annotation: bitwise mode failed in its CPU dot rewrite
    (AxisType.Auto, "wsc"),  # with a constraint: both modes failed ("unbound axis name")
    (AxisType.Explicit, "reshard"),
]


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
@pytest.mark.parametrize(("types", "constrain"), CASES, ids=["auto", "auto-wsc", "explicit"])
def test_a_loss_with_its_own_ring_runs_and_matches_dense_attention(types, constrain, bitwise):
    mesh = _mesh(2, 4, types)
    loss = tu.ring_loss(tu.toy_ring, mesh, constrain)
    _close(_run(loss, mesh, bitwise), _reference())


def test_bitwise_bits_hold_across_data_degree_and_microbatches_with_the_ring():
    def run(data, microbatches):
        mesh = _mesh(data, 2)
        loss = tu.ring_loss(tu.toy_ring, mesh, "reshard")
        return _run(loss, mesh, bitwise=True, microbatches=microbatches)

    ref = run(1, 1)
    assert unsplit.testing.bits_equal(run(2, 1), ref)
    assert unsplit.testing.bits_equal(run(2, 2), ref)


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
def test_a_ring_over_a_one_device_seq_axis_still_binds_its_axis(bitwise):
    # A size-1 axis no annotation would put in the group: its region's collectives name it.
    mesh = _mesh(4, 1)
    loss = tu.ring_loss(tu.toy_ring, mesh, "reshard")
    if not bitwise:
        _close(_run(loss, mesh, bitwise), _reference())
        return
    # Bitwise: a degree-1 region stays on the user's mesh (one device per group), said once.
    with pytest.warns(UserWarning, match=r"own shard_map runs over \('seq',\), all of one"):
        _close(_run(loss, mesh, bitwise), _reference())


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
def test_a_region_over_a_batch_axis_is_refused_naming_the_fix(bitwise):
    mesh = _mesh(2, 4, AxisType.Auto)

    def loss(p, example, key):
        region = jax.shard_map(
            lambda x: jax.lax.psum(x.sum(), "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
        return region(example["x"][0] @ p["q"])

    with pytest.raises(ValueError, match=r"shard_map uses mesh axes \['data'\].*Fix: shard_map"):
        _run(loss, mesh, bitwise)


def test_used_axes_are_those_its_specs_and_collectives_name():
    mesh = _mesh(2, 4, AxisType.Auto)
    closed = jax.make_jaxpr(
        jax.shard_map(
            lambda x: x * jax.lax.axis_index("seq").astype(x.dtype),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )
    )(np.ones(4, np.float32))
    (eqn,) = [e for e in closed.jaxpr.eqns if manual.is_region(e)]
    assert manual.manual_axes(eqn.params) == {"data", "seq"}  # the whole mesh is manual
    assert manual.used_axes(eqn.params) == {"seq"}  # but only "seq" is used
