"""The demo's training runs: one loop, and the update each schedule or naive scheme uses.

Every run starts from the same parameters, reads the same batches
(:class:`~unsplit.demo.data.Dataset`: grain's data order, each example with its
record id as global id) and uses the step key ``fold_in(key(seed), step)``;
only the way the step is computed differs:

* :func:`unsplit_update`: ``unsplit.value_and_grad`` with a mesh of ``devices``
  and ``microbatches`` sequential microbatches, default or bitwise mode;
* :func:`flax_update`: what code written the usual way computes: flax's
  batch-level dropout (one key for a whole sub-batch) with one key per device
  (``flax.training.common_utils.shard_prng_key``: ``split(key, devices)``), or
  with one key reused for every microbatch (T5X's
  ``accumulate_grads_microbatched`` splits the loop's key but never carries the
  new key forward, so every microbatch gets ``split(key)[1]``). Token losses are
  normalized by the global token count, so only the noise differs;
* :func:`multisteps_update`: unsplit's per-example noise, but gradient
  accumulation with ``optax.MultiSteps``, which averages the microbatches'
  token means (a mean of means) instead of dividing by the global token count.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit import models
from unsplit.demo import data as demo_data
from unsplit.demo.config import DemoConfig

#: ``update(params, opt_state, (batch, ids), key) -> (params, opt_state, loss)``.
Update = Callable[[Any, Any, tuple, jax.Array], tuple[Any, Any, Any]]  # (params, state, loss)


@dataclasses.dataclass
class Run:
    """One training run: loss per step, parameters at the snapshot steps, time per step."""

    losses: np.ndarray
    snapshots: dict[int, list[np.ndarray]]
    step_time_s: float
    wall_s: float = 0.0  # the whole run, compile included


def host_leaves(tree: Any) -> list[np.ndarray]:
    """The leaves of a (possibly multi-process, replicated) pytree as host arrays."""
    return [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(tree)]


def train(
    config: DemoConfig,
    update: Update,
    params: Any,
    opt_state: Any,
    data: demo_data.Dataset,
    batch_fn: Callable[[dict, np.ndarray], tuple] = lambda rows, ids: (rows, ids),
    on_step: Callable[[int], None] = lambda step: None,
) -> Run:
    """Runs ``config.steps`` steps of ``update``; step ``s`` uses ``fold_in(key(seed), s)``.

    ``batch_fn(rows, ids)`` turns the host rows and their record ids into the
    ``(batch, ids)`` that ``update`` takes (the multi-process worker passes its
    local rows through ``unsplit.global_batch``).
    The step time is the mean wall time of steps 2..n (step 1 compiles).
    """
    base = jax.random.key(config.seed)
    snap_at = set(config.snapshot_steps())
    losses, snapshots = [], {}
    start = began = time.perf_counter()
    for s in range(config.steps):
        if s == 1:
            jax.block_until_ready(params)
            start = time.perf_counter()
        key = jax.random.fold_in(base, s)
        params, opt_state, loss = update(params, opt_state, batch_fn(*data.step(s)), key)
        losses.append(loss)
        if s + 1 in snap_at:
            snapshots[s + 1] = host_leaves(params)
        on_step(s + 1)
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - start
    values = np.array([float(np.asarray(x.addressable_data(0))) for x in losses], np.float64)
    return Run(
        losses=values,
        snapshots=snapshots,
        step_time_s=elapsed / (config.steps - 1),
        wall_s=time.perf_counter() - began,
    )


def initial_state(config: DemoConfig):
    """(model, host params, optimizer) shared by every run."""
    model = config.model()
    params = jax.device_get(models.init_params(model, config.seed))
    return model, params, optax.adam(config.learning_rate)


def apply_fn(opt: optax.GradientTransformation):
    """The jitted optimizer update ``(params, state, grads) -> (params, state)``."""

    @jax.jit
    def apply(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return apply


def make_mesh(devices: int) -> jax.sharding.Mesh:
    """A 1-D ``("data",)`` mesh with Auto axes over the first ``devices`` devices."""
    if devices > jax.device_count():
        raise RuntimeError(
            f"this schedule needs {devices} devices; jax sees {jax.device_count()}. Fix: run "
            "through `unsplit demo`, which sets XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "before jax starts."
        )
    return jax.make_mesh(
        (devices,),
        ("data",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:devices],
    )


def unsplit_step(config: DemoConfig, loss_fn, *, devices, microbatches, bitwise, mesh=None):
    """``unsplit.value_and_grad`` of the token-weighted ``loss_fn`` for one schedule.

    Pass the same ``loss_fn`` object to every schedule: bitwise mode compiles
    its chunk program once per loss function.
    """
    if mesh is None and devices > 1:
        mesh = make_mesh(devices)
    # Bitwise mode fixes the bits per chunk of examples, so every schedule uses one chunk
    # size: the smallest share, batch / 8.
    return unsplit.value_and_grad(
        loss_fn,
        weighted=True,
        microbatches=microbatches,
        mesh=mesh,
        bitwise=bitwise,
        chunk_size=config.chunk_size() if bitwise else None,
    )


def unsplit_update(step: unsplit.Step, apply) -> Update:
    """A training update from an unsplit step and the jitted optimizer update."""

    def update(params, state, batch_ids, key):
        batch, ids = batch_ids  # the examples' record ids: their noise follows them
        loss, grads = step(params, batch, key, ids=ids)
        params, state = apply(params, state, grads)
        return params, state, loss

    return update


def batch_loss(model):
    """Flax's usual loss over a (sub-)batch with ONE dropout key: (sum token nll, tokens)."""

    def loss(params, batch, key):
        logits = model.apply({"params": params}, batch["inputs"], rngs={"dropout": key})
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * batch["mask"]), jnp.sum(batch["mask"])

    return loss


