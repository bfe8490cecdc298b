"""Helpers for unsplit's own tests: a small problem, tree distances, the naive schemes.

The naive schemes are written the way users write them today (batch-level
dropout with one key per device or one key per microbatch), so the tests can
show that they *do* depend on the schedule while unsplit does not.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unsplit._src.models import transformer as tf

CONFIG = tf.TransformerConfig(vocab=32, length=16, width=32, heads=2, layers=1)


@functools.cache
def problem(batch: int = 64, seed: int = 0, config: tf.TransformerConfig = CONFIG):
    """(model, params, ragged batch) for the small transformer of the tests."""
    model = tf.Transformer(config)
    params = tf.init_params(model, seed)
    data = jax.tree.map(np.asarray, tf.synthetic_batch(config, batch, seed=seed + 1))
    return model, params, data


def rel_l2(a: Any, b: Any) -> float:
    """Relative L2 distance of two pytrees, over all their leaves together."""
    la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
    num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(la, lb, strict=True))
    den = sum(float(np.sum(y**2)) for y in lb)
    return float(np.sqrt(num / max(den, 1e-300)))


def bits_equal(a: Any, b: Any) -> bool:
    """True when two pytrees have the same structure and bit-identical leaves."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))
        for x, y in zip(la, lb, strict=True)
    )


def batch_level_loss(model: tf.Transformer):
    """Flax's usual loss over a (sub-)batch with ONE dropout key: (loss_sum, weight)."""

    flax_model = tf.with_flax_dropout(model)  # the usual way: Flax's own dropout layers

    def loss(params, batch, key):
        logits = flax_model.apply({"params": params}, batch["inputs"], rngs={"dropout": key})
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * batch["mask"]), jnp.sum(batch["mask"])

    return loss


def naive_value_and_grad(model, params, batch, shard_keys: list[jax.Array]):
    """The step a naive data-parallel / accumulation loop computes.

    The global batch is cut into ``len(shard_keys)`` contiguous shards (devices
    or microbatches); shard ``s`` runs batch-level dropout with
    ``shard_keys[s]``; token losses are normalized by the global token count.
    """
    loss = batch_level_loss(model)
    n = len(shard_keys)

    def total(p):
        sums, weights = [], []
        for s, k in enumerate(shard_keys):
            shard = jax.tree.map(lambda x, s=s: x.reshape(n, -1, *x.shape[1:])[s], batch)
            ls, w = loss(p, shard, k)
            sums.append(ls)
            weights.append(w)
        return sum(sums) / sum(weights)

    return jax.jit(jax.value_and_grad(total))(params)


@functools.cache
def weighted_loss():
    """The tests' weighted token loss, one object so compiled chunk programs are shared."""
    return tf.token_loss(problem()[0])


def replicated(tree: Any, mesh: jax.sharding.Mesh, specs: Any = None) -> Any:
    """Host values as arrays on ``mesh`` (any process count): replicated, or with ``specs``."""
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


def train(
    steps: int,
    microbatches: int,
    devices: int | None,
    bitwise: bool,
    seed: int = 0,
    model_axis: int = 1,
):
    """Adam on the tests' problem through ``unsplit.bitwise_train_step``; returns host params.

    Step key ``fold_in(seed, step)``. ``devices=None`` runs without a mesh;
    otherwise over a ``(data, model)`` mesh of the first ``devices`` devices (all
    processes' devices in a multi-process run), params sharded over ``model``
    (tensor parallel) when ``model_axis > 1``.
    """
    import optax

    from unsplit._src.processes.global_batch import global_batch
    from unsplit._src.train_step import bitwise_train_step
    from unsplit._src.value_and_grad import value_and_grad

    _, params, pool = problem(batch=256)
    batch_size = 64
    mesh = None
    if devices is not None:
        mesh = jax.make_mesh((devices // model_axis, model_axis), ("data", "model"))
    step = value_and_grad(
        weighted_loss(), weighted=True, microbatches=microbatches, mesh=mesh, bitwise=bitwise
    )
    opt = optax.adam(1e-2)
    params = jax.tree.map(np.asarray, params)
    if mesh is not None:
        specs = tensor_parallel_specs(params) if model_axis > 1 else None
        params = replicated(params, mesh, specs)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        state = opt.init(params)
        train_step = bitwise_train_step(step, opt)
        rows = batch_size // jax.process_count()
        for s in range(steps):
            start = (s * batch_size) % 256
            rows_now = jax.tree.map(lambda x, s=start: x[s : s + batch_size], pool)
            if jax.process_count() > 1:
                mine = jax.tree.map(lambda x: x[jax.process_index() * rows :][:rows], rows_now)
                batch, _ = global_batch(mine, mesh)
            else:
                batch = rows_now
            key = jax.random.fold_in(jax.random.key(seed), s)
            _, params, state = train_step(params, state, batch, key)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)


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
    """PartitionSpecs sharding each leaf's first dimension over ``axis`` where it divides."""

    def spec(x):
        if np.ndim(x) and np.shape(x)[0] % size == 0:
            return jax.P(axis, *([None] * (np.ndim(x) - 1)))
        return jax.P()

    return jax.tree.map(spec, params)


def local_value(x: jax.Array) -> np.ndarray:
    """The whole value of ``x`` from this process's shards (which must cover it)."""
    out = np.zeros(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def to_hex(tree: Any) -> list[str]:
    """Leaves as hex of their bytes: exact, JSON-friendly."""
    return [np.ascontiguousarray(np.asarray(x)).tobytes().hex() for x in jax.tree.leaves(tree)]
