"""haoliuhl's ringattention (PyPI ``ringattention``) inside the loss, as its README calls it.

``shard_map(partial(ring_attention, axis_name=..., blockwise_kwargs=...), mesh=mesh,
in_specs=..., out_specs=..., check_rep=False)`` over a ``seq`` axis inside the one-example
loss, in both modes, with a sharding annotation elsewhere in the loss; compared with the
same loss with a dense causal attention. Skipped where the package is not installed (it is
no dependency of unsplit's); its ``__init__`` calls ``jax.lib.xla_bridge``, which JAX 0.10
no longer has, so the test loads the ring's own module (the one ``ringattention.ringattention``
is on CPU).
"""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import unsplit

pytestmark = pytest.mark.usefixtures("standard_promotion")  # its code mixes bool and float

S, D, HEADS = 32, 16, 2
KEY = jax.random.key(7)


def _ring_attention():
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ringattention is not installed (pip install ringattention einops)")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ringattention_jax.py"
    module_spec = importlib.util.spec_from_file_location("ringattention_jax", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.ring_attention


def _params():
    rng = np.random.default_rng(0)
    return {n: (rng.normal(size=(D, D)) * 0.5).astype(np.float32) for n in ("q", "k", "v", "o")}


def _batch():
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(8, S, D)).astype(np.float32)}


def _loss(attention, sharded: bool):
    heads = P(None, "seq", None, None) if sharded else None

    def loss(p, example, key):
        x = jax.sharding.reshard(example["x"], P("seq", None)) if sharded else example["x"]
        q, k, v = (
            jnp.reshape(x @ p[n], (1, S, HEADS, D // HEADS), out_sharding=heads) for n in "qkv"
        )
        out = jnp.reshape(
            attention(q, k, v), (S, D), out_sharding=P("seq", None) if sharded else None
        )
        out = unsplit.dropout(key, out, 0.1)
        return jnp.mean(jnp.tanh(out @ p["o"]) ** 2)

    return loss


def _dense(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("bitwise", [False, True], ids=["default", "bitwise"])
def test_ringattention_as_its_readme_calls_it_runs_in_both_modes(bitwise):
    ring_attention = _ring_attention()
    mesh = jax.make_mesh((2, 4), ("data", "seq"))
    ring = jax.shard_map(
        functools.partial(
            ring_attention,
            axis_name="seq",
            float32_logits=True,
            cache_idx=None,
            blockwise_kwargs=dict(
                causal_block_size=1,
                deterministic=True,
                dropout_rng=None,
                attn_pdrop=0.0,
                query_chunk_size=4,
                key_chunk_size=4,
                policy=jax.checkpoint_policies.nothing_saveable,
                dtype=jnp.float32,
                precision=None,
                prevent_cse=True,
            ),
        ),
        mesh=mesh,
        in_specs=(P(None, "seq", None, None),) * 3 + (P(), P()),
        out_specs=P(None, "seq", None, None),
        check_vma=False,
    )
    step = unsplit.value_and_grad(
        _loss(lambda q, k, v: ring(q, k, v, None, None), sharded=True), mesh=mesh,
        bitwise=bitwise, **({"chunk_size": 2} if bitwise else {}),
    )  # fmt: skip
    with jax.set_mesh(mesh):
        out = jax.device_get(step(_params(), _batch(), KEY))
    ref = jax.device_get(
        unsplit.value_and_grad(_loss(_dense, sharded=False))(_params(), _batch(), KEY)
    )
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
