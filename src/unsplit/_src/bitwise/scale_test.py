"""The model-scale formulas agree with what a bitwise step allocates (read by bitwise_cost)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
import unsplit.testing
from unsplit._src.bitwise import scale

SPECS = {"w1": P("fsdp", "model"), "w2": P("model", "fsdp")}


def _loss(p, example, key):
    x = jax.lax.with_sharding_constraint(example["x"], P("seq", None))  # positions over seq
    return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


@pytest.mark.filterwarnings(
    "ignore::unsplit._src.bitwise.schedule.GroupSizeWarning"
)  # 1 row per device
@pytest.mark.parametrize("sizes", [(1, 2, 2, 2), (2, 2, 1, 2)], ids=["seq2", "data2"])
def test_the_formulas_match_bitwise_cost(sizes):
    layout = scale.Layout(*sizes)
    mesh = jax.make_mesh(sizes, ("data", "fsdp", "seq", "model"), axis_types=(AxisType.Auto,) * 4)
    rng = np.random.default_rng(0)
    host = {"w1": rng.normal(size=(16, 32)), "w2": rng.normal(size=(32, 16))}
    params = {
        k: jax.device_put(v.astype(np.float32), NamedSharding(mesh, SPECS[k]))
        for k, v in host.items()
    }
    batch = {"x": rng.normal(size=(16, 8, 16)).astype(np.float32)}
    step = unsplit.value_and_grad(
        _loss, mesh=mesh, bitwise=True, batch_axes=("data", "fsdp"), chunk_axes="fsdp",
        chunk_size=2,
    )  # fmt: skip
    with jax.set_mesh(mesh):
        cost = unsplit.testing.bitwise_cost(step, params, batch, jax.random.key(0))
    count = sum(v.size for v in host.values())
    expected = scale.bitwise_step(count, layout, chunks=16 // 2)
    assert cost.params_bytes == expected["params"]
    assert cost.flat_params_bytes == expected["params"]
    # The chunk programs take the params gathered whole over fsdp (sharded over model).
    assert cost.program_peak_bytes >= expected["gathered"]
    peak = max(expected["gathered"], 3 * expected["params"])
    held = expected["step"] - 2 * expected["params"] - peak
    # The sums carry the loss and weight too (8 bytes per chunk sum).
    assert held <= cost.partial_sums_bytes <= held * 1.02


def test_the_docs_table_is_the_formulas_output():
    import pathlib

    page = pathlib.Path(__file__).resolve().parents[4] / "docs" / "bitwise.md"
    assert scale.table() in page.read_text()
