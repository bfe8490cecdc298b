"""state.py: state updated inside the loss is dropped unless the loss returns it."""

import flax.linen as nn
import jax
import jax.numpy as jnp

import unsplit

KEY = jax.random.key(0)
X = jnp.ones((8, 6, 4))  # a batch of 8 examples of shape (6, 4)


def test_state_returned_in_aux_is_not_dropped():
    model = nn.BatchNorm(use_running_average=False)
    variables = model.init(jax.random.key(1), jnp.ones((6, 4)))

    def keeps(v, x, key):
        out, updates = model.apply(v, x, mutable=["batch_stats"])
        return jnp.sum(out), updates

    def drops(v, x, key):
        out, _ = model.apply(v, x, mutable=["batch_stats"])
        return jnp.sum(out)

    assert unsplit.audit(keeps, variables, X, KEY, has_aux=True) == []
    (finding,) = unsplit.audit(drops, variables, X, KEY)
    assert finding.kind == "dropped_state" and "batch_stats" in finding.message