def flax_update(model, opt, scheme: str, shares: int = 8) -> Update:
    """The update of the usual flax code under ``scheme``.

    Args:
        model: the transformer.
        opt: the optimizer.
        scheme: ``"one_device"`` (the whole batch, the step key),
            ``"per_device_keys"`` (``shares`` devices, ``split(key, shares)[d]``
            on device ``d``, as ``shard_prng_key`` gives) or
            ``"same_key_microbatches"`` (``shares`` microbatches on one device,
            every one with ``split(key)[1]``, as T5X gives).
        shares: devices or microbatches.
    """
    loss = batch_loss(models.with_flax_dropout(model))  # the usual way: Flax's own layers
    sums = scheme_sums(jax.value_and_grad(loss, has_aux=True), scheme, shares)

    @jax.jit
    def jitted(params, state, batch, key):
        ls, w, g = sums(params, batch, key)
        grads = jax.tree.map(lambda x: x / w, g)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, ls / w

    def update(params, state, batch_ids, key):
        return jitted(params, state, batch_ids[0], key)  # batch-level draws ignore the ids

    return update


def scheme_sums(grad, scheme: str, shares: int):
    """``sums(params, batch, key) -> (loss sum, token count, grad sums)`` of ``scheme``.

    ``grad`` is ``jax.value_and_grad`` of :func:`batch_loss` (``has_aux``); see
    :func:`flax_update` for the schemes.
    """

    def sums_one_device(params, batch, key):
        (ls, w), g = grad(params, batch, key)
        return ls, w, g

    def sums_same_key(params, batch, key):
        sub = jax.random.split(key)[1]
        micro = jax.tree.map(lambda x: x.reshape(shares, -1, *x.shape[1:]), batch)

        def body(carry, mb):
            (ls, w), g = grad(params, mb, sub)
            return jax.tree.map(jnp.add, carry, (ls, w, g)), None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        zeros = (*zeros, jax.tree.map(jnp.zeros_like, params))
        return jax.lax.scan(body, zeros, micro)[0]

    if scheme == "per_device_keys":
        mesh = make_mesh(shares)

        def shard(params, batch, keys):
            params = jax.lax.pcast(params, ("data",), to="varying")
            (ls, w), g = grad(params, batch, keys[0])
            return jax.lax.psum((ls, w, g), "data")

        def sums_per_device(params, batch, key):
            keys = jax.random.split(key, shares)  # shard_prng_key
            return jax.shard_map(
                shard, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
            )(params, batch, keys)

        return sums_per_device
    if scheme == "same_key_microbatches":
        return sums_same_key
    if scheme == "one_device":
        return sums_one_device
    raise ValueError(
        f"unknown scheme {scheme!r}; expected 'one_device', 'per_device_keys' or "
        "'same_key_microbatches'."
    )


def multisteps_update(model, opt, microbatches: int = 8) -> tuple[Update, Callable]:
    """``optax.MultiSteps`` accumulation over unsplit's per-example noise (mean of means).

    Each microbatch's gradient is its own token mean, with the example keys of
    the reference (ids = the records' ids); MultiSteps averages
    the ``microbatches`` means and applies Adam once per global batch.

    Returns:
        ``(update, init)``: the training update and the MultiSteps state init.
    """
    multi = optax.MultiSteps(opt, every_k_schedule=microbatches)
    step = unsplit.value_and_grad(models.token_loss(model), weighted=True)

    @jax.jit
    def micro(params, state, batch, key, ids):
        loss, grads = step(params, batch, key, ids=ids)
        updates, state = multi.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def update(params, state, batch_ids, key):
        batch, ids = batch_ids
        size = demo_batch_size(batch) // microbatches
        losses = []
        for m in range(microbatches):
            part = jax.tree.map(lambda x, m=m: x[m * size : (m + 1) * size], batch)
            part_ids = np.asarray(ids[m * size : (m + 1) * size], np.uint32)
            params, state, loss = micro(params, state, part, key, part_ids)
            losses.append(loss)
        return params, state, sum(losses) / microbatches

    return update, multi.init


def demo_batch_size(batch: dict) -> int:
    return int(np.shape(batch["inputs"])[0])
