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
from jax.sharding import PartitionSpec as P

from unsplit._src.models import transformer as tf
from unsplit._src.models.specs import fsdp_specs as fsdp_specs
from unsplit._src.models.specs import megatron_specs as megatron_specs
from unsplit._src.models.specs import on_mesh as replicated
from unsplit._src.models.specs import tensor_parallel_specs as tensor_parallel_specs
from unsplit._src.trees import bits_equal as bits_equal
from unsplit._src.trees import rel_l2 as rel_l2

CONFIG = tf.TransformerConfig(vocab=32, length=16, width=32, heads=4, layers=1)


@functools.cache
def problem(batch: int = 64, seed: int = 0, config: tf.TransformerConfig = CONFIG):
    """(model, params, ragged batch) for the small transformer of the tests."""
    model = tf.Transformer(config)
    params = tf.init_params(model, seed)
    data = jax.tree.map(np.asarray, tf.synthetic_batch(config, batch, seed=seed + 1))
    return model, params, data


def batch_level_loss(model: tf.Transformer):
    """Flax's usual loss over a (sub-)batch with ONE dropout key: (loss_sum, weight)."""

    flax_model = tf.with_flax_dropout(model)  # the usual way: Flax's own dropout layers

    def loss(params, batch, key):
        logits: Any = flax_model.apply({"params": params}, batch["inputs"], rngs={"dropout": key})
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

    from unsplit._src.front.train_step import bitwise_train_step
    from unsplit._src.front.value_and_grad import value_and_grad
    from unsplit._src.processes.global_batch import global_batch

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
            if jax.process_count() > 1 and mesh is not None:
                mine = jax.tree.map(lambda x: x[jax.process_index() * rows :][:rows], rows_now)
                batch, _ = global_batch(mine, mesh)
            else:
                batch = rows_now
            key = jax.random.fold_in(jax.random.key(seed), s)
            _, params, state = train_step(params, state, batch, key)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)


