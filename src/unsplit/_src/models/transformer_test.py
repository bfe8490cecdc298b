"""Tests of the test transformer: unsplit's dropouts by default, padding invariance, baselines."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from unsplit import linen as ulinen
from unsplit import models

KEY = jax.random.key(0)
CONFIG = models.TransformerConfig(
    vocab=32, length=16, width=16, heads=2, layers=1, dropout=0.3, attention_dropout=0.3
)


def test_default_model_uses_unsplit_dropouts_and_the_baseline_flax_ones():
    model = models.Transformer(CONFIG)
    assert model.dropout_cls is ulinen.Dropout
    assert model.attention_fn is ulinen.dot_product_attention
    baseline = models.with_flax_dropout(model)
    assert baseline.dropout_cls is nn.Dropout
    assert baseline.attention_fn is nn.dot_product_attention
    params = models.init_params(model)
    assert jax.tree.structure(models.init_params(baseline)) == jax.tree.structure(params)
    tokens = jnp.arange(CONFIG.length) % CONFIG.vocab
    np.testing.assert_array_equal(
        model.apply({"params": params}, tokens, train=False),
        baseline.apply({"params": params}, tokens, train=False),
    )


def test_padding_an_example_to_twice_its_length_keeps_its_loss_and_gradients():
    """Residual and attention-weight dropout both on: the padded copy sees the same noise.

    The padding is masked out of the loss, and out of the real tokens' attention by
    the causal mask. With Flax's attention dropout (mask by flat index) the same
    check fails: that is the control.
    """
    model = models.Transformer(CONFIG)
    params = models.init_params(model)
    length = CONFIG.length // 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab, length + 1).astype(np.int32)
    short = {"inputs": tokens[:-1], "targets": tokens[1:], "mask": np.ones(length, np.float32)}
    junk = rng.integers(0, CONFIG.vocab, length).astype(np.int32)
    padded = {
        "inputs": np.concatenate([short["inputs"], junk]),
        "targets": np.concatenate([short["targets"], junk]),
        "mask": np.concatenate([short["mask"], np.zeros(length, np.float32)]),
    }

    def loss_and_grads(model, example, key=KEY):
        return jax.jit(jax.value_and_grad(models.mean_loss(model)))(params, example, key)

    loss_s, grads_s = loss_and_grads(model, short)
    loss_p, grads_p = loss_and_grads(model, padded)
    np.testing.assert_allclose(loss_p, loss_s, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads_p, grads_s
    )
    other, _ = loss_and_grads(model, short, jax.random.key(1))
    assert abs(float(other) - float(loss_s)) > 1e-3  # another key, other noise
    baseline = models.with_flax_dropout(model)
    assert (
        abs(float(loss_and_grads(baseline, padded)[0] - loss_and_grads(baseline, short)[0])) > 1e-4
    )
