"""A bitwise step's per-device memory and bytes sent, read from its compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
import unsplit.testing

WIDTH = 64  # params: 8 x 64 x 64 floats = 128 KiB


def mlp_loss(params, x, key):
    h = x
    for w in params["layers"]:
        h = jnp.tanh(h @ w)
    return jnp.mean(unsplit.dropout(key, h, 0.1) ** 2)


def problem(mesh, spec):
    layers = [jnp.eye(WIDTH) + 0.01 * i for i in range(8)]
    params = {"layers": [jax.device_put(w, NamedSharding(mesh, spec)) for w in layers]}
    x = jax.random.normal(jax.random.key(1), (64, WIDTH))
    return params, x, jax.random.key(2)


def fsdp_mesh():
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)


def test_its_parts_add_up_and_the_combine_sends_a_ring():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params, x, key = problem(mesh, P())
    step = unsplit.value_and_grad(mlp_loss, mesh=mesh, bitwise=True)
    cost = unsplit.testing.bitwise_cost(step, params, x, key)
    params_bytes = 8 * WIDTH * WIDTH * 4
    assert cost.params_bytes == params_bytes  # replicated: every device holds them whole
    assert params_bytes <= cost.flat_params_bytes < 1.1 * params_bytes
    assert cost.partial_sums_bytes >= params_bytes  # grads of the device's one chunk
    assert cost.memory_per_device == (
        cost.params_bytes + cost.flat_params_bytes + cost.partial_sums_bytes
        + cost.program_peak_bytes
    )  # fmt: skip
    assert cost.chunk_programs == 1  # 64 rows over 8 devices: one 8-row chunk each
    assert 1.0 <= cost.combine_vs_ring <= 1.1
    assert cost.chunk_collectives == 0
    assert cost.bytes_sent_per_device > 0


def test_fsdp_groups_hold_a_share_of_the_params():
    mesh = fsdp_mesh()
    params, x, key = problem(mesh, P("fsdp"))
    common = dict(mesh=mesh, batch_axes=("data", "fsdp"), bitwise=True)
    grouped = unsplit.value_and_grad(mlp_loss, chunk_axes="fsdp", **common)
    gathered = unsplit.value_and_grad(mlp_loss, **common)
    in_groups = unsplit.testing.bitwise_cost(grouped, params, x, key)
    whole = unsplit.testing.bitwise_cost(gathered, params, x, key)
    assert in_groups.params_bytes == whole.params_bytes == 8 * WIDTH * WIDTH * 4 // 4
    # Gathered whole on every device without chunk_axes; a quarter (the group of 4) with.
    assert whole.flat_params_bytes >= 4 * in_groups.flat_params_bytes
    assert in_groups.memory_per_device < whole.memory_per_device
    assert in_groups.chunk_collectives > 0  # the group gathers its layers' shards


def test_the_first_call_compiles_and_later_calls_reuse_it():
    step = unsplit.value_and_grad(mlp_loss, bitwise=True)
    params = {"layers": [jnp.eye(WIDTH)]}
    x, key = np.ones((16, WIDTH), np.float32), jax.random.key(0)
    first = unsplit.testing.bitwise_cost(step, params, x, key)  # runs the step once
    engine_state, _ = step._engine.prepare(params, x, key)
    compiled = dict(engine_state.executables)
    assert compiled
    assert unsplit.testing.bitwise_cost(step, params, x, key) == first
    assert engine_state.executables == compiled


def test_group_size_is_read_from_the_grouped_batch():
    # 32 rows in pairs are 16 examples: the chunks (8 examples each) are of pairs.
    params = {"layers": [jnp.eye(WIDTH)]}
    x, key = np.ones((32, WIDTH), np.float32), jax.random.key(0)
    pairs = unsplit.value_and_grad(mlp_loss, bitwise=True, group_size=2, chunk_size=8)
    rows = unsplit.value_and_grad(mlp_loss, bitwise=True, chunk_size=8)
    assert unsplit.testing.bitwise_cost(pairs, params, x, key).chunk_programs == 2
    assert unsplit.testing.bitwise_cost(rows, params, x, key).chunk_programs == 4


def test_refuses_a_default_step_and_a_batch_loss_step():
    params, x, key = {"w": jnp.ones(4)}, jnp.ones((8, 4)), jax.random.key(0)
    default = unsplit.value_and_grad(lambda p, x, k: jnp.sum(p["w"] * x))
    with pytest.raises(TypeError, match=r"bitwise=True.*memory_analysis"):
        unsplit.testing.bitwise_cost(default, params, x, key)
    coupled = unsplit.value_and_grad(
        lambda p, x, k: p["w"] * x, batch_loss=lambda p, f: jnp.sum(f), bitwise=True
    )
    with pytest.raises(NotImplementedError, match=r"batch_loss"):
        unsplit.testing.bitwise_cost(coupled, params, x, key)


def test_the_canonical_tree_holds_log2_chunks_of_partial_sums():
    params = {"layers": [jnp.eye(WIDTH)]}
    x, key = np.ones((64, WIDTH), np.float32), jax.random.key(0)
    costs = {
        size: unsplit.testing.bitwise_cost(
            unsplit.value_and_grad(mlp_loss, bitwise=True, chunk_size=size), params, x, key
        )
        for size in (64, 8)
    }
    one_chunk = costs[64].partial_sums_bytes  # one chunk's packed sums: the grads and the loss
    assert one_chunk >= WIDTH * WIDTH * 4
    assert costs[8].chunk_programs == 8
    assert costs[8].partial_sums_bytes == 4 * one_chunk  # floor(log2 8) + 1, not 8
