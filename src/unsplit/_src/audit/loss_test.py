"""The per-example rules of loss.py: foreign keys (data-made, an nnx.Rngs held by a captured
module) and named-axis collectives (cross_example)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import unsplit

KEY = jax.random.key(0)
X = jnp.ones((8, 6, 4))  # a batch of 8 examples of shape (6, 4)
W = jnp.ones(4)


def test_a_key_from_the_examples_data_alone_is_foreign():
    def loss_fn(w, x, key):
        own = jax.random.key(jnp.sum(x).astype(jnp.int32))
        return jnp.sum(x @ w) + jnp.sum(jax.random.normal(own, (3,)))

    (finding,) = unsplit.audit(loss_fn, W, X, KEY)
    assert finding.kind == "foreign_key" and "made inside the loss" in finding.message


def test_nnx_module_captured_by_the_loss():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    net = Net(nnx.Rngs(0))

    def loss_fn(w, x, key):
        return jnp.sum(net(x) @ w)

    (finding,) = unsplit.audit(loss_fn, W, X, KEY)
    assert finding.kind == "foreign_key" and "nnx.Rngs" in finding.message
    assert finding.file == __file__


def test_batchnorm_over_a_named_axis_reads_other_examples():
    model = nn.BatchNorm(use_running_average=False, axis_name="batch")
    variables = model.init(jax.random.key(1), jnp.ones((6, 4)))

    def loss_fn(v, x, key):
        out, _ = model.apply(v, x, mutable=["batch_stats"])
        return jnp.sum(out)

    findings = unsplit.audit(loss_fn, variables, X, KEY)
    assert sorted(f.kind for f in findings) == ["cross_example", "dropped_state"]
    assert "'batch'" in next(f.message for f in findings if f.kind == "cross_example")
