"""Bytes sent per device, read from compiled HLO; bitwise mode's combine sends a ring's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.bitwise import traffic
from unsplit._src.models import transformer as tf

AUTO = (AxisType.Auto, AxisType.Auto)


def test_each_collective_is_counted_as_a_ring_sends_it():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO)
    n = 64  # floats per device

    def bytes_of(body, out_spec):
        fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=out_spec, check_vma=False)
        return traffic.bytes_sent(jax.jit(fn).lower(jnp.zeros(n)).compile())

    assert bytes_of(lambda x: jax.lax.psum(x, "data"), P()) == 2 * 3 / 4 * 4 * n
    assert bytes_of(lambda x: jax.lax.all_gather(x, "data", tiled=True), P()) == 3 / 4 * 4 * 4 * n
    scatter = bytes_of(lambda x: jax.lax.psum_scatter(x, ("data", "model"), tiled=True), P())
    assert scatter == 7 * 4 * n / 8
    to_all = bytes_of(lambda x: jax.lax.all_to_all(x.reshape(4, -1), "data", 0, 0), P())
    assert to_all == 3 / 4 * 4 * n
    ring = [(i, (i + 1) % 4) for i in range(4)]
    assert bytes_of(lambda x: jax.lax.ppermute(x, "data", ring), P()) == 4 * n
    assert bytes_of(lambda x: x * 2, P()) == 0


def test_async_collectives_are_counted_once():
    text = (
        "HloModule m, num_partitions=4\n"
        "%s = (f32[8]{0}, f32[32]{0}) all-gather-start(%p), replica_groups=[1,4]<=[4]\n"
        "%d = f32[32]{0} all-gather-done(%s)\n"
        "%r = f32[16]{0} all-reduce(%q), replica_groups={}\n"
    )
    assert traffic.bytes_sent(text) == 3 / 4 * 128 + 2 * 3 / 4 * 64


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_the_combine_sends_at_most_a_ring_all_reduce_of_the_sums(devices):
    # Issue 20.3: a fixed-order reduce-scatter and an all-gather, 2 (G - 1) / G of the sums
    # per device; recursive doubling sent log2(G) whole vectors (1.71x a ring's at G = 8).
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
    model, params, batch = testing.problem(batch=8 * devices)
    step = unsplit.value_and_grad(tf.token_loss(model), weighted=True, mesh=mesh, bitwise=True)
    step(params, batch, jax.random.key(0))
    (state,) = step._engine._plans.values()
    sums = sum(
        n * np.dtype(d).itemsize
        for n, d in zip(state.plan.sums_flat.lengths, state.plan.sums_flat.vectors, strict=True)
    )
    ring = 2 * (devices - 1) / devices * sums
    sent = traffic.bytes_sent(state.combine_compiled())
    assert ring <= sent <= 1.1 * ring
    assert "all-reduce" not in state.combine_compiled().as_text()


def test_the_public_name():
    assert unsplit.testing.bytes_sent is traffic.bytes_sent
