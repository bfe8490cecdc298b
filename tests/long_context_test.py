"""Long context: a small causal model with unsplit.ring_attention over "seq" (the models
guide's), in both modes: the loss and grads of dense attention on one device, the bits of
bitwise mode across data degree and microbatches at one sequence degree."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import unsplit

L, W, HEADS = 64, 32, 4
KEY = jax.random.key(0)


def _params():
    rng = np.random.default_rng(0)
    return {
        "pos": rng.normal(0, 0.02, (L, W)).astype(np.float32),
        **{n: rng.normal(0, W**-0.5, (W, W)).astype(np.float32) for n in ("q", "k", "v", "o", "out")},
    }  # fmt: skip


def _batch():
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(8, L, W)).astype(np.float32),
        "y": rng.normal(size=(8, L, W)).astype(np.float32),
    }


def _loss(mesh):
    """The guide's model; ``mesh=None``: dense attention (the Flax drop-in) on one device."""
    heads = None if mesh is None else P("seq", None, None)
    rows = None if mesh is None else P("seq", None)
    ring = functools.partial(
        unsplit.ring_attention, mesh=mesh, axis_name="seq", is_causal=True, block_size=8
    )
    causal = jnp.tril(jnp.ones((L, L), bool))

    def loss(p, example, key):
        attn_key, residual_key = jax.random.split(key)
        x = example["x"] if mesh is None else jax.sharding.reshard(example["x"], rows)
        x = x + p["pos"]
        q, k, v = (jnp.reshape(x @ p[n], (L, HEADS, W // HEADS), out_sharding=heads) for n in "qkv")
        if mesh is None:
            h = unsplit.linen.dot_product_attention(
                q, k, v, mask=causal, dropout_rng=attn_key, dropout_rate=0.1
            )
        else:
            h = ring(q, k, v, dropout_rng=attn_key, dropout_rate=0.1)
        h = jnp.reshape(h, (L, W), out_sharding=rows) @ p["o"]
        x = x + unsplit.dropout(residual_key, jnp.tanh(h), 0.1)
        return jnp.mean((x @ p["out"] - example["y"]) ** 2)

    return loss


def _run(data, seq, bitwise, microbatches=1):
    mesh = jax.make_mesh((data, seq), ("data", "seq"), devices=jax.devices()[: data * seq])
    options = {"chunk_size": 2} if bitwise else {}
    step = unsplit.value_and_grad(
        _loss(mesh), mesh=mesh, bitwise=bitwise, microbatches=microbatches, **options
    )
    with jax.set_mesh(mesh):
        return jax.device_get(step(_params(), _batch(), KEY))


@pytest.mark.parametrize("seq", [1, 2, 4])
@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
def test_the_ring_model_gives_dense_attentions_loss_and_grads(seq, bitwise):
    dense = jax.device_get(unsplit.value_and_grad(_loss(None))(_params(), _batch(), KEY))
    if bitwise and seq == 1:  # a ring of one device stays at degree 1 (said once)
        with pytest.warns(UserWarning, match="own shard_map runs over"):
            out = _run(2, seq, bitwise)
    else:
        out = _run(2, seq, bitwise)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(dense), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bitwise_bits_across_sequence_degrees_with_the_ring():
    # The ring's pieces merged in a fixed tree, the rest of the model in canonical blocks.
    ref = _run(1, 2, bitwise=True)
    assert unsplit.testing.bits_equal(_run(1, 4, bitwise=True), ref)
    assert unsplit.testing.bits_equal(_run(2, 4, bitwise=True), ref)


def test_bitwise_bits_across_data_degree_and_microbatches_at_one_sequence_degree():
    ref = _run(1, 4, bitwise=True)
    assert unsplit.testing.bits_equal(_run(2, 4, bitwise=True), ref)
    assert unsplit.testing.bits_equal(_run(2, 4, bitwise=True, microbatches=2), ref)
