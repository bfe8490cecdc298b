"""PartitionSpecs for the models' params: FSDP, tensor parallel (Megatron and a stress layout).

Each function maps a params pytree to a pytree of ``jax.P`` of the same
structure; :func:`on_mesh` places host values on a mesh with them.

Example:
    >>> import jax
    >>> from unsplit import models
    >>> config = models.TransformerConfig(vocab=16, length=8, width=16, heads=2, layers=1)
    >>> params = models.init_params(models.Transformer(config))
    >>> specs = models.megatron_specs(params)
    >>> specs["Block_0"]["Dense_0"]["kernel"] == jax.P(None, "model")
    True
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
    >>> sharded = models.on_mesh(params, mesh, specs)
    >>> sharded["Block_0"]["Dense_0"]["kernel"].sharding.spec == jax.P(None, "model")
    True
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def on_mesh(tree: Any, mesh: jax.sharding.Mesh, specs: Any = None) -> Any:
    """Host values as arrays on ``mesh`` (any process count): replicated, or with ``specs``.

    Every process passes the same whole values; each keeps only its shards.
    """
    if specs is None:
        specs = jax.tree.map(lambda _: jax.P(), tree)
    return jax.tree.map(
        lambda x, spec: jax.make_array_from_callback(
            np.shape(x),
            jax.sharding.NamedSharding(mesh, spec),
            lambda idx, x=x: np.asarray(x)[idx],
        ),
        tree,
        specs,
    )


def tensor_parallel_specs(params: Any, axis: str = "model") -> Any:
    """PartitionSpecs sharding every matrix's last dimension over ``axis``.

    Not Megatron's layout (see :func:`megatron_specs`): activations end up sharded on
    their features, so XLA inserts collectives all over the model (a stress test of
    the partitioner, not an efficient layout).
    """
    return jax.tree.map(
        lambda x: jax.P(*([None] * (np.ndim(x) - 1)), axis) if np.ndim(x) >= 2 else jax.P(), params
    )


def megatron_specs(params: Any, axis: str = "model") -> Any:
    """Megatron tensor parallelism for Flax transformer params (``unsplit.models.Transformer``).

    Attention: query/key/value kernels ``[in, heads, head_dim]`` and their biases
    sharded over heads, the output kernel ``[heads, head_dim, out]`` over heads
    (its bias replicated); the MLP of a block: the up projection (``Dense_0``)
    column-parallel, the down projection (``Dense_1``) row-parallel. Everything else
    (embeddings, LayerNorms, the output head) replicated. Per block, the forward pass
    then needs one all-reduce after attention and one after the MLP.
    """

    def spec(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        ndim = np.ndim(x)
        if any(n.startswith("MultiHeadDotProductAttention") for n in names):
            if names[-2] in ("query", "key", "value"):
                return jax.P(*([None] * (ndim - 2)), axis, None)
            if names[-2] == "out" and names[-1] == "kernel":
                return jax.P(axis, *([None] * (ndim - 1)))
        elif any(n.startswith("Block") for n in names):
            if names[-2] == "Dense_0":
                return jax.P(*([None] * (ndim - 1)), axis)
            if names[-2] == "Dense_1" and names[-1] == "kernel":
                return jax.P(axis, None)
        return jax.P(*([None] * ndim))

    return jax.tree_util.tree_map_with_path(spec, params)


def fsdp_specs(params: Any, axis: str = "data", size: int = 2) -> Any:
    """PartitionSpecs sharding each leaf's first dimension over ``axis`` where it divides into
    two rows or more per device (a bitwise step's canonical blocks hold two elements or
    more: a dimension of ``size`` rows over ``size`` devices could not keep its bits)."""

    def spec(x):
        if np.ndim(x) and np.shape(x)[0] % (2 * size) == 0:
            return jax.P(axis, *([None] * (np.ndim(x) - 1)))
        return jax.P()

    return jax.tree.map(spec, params)
