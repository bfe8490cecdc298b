"""rows.py: batch_draw where a draw's own axis meets the batch's rows (microbatches of a size
fixed in the code, which a batch twice as large does not reveal), and what must pass."""

import inspect

import jax
import jax.numpy as jnp
import pytest

import unsplit
from unsplit._src.audit import rows
from unsplit._src.audit.finding import AuditWarning

B, K, D = 16, 4, 8  # module constants, as a config-driven trainer has them
MB = B // K
W, X, KEY = jnp.ones((D, 2)), jnp.ones((B, D)), jax.random.key(0)


def fori_microbatches(w, x, key):
    keys = jax.random.split(key, K)

    def body(i, acc):
        micro = jax.lax.dynamic_slice_in_dim(x, i * MB, MB)
        keep = jax.random.bernoulli(keys[i], 0.9, (MB, D))  # DRAW
        return acc + jnp.sum(jnp.where(keep, micro, 0.0) @ w)

    return jax.lax.fori_loop(0, K, body, 0.0)


def python_microbatches(w, x, key):
    keys = jax.random.split(key, K)
    total = 0.0
    for i in range(K):
        hidden = x[i * MB : (i + 1) * MB] @ jnp.ones((D, D))  # rows survive a matmul
        noise = jax.random.normal(keys[i], (MB, D))  # DRAW
        total += jnp.sum((hidden + 0.1 * noise) @ w)
    return total


def same_key_microbatches(w, x, key):
    def body(i, acc):
        micro = jax.lax.dynamic_slice_in_dim(x, i * MB, MB)
        keep = jax.random.bernoulli(key, 0.9, (MB, D))  # DRAW
        return acc + jnp.sum(jnp.where(keep, micro, 0.0) @ w)

    return jax.lax.fori_loop(0, K, body, 0.0)


def _line(fn, marker="# DRAW"):
    source = inspect.getsource(fn).splitlines()
    return fn.__code__.co_firstlineno + next(i for i, t in enumerate(source) if marker in t)


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (fori_microbatches, "one key (split or folded per microbatch)"),
        (python_microbatches, "changes with the batch size"),
        (same_key_microbatches, "every microbatch gets the same noise"),
    ],
)
def test_noise_meeting_the_rows_of_fixed_size_microbatches_is_a_batch_draw(fn, words):
    (found,) = unsplit.audit_step(jax.jit(fn), W, X, KEY)
    assert (found.kind, found.file, found.line) == ("batch_draw", __file__, _line(fn))
    assert "meets the rows of the batch (args[1])" in found.message and words in found.message


def scan_reshape(w, x, key):
    keys = jax.random.split(key, K)

    def body(acc, xs):
        micro, k = xs
        noise = jax.random.normal(k, (MB, D))  # DRAW
        return acc + jnp.sum((micro + noise) @ w), None

    return jax.lax.scan(body, 0.0, (x.reshape(K, MB, D), keys))[0]


def test_a_reshape_into_constant_microbatches_is_found_without_the_doubled_batch():
    with pytest.warns(AuditWarning, match="checked only where noise meets the batch's rows"):
        (found,) = unsplit.audit_step(scan_reshape, W, X, KEY)  # (32, 8) does not reshape
    assert (found.kind, found.line) == ("batch_draw", _line(scan_reshape))


def per_example_keys(w, x, key):
    keys = unsplit.example_keys(key, jnp.arange(B, dtype=jnp.uint32))

    def body(i, acc):
        micro = jax.lax.dynamic_slice_in_dim(x, i * MB, MB)
        micro_keys = jax.lax.dynamic_slice_in_dim(keys, i * MB, MB)
        noisy = jax.vmap(lambda k, row: row + jax.random.normal(k, row.shape))(micro_keys, micro)
        return acc + jnp.sum(noisy @ w)

    return jax.lax.fori_loop(0, K, body, 0.0)


def shared_noise(w, x, key):
    keys = jax.random.split(key, K)

    def body(i, acc):
        micro = jax.lax.dynamic_slice_in_dim(x, i * MB, MB)
        noisy_w = w + jax.random.normal(keys[i], w.shape)  # weight noise: no axis of rows
        bias = jax.random.normal(keys[i], (D,))  # one vector broadcast over the rows
        return acc + jnp.sum((micro + bias[None, :]) @ noisy_w)

    return jax.lax.fori_loop(0, K, body, 0.0)


@pytest.mark.parametrize("fn", [per_example_keys, shared_noise])
def test_per_example_noise_and_noise_without_rows_pass(fn):
    assert unsplit.audit_step(jax.jit(fn), W, X, KEY) == []


def test_one_finding_when_both_signals_see_the_same_draw():
    def step(w, x, key):
        keep = jax.random.bernoulli(key, 0.9, x.shape)  # follows the batch size too
        return jnp.sum(jnp.where(keep, x, 0.0) @ w)

    (found,) = unsplit.audit_step(step, W, X, KEY)
    assert found.kind == "batch_draw" and "meets the rows" not in found.message


@pytest.mark.parametrize(
    ("shape", "out", "pairs"),
    [
        ((16, 8), (4, 4, 8), [(0, 0), (0, 1), (1, 2)]),
        ((4, 4, 8), (16, 8), [(0, 0), (1, 0), (2, 1)]),
        ((16, 1, 8), (16, 8), [(0, 0), (2, 1)]),
        ((6, 4), (4, 6), [(0, 0), (0, 1), (1, 0), (1, 1)]),  # one group: every axis to every
    ],
)
def test_reshape_pairs_follow_the_axes_that_keep_their_rows(shape, out, pairs):
    assert rows._reshape_pairs(shape, out) == pairs
