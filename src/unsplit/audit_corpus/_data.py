"""Tiny inputs shared by the corpus cases (deterministic, no download)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BATCH = 16  # a multiple of 8: the batched cases split it over 8 devices or 4 microbatches
LENGTH = 8
WIDTH = 8


def sequences() -> dict[str, jax.Array]:
    """``{"x": f32[B, L, W], "mask": f32[B, L]}``: ragged sequences of features."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, size=BATCH)
    mask = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.float32)
    x = rng.normal(size=(BATCH, LENGTH, WIDTH)).astype(np.float32)
    return {"x": jnp.asarray(x), "mask": jnp.asarray(mask)}


def regression() -> dict[str, jax.Array]:
    """``{"x": f32[B, W], "y": f32[B], "mask": f32[B]}``: a token-weighted regression."""
    rng = np.random.default_rng(1)
    return {
        "x": jnp.asarray(rng.normal(size=(BATCH, WIDTH)).astype(np.float32)),
        "y": jnp.asarray(rng.normal(size=(BATCH,)).astype(np.float32)),
        "mask": jnp.asarray(rng.integers(1, 5, size=BATCH).astype(np.float32)),
    }


def weights() -> jax.Array:
    return jnp.linspace(-1.0, 1.0, WIDTH, dtype=jnp.float32)


def key() -> jax.Array:
    return jax.random.key(0)


def abstract_init(model) -> dict:
    """A Linen model's variables as ``jax.ShapeDtypeStruct`` s: the audit needs no values."""
    return jax.eval_shape(model.init, jax.random.key(1), jnp.zeros((LENGTH, WIDTH)))
