"""graph.py's walk: draws inside loops (scan, fori_loop) and branches (cond) are followed."""

import inspect

import jax
import jax.numpy as jnp

import unsplit

KEY = jax.random.key(0)
X = jnp.ones((8, 6, 4))  # a batch of 8 examples of shape (6, 4)
W = jnp.ones(4)


def test_draws_inside_loops_and_branches_are_followed():
    def loss_fn(w, x, key):
        def layer(h, i):
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape)
            return jnp.where(keep, h, 0.0), None

        h, _ = jax.lax.scan(layer, x, jnp.arange(3))
        h = jax.lax.cond(jnp.sum(h) > 0, lambda: h, lambda: -h)
        fixed = jax.lax.fori_loop(0, 2, lambda i, k: jax.random.fold_in(k, i), jax.random.key(3))
        return jnp.sum(h @ w) + jnp.sum(jax.random.normal(fixed, (2,)))  # a foreign draw

    line = inspect.currentframe().f_lineno - 2
    found = [(f.kind, f.line) for f in unsplit.audit(loss_fn, W, X, KEY)]
    assert found == [("foreign_key", line)]
