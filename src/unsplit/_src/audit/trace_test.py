"""trace.py: which arguments of a batched step are the batch."""

import jax
import jax.numpy as jnp
import pytest

from unsplit._src.audit import trace as audit_trace

KEY = jax.random.key(0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((jnp.ones((4, 3)), {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}, KEY), (1,)),
        ((jnp.ones((8, 3)),), (0,)),  # only the first argument: it is the batch
        (({"w": jnp.ones(3), "b": jnp.ones(())}, jnp.ones((8, 2)), jnp.ones(8)), (1, 2)),
        ((jnp.ones((4, 3)), jnp.ones((8, 3)), jnp.ones((5, 3)), jnp.ones((8, 1))), (1, 3)),
        (({"w": jnp.ones(())}, KEY), ()),
    ],
)
def test_infer_batch_argnums(args, expected):
    assert audit_trace.infer_batch_argnums(args) == expected
