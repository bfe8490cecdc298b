"""A bitwise step's bits at every tensor-parallel degree: the canonical-block chunk program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import unsplit
from unsplit._src import test_util as tu
from unsplit._src.bitwise.blocked import chunk
from unsplit._src.models import transformer as tf

# The bits across model-parallel degrees at XLA's default level, as users compile them.
pytestmark = pytest.mark.usefixtures("users_chunk_level")

CONFIG = tf.TransformerConfig(vocab=32, length=8, width=32, heads=16, layers=1)
MODEL = tf.Transformer(CONFIG)
PARAMS = tf.init_params(MODEL)
BATCH = jax.tree.map(np.asarray, tf.synthetic_batch(CONFIG, 32, seed=1))
LOSS = tf.token_loss(MODEL)
KEY = jax.random.key(7)
LAYOUTS = [(8, 1), (4, 2), (2, 4), (1, 8)]  # (data, model): model degrees 1, 2, 4, 8


def step_at(data, model, microbatches=1, specs=tu.megatron_specs, config=CONFIG):
    mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    model_ = tf.Transformer(config)
    params = tf.init_params(model_) if config != CONFIG else PARAMS
    params = tu.replicated(params, mesh, specs(params))
    step = unsplit.value_and_grad(
        LOSS if config == CONFIG else tf.token_loss(model_), weighted=True, mesh=mesh, microbatches=microbatches,
        bitwise=unsplit.Bitwise(chunk_size=4),
    )  # fmt: skip
    return step(params, BATCH, KEY)


@pytest.fixture(scope="module")
def reference():
    return step_at(4, 2)


@pytest.mark.parametrize(
    ("data", "model", "microbatches"), [(*lay, 1) for lay in LAYOUTS] + [(2, 4, 2)]
)
def test_megatron_bits_are_the_same_at_every_model_degree(reference, data, model, microbatches):
    assert tu.bits_equal(step_at(data, model, microbatches), reference)


def test_every_matrix_split_over_the_model_axis_too():
    # A stress layout (every matrix's last dimension split): the bits at degrees 2 and 4 agree.
    config = tf.TransformerConfig(vocab=32, length=8, width=32, heads=4, layers=1)
    two, four = (
        step_at(d, m, specs=tu.tensor_parallel_specs, config=config) for d, m in [(4, 2), (2, 4)]
    )
    assert tu.bits_equal(two, four)


def test_close_to_default_mode(reference):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = tu.replicated(PARAMS, mesh, tu.megatron_specs(PARAMS))
    default = unsplit.value_and_grad(LOSS, weighted=True, mesh=mesh)(params, BATCH, KEY)
    assert tu.rel_l2(reference, default) < 1e-5


def test_xla_partitioning_gives_other_bits_at_another_degree(monkeypatch):
    # The negative control: the group's program left to XLA's SPMD partitioner.
    monkeypatch.setattr(chunk, "ENABLED", False)
    two, eight = step_at(4, 2), step_at(1, 8)
    assert not tu.bits_equal(two, eight)
    assert tu.rel_l2(two, eight) < 1e-5


def sequence_loss(p, example, key):
    """Attention over one example whose positions are split over ``seq`` (an annotation)."""
    x = jax.sharding.reshard(example, jax.P("seq", None))
    k = jax.sharding.reshard(x @ p["k"], jax.P())
    h = jax.nn.softmax((x @ p["q"]) @ k.T, axis=-1) @ k
    return jnp.mean(unsplit.dropout(key, jnp.tanh(h @ p["o"]), 0.25) ** 2)


def sequence_step(seq):
    mesh = jax.make_mesh((8 // seq, seq), ("data", "seq"))
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=(16, 16)).astype(np.float32) / 4 for k in ("q", "k", "o")}
    batch = rng.normal(size=(16, 32, 16)).astype(np.float32)
    step = unsplit.value_and_grad(sequence_loss, mesh=mesh, bitwise=unsplit.Bitwise(chunk_size=2))
    with jax.set_mesh(mesh):
        return jax.device_get(step(params, batch, KEY))


def test_sequence_degrees_agree_and_xla_partitioning_does_not(monkeypatch):
    assert tu.bits_equal(sequence_step(2), sequence_step(4))
    monkeypatch.setattr(chunk, "ENABLED", False)  # the negative control
    two, four = sequence_step(2), sequence_step(4)
    assert not tu.bits_equal(two, four) and tu.rel_l2(two, four) < 1e-5