def local_value(x: jax.Array) -> np.ndarray:
    """The whole value of ``x`` from this process's shards (which must cover it)."""
    out = np.zeros(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def to_hex(tree: Any) -> list[str]:
    """Leaves as hex of their bytes: exact, JSON-friendly."""
    return [np.ascontiguousarray(np.asarray(x)).tobytes().hex() for x in jax.tree.leaves(tree)]


# ---- a tiny loss with dropout on its inputs: train steps and their memory ---------------


def tiny_batch() -> jax.Array:
    """16 rows of 4 features."""
    return jax.random.normal(jax.random.key(1), (16, 4))


def tiny_params() -> dict:
    """``{"a": (4, 8), "b": (8,)}``."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"a": jax.random.normal(k1, (4, 8)), "b": jax.random.normal(k2, (8,))}


def tiny_loss(w, x, key):
    """One row's loss: the row's features dropped at rate 0.3 (its key), two layers."""
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    return jnp.sum(jnp.tanh(jnp.where(keep, x, 0.0) @ w["a"]) @ w["b"]) ** 2


# ---- a two-layer MLP whose params every layout can shard -------------------------------

MLP_SIZES = D, H, C, B = 16, 32, 8, 64  # input, hidden, classes, batch


def mlp_params():
    """The MLP's params (host arrays)."""
    rng = np.random.default_rng(0)
    return {
        "w1": rng.normal(0, 0.3, (D, H)).astype(np.float32),
        "b1": np.zeros((H,), np.float32),
        "w2": rng.normal(0, 0.3, (H, C)).astype(np.float32),
        "b2": np.zeros((C,), np.float32),
    }


def mlp_batch():
    """Its batch: inputs x, labels y, weights w."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, D)).astype(np.float32)
    y = rng.integers(0, C, size=(B,)).astype(np.int32)
    weight = rng.integers(1, 5, size=(B,)).astype(np.float32)
    return {"x": x, "y": y, "w": weight}


def mlp_loss(weighted):
    def loss_fn(p, ex, key):
        h = jax.nn.relu(ex["x"] @ p["w1"] + p["b1"])
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        h = jnp.where(keep, h / 0.8, 0.0)
        # On Explicit axes a contraction over a sharded dimension needs its output
        # sharding, as in plain JAX (tensor parallel w2: the hidden axis is sharded).
        explicit = jax.sharding.AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types
        logits = jnp.matmul(h, p["w2"], out_sharding=P() if explicit else None) + p["b2"]
        nll = -jax.nn.log_softmax(logits)[ex["y"]]
        return (nll * ex["w"], ex["w"]) if weighted else nll

    return loss_fn


MLP_LOSSES = {w: mlp_loss(w) for w in (True, False)}

# PartitionSpecs per layout; "data" is the batch axis, "model" the tensor-parallel axis.
MLP_LAYOUTS = {
    "replicated": {"w1": P(), "b1": P(), "w2": P(), "b2": P()},
    "fsdp": {"w1": P("data", None), "b1": P(), "w2": P(None, "data"), "b2": P()},
    "tp": {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()},
    "fsdp+tp": {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P()},
}


def threefry_sizes(jaxpr) -> list[int]:
    """Output sizes of every threefry2x32 hash in a jaxpr (unsplit's or jax's), nested included."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "threefry2x32" or eqn.params.get("name") == "threefry2x32":
            sizes.append(eqn.outvars[0].aval.size)
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                sizes += threefry_sizes(inner)
    return sizes


# --- A CLIP-style coupled loss (batch_loss): step/coupled_test.py and bitwise/coupled_test.py ---
# Two towers with dropout, L2-normalized embeddings, a symmetric InfoNCE loss with in-batch
# negatives and a learnable temperature that only the batch loss uses.

CLIP_KEY = jax.random.fold_in(jax.random.key(0), 21)
CLIP_B, _CLIP_DI, _CLIP_DT, _CLIP_H, _CLIP_E = 32, 16, 8, 16, 8  # batch, inputs, hidden, embedding


def clip_params() -> dict:
    k = jax.random.split(jax.random.key(1), 4)
    di, dt, h, e = _CLIP_DI, _CLIP_DT, _CLIP_H, _CLIP_E
    return {
        "image": {
            "w1": jax.random.normal(k[0], (di, h)) / np.sqrt(di),
            "w2": jax.random.normal(k[1], (h, e)) / np.sqrt(h),
        },
        "text": {
            "w1": jax.random.normal(k[2], (dt, h)) / np.sqrt(dt),
            "w2": jax.random.normal(k[3], (h, e)) / np.sqrt(h),
        },
        "log_temp": jnp.asarray(np.log(5.0), jnp.float32),
    }


def clip_batch() -> dict:
    k1, k2 = jax.random.split(jax.random.key(2))
    image = jax.random.normal(k1, (CLIP_B, _CLIP_DI))
    text = image[:, :_CLIP_DT] + 0.5 * jax.random.normal(k2, (CLIP_B, _CLIP_DT))  # matched pairs
    return {"image": image, "text": text}


def _clip_tower(p, x, key, rate=0.25):
    h = jax.nn.gelu(x @ p["w1"])
    keep = jax.random.bernoulli(key, 1 - rate, h.shape)
    z = jnp.where(keep, h / (1 - rate), 0.0) @ p["w2"]
    return z / jnp.linalg.norm(z)


def clip_features(params, example, key):
    """ONE example's two embeddings, each tower with its own dropout mask."""
    return {
        "image": _clip_tower(params["image"], example["image"], jax.random.fold_in(key, 0)),
        "text": _clip_tower(params["text"], example["text"], jax.random.fold_in(key, 1)),
    }


def clip_loss(log_temp, image, text):
    """Symmetric InfoNCE of (n, E) embeddings: every other row is a negative."""
    logits = jnp.exp(log_temp) * image @ text.T
    labels = jnp.arange(image.shape[0])
    i2t = -jnp.take_along_axis(jax.nn.log_softmax(logits, 1), labels[:, None], 1)
    t2i = -jnp.take_along_axis(jax.nn.log_softmax(logits, 0), labels[None, :], 0)
    return (jnp.mean(i2t) + jnp.mean(t2i)) / 2


def clip_batch_loss(params, features):
    return clip_loss(params["log_temp"], features["image"], features["text"])


def clip_batch_loss_with_aux(params, features):
    logits = features["image"] @ features["text"].T
    accuracy = jnp.mean(jnp.argmax(logits, 1) == jnp.arange(logits.shape[0]))
    return clip_batch_loss(params, features), {"accuracy": accuracy}


def clip_reference(params, batch, key, ids=None):
    """The definition: jax.value_and_grad of batch_loss(p, vmap(features)(p, batch, keys))."""
    from unsplit._src import keys as keys_lib

    n = jax.tree.leaves(batch)[0].shape[0]
    keys = keys_lib.example_keys(key, jnp.arange(n) if ids is None else ids)

    def total(p):
        return clip_batch_loss(p, jax.vmap(clip_features, in_axes=(None, 0, 0))(p, batch, keys))

    return jax.jit(jax.value_and_grad(total))(params)


def clip_close(out, ref, tol: float = 1e-5) -> None:
    """Loss and grads within ``tol`` of ``ref``; the temperature's gradient counted once."""
    loss, grads = out
    ref_loss, ref_grads = ref
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss)), (loss, ref_loss)
    assert rel_l2(grads, ref_grads) <= tol, rel_l2(grads, ref_grads)
    t, rt = float(grads["log_temp"]), float(ref_grads["log_temp"])
    assert abs(t - rt) <= 10 * tol * abs(rt) + 1e-7, (t, rt)


