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


def test_fsdp_grads_left_in_their_shards_send_half_a_ring(monkeypatch):
    from unsplit._src.bitwise import plan as plan_lib

    monkeypatch.setattr(plan_lib, "_DIRECT_ELEMENTS", WIDTH * WIDTH)  # every layer is large
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    costs = {}
    for name, spec in (("replicated", P()), ("fsdp", P("data", None))):
        params, x, key = problem(mesh, spec)
        step = unsplit.value_and_grad(mlp_loss, mesh=mesh, bitwise=True)
        costs[name] = unsplit.testing.bitwise_cost(step, params, x, key)
    assert 1.0 <= costs["replicated"].combine_vs_ring <= 1.1  # reduce-scatter + all-gather
    assert 0.5 <= costs["fsdp"].combine_vs_ring <= 0.6  # the reduce-scatter (and a permute)
    assert costs["fsdp"].program_peak_bytes < costs["replicated"].program_peak_bytes


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


# Frozen inputs (issue 40, items 1 and 2): bitwise_cost and lower take frozen=, and a
# frozen base is held once per device, as default mode's program holds it.
BASE, RANK = 256, 4


def lora_loss(lora, x, key, base):
    h = x @ base["w"] + (x @ lora["a"]) @ lora["b"]
    return jnp.mean(unsplit.dropout(key, jnp.tanh(h), 0.1) ** 2)


def lora_problem(base_spec):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=(BASE, BASE)).astype(np.float32) / 16}
    lora = {
        "a": rng.normal(size=(BASE, RANK)).astype(np.float32) / 16,
        "b": rng.normal(size=(RANK, BASE)).astype(np.float32) / 16,
    }
    x = rng.normal(size=(64, BASE)).astype(np.float32)
    return (
        mesh,
        jax.device_put(lora, NamedSharding(mesh, P())),
        jax.device_put(base, NamedSharding(mesh, base_spec)),
        jax.device_put(x, NamedSharding(mesh, P("data"))),
        jax.random.key(0),
    )


@pytest.mark.parametrize("base_spec", [P(), P("data", None)], ids=["replicated", "fsdp"])
def test_a_frozen_base_is_held_once_per_device(base_spec):
    mesh, lora, base, x, key = lora_problem(base_spec)
    bitwise = unsplit.value_and_grad(lora_loss, mesh=mesh, bitwise=True)
    default = unsplit.value_and_grad(lora_loss, mesh=mesh)
    cost = unsplit.testing.bitwise_cost(bitwise, lora, x, key, frozen=base)
    base_bytes, lora_bytes = BASE * BASE * 4, 2 * BASE * RANK * 4
    sharded = base_spec != P()
    assert cost.frozen_bytes == base_bytes // (8 if sharded else 1)
    # The flat params are the adapters; a sharded base is gathered whole once (the chunk
    # programs read it in place), a replicated one not copied at all.
    assert cost.flat_params_bytes == lora_bytes + (base_bytes if sharded else 0)
    analysis = default.lower(lora, x, key, frozen=base).compile().memory_analysis()
    default_bytes = sum(
        getattr(analysis, f"{n}_size_in_bytes") for n in ("argument", "output", "temp")
    )
    # Default mode's program holds the base once (gathered in its temp when sharded);
    # bitwise mode holds it once too, plus the adapters' sums and one chunk's activations.
    assert cost.memory_per_device < default_bytes + base_bytes // 4


def test_lower_in_bitwise_mode_reads_all_its_programs():
    mesh, lora, base, x, key = lora_problem(P())
    step = unsplit.value_and_grad(lora_loss, mesh=mesh, bitwise=True)
    compiled = step.lower(lora, x, key, frozen=base).compile()
    memory = compiled.memory_analysis()
    assert sum(memory) == compiled.cost.memory_per_device
    assert memory.argument_size_in_bytes == compiled.cost.params_bytes
    assert compiled.cost == unsplit.testing.bitwise_cost(step, lora, x, key, frozen=base)
    chunk_flops = 2 * 8 * BASE * BASE  # the base's matmul on one device's chunk of 8 rows
    assert compiled.cost_analysis()["flops"] >= chunk_flops
    assert "HloModule" in compiled.as_text() and "dot" in compiled.as_text()


def test_a_missing_frozen_is_refused_with_the_steps_message():
    mesh, lora, _, x, key = lora_problem(P())
    for bitwise in (False, True):
        step = unsplit.value_and_grad(lora_loss, mesh=mesh, bitwise=bitwise)
        with pytest.raises(TypeError, match=r"needs a frozen argument.*frozen=frozen"):
            step.lower(lora, x, key).compile()
    with pytest.raises(TypeError, match=r"needs a frozen argument.*frozen=frozen"):
        unsplit.testing.bitwise_cost(step, lora, x, key)  # the bitwise one
