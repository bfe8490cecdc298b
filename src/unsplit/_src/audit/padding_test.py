"""padding.py: draws whose bits change with the padded length, and the stride rule."""

import jax
import jax.numpy as jnp
import pytest

import unsplit
from unsplit._src.audit import padding as audit_padding

KEY = jax.random.key(0)
X = jnp.ones((8, 6, 4))  # a batch of 8 examples of shape (6, 4)
W = jnp.ones(4)


def _kinds(loss_fn):
    return [f.kind for f in unsplit.audit(loss_fn, W, X, KEY)]


def test_padding_draws_inside_a_scan_use_the_stride_rule():
    def loss_fn(w, x, key):
        length = x.shape[0]

        def layer(h, i):
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, (length, length))
            return h + jnp.sum(jnp.where(keep, x @ x.T, 0.0)), None

        total, _ = jax.lax.scan(layer, 0.0, jnp.arange(2))
        return total + jnp.sum(w)

    assert _kinds(loss_fn) == ["padding_unstable"]


def test_prefix_stable_draws_pass_the_padding_check():
    def loss_fn(w, x, key):
        k1, k2 = jax.random.split(key)
        h = unsplit.dropout(k1, x, 0.1)  # unsplit's lanes: element i depends on (key, i)
        keep = jax.random.bernoulli(k2, 0.5, x.shape)  # threefry: length on the leading axis
        return jnp.sum(jnp.where(keep, h, 0.0) @ w)

    assert _kinds(loss_fn) == []


@pytest.mark.parametrize(
    ("long", "short", "stable"),
    [
        ((8, 4), (4, 4), True),  # length leading: flat indices kept
        ((1, 8, 8), (1, 4, 4), False),  # attention's (1, L, L)
        ((8,), (4,), True),
        ((2, 8), (2, 4), False),  # a non-leading length with a leading axis > 1
        ((1, 8), (1, 4), True),  # the leading axis has size 1
    ],
)
def test_stride_rule(long, short, stable):
    assert audit_padding._stable_strides(long, short) == stable