# A loss that holds its own shard_map: a small ring attention over "seq" (per device: its
# query block against every key block, the keys and values passed around the ring).
RING_S, RING_D, RING_HEADS = 32, 16, 2


def toy_ring(q, k, v, axis_name: str = "seq"):
    """Attention of this device's queries ``[L, H, d]`` over every device's keys and values."""
    n = jax.lax.axis_size(axis_name)
    perm = [(i, (i + 1) % n) for i in range(n)]
    scale = np.float32(q.shape[-1] ** -0.5)
    heads, rows = q.shape[1], q.shape[0]

    def step(carry, _):
        peak, total, o, k, v = carry  # running max, softmax denominator, numerator
        s = jnp.einsum("qhd,khd->hqk", q, k) * scale
        new = jnp.maximum(peak, s.max(-1))
        p, c = jnp.exp(s - new[..., None]), jnp.exp(peak - new)
        o = o * c.T[..., None] + jnp.einsum("hqk,khd->qhd", p, v)
        moved = [jax.lax.ppermute(x, axis_name, perm) for x in (k, v)]
        return (new, total * c + p.sum(-1), o, *moved), None

    start = (jnp.full((heads, rows), -jnp.inf), jnp.zeros((heads, rows)), jnp.zeros_like(q), k, v)
    (_, total, o, _, _), _ = jax.lax.scan(step, start, None, length=n)
    return o / total.T[..., None]


def toy_ring_with_rule(calls: list, scale: float = 1.0):
    """:func:`toy_ring` as a ``custom_vjp`` whose rule records each trace in ``calls`` and
    returns ``scale`` times the ring's gradient (a rule that is not the primal's
    derivative when ``scale != 1``)."""

    @jax.custom_vjp
    def ring(q, k, v):
        return toy_ring(q, k, v)

    def fwd(q, k, v):
        return toy_ring(q, k, v), (q, k, v)

    def bwd(res, g):
        calls.append("bwd")
        _, pullback = jax.vjp(toy_ring, *res)
        return tuple(x * np.float32(scale) for x in pullback(g))

    ring.defvjp(fwd, bwd)
    return ring


def dense_attention(q, k, v):
    """What :func:`toy_ring` computes, on one device: softmax attention ``[S, H, d]``."""
    s = jnp.einsum("qhd,khd->hqk", q, k) * np.float32(q.shape[-1] ** -0.5)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)


def ring_params() -> dict:
    rng = np.random.default_rng(0)
    d = RING_D
    return {n: (rng.normal(size=(d, d)) * 0.5).astype(np.float32) for n in ("q", "k", "v", "o")}


def ring_batch(n: int = 8) -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(n, RING_S, RING_D)).astype(np.float32)}


def ring_loss(attention, mesh=None, constrain: str | None = None, in_region: bool = True):
    """A one-example loss: q, k, v projections, ``attention`` (in a ``shard_map`` over
    ``mesh``'s ``seq`` axis, as ringattention's README calls its ring, when ``in_region``),
    dropout, an output projection. ``constrain``: ``"reshard"`` (Explicit axes) or
    ``"wsc"`` (Auto) places the positions over ``seq`` first; ``None``: no annotation."""
    s, d, h = RING_S, RING_D, RING_HEADS
    seq = P("seq", None, None) if constrain == "reshard" else None

    def loss(p, example, key):
        x = example["x"]
        if constrain == "reshard":
            x = jax.sharding.reshard(x, P("seq", None))
        elif constrain == "wsc":
            x = jax.lax.with_sharding_constraint(x, P("seq", None))
        q, k, v = (jnp.reshape(x @ p[n], (s, h, d // h), out_sharding=seq) for n in "qkv")
        if in_region:
            spec = P("seq", None, None)
            region = jax.shard_map(
                attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False
            )
            out = region(q, k, v)
        else:
            out = attention(q, k, v)
        out = jnp.reshape(out, (s, d), out_sharding=None if seq is None else P("seq", None))
        kept = jnp.where(jax.random.bernoulli(key, 0.9, (s, d)), out / 0.9, 0.0)
        return jnp.mean(jnp.tanh(kept @ p["o"]) ** 2)

    return loss
