"""The device suite: the properties that matter on an accelerator (``pytest -m device``).

Run on a machine with a GPU or TPU: ``./dev test-device`` (it sets
``JAX_PLATFORMS=`` so the tests see the accelerator, and the flags bitwise mode needs
on a GPU). ``benchmarks/device_check.py`` runs it first. Without an accelerator every
test here skips, saying so; ``UNSPLIT_DEVICE_TESTS_ON_CPU=1`` runs them on the CPU
anyway, to check the suite itself.

What it checks there:

* bitwise loss and grads bit for bit over microbatches 1/2/4/8 and the devices found,
  at the default chunk and another one; AdamW steps through ``unsplit.train_step``
  bit for bit over microbatches; a default-mode ``train_step`` that runs and learns;
* a contrastive ``batch_loss`` step: bitwise bits over microbatches, default mode
  against the plain loss over the whole batch;
* the dropout kernels against their reference: the layers' and attention's masks on
  the device are the host's, bit for bit (the mask is the contract);
* default mode against the user's own jitted step with the same keys, at
  ``jax.default_matmul_precision("highest")`` set around the call (which reaches the
  loss in both modes);
* the memory check refuses a step too big for the device before it runs, and
  ``unsplit.chunk_size_for(..., step=...)`` picks a chunk that runs where the whole
  share would not.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unsplit
from unsplit.models import (
    Transformer,
    TransformerConfig,
    fsdp_specs,
    init_params,
    on_mesh,
    synthetic_batch,
    token_loss,
)

ON_CPU = jax.default_backend() == "cpu"
pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(
        ON_CPU and os.environ.get("UNSPLIT_DEVICE_TESTS_ON_CPU") != "1",
        reason=(
            "no accelerator found: jax.default_backend() is 'cpu' (JAX_PLATFORMS="
            f"{os.environ.get('JAX_PLATFORMS')!r}). The device suite runs on a GPU or TPU: "
            "./dev test-device there (UNSPLIT_DEVICE_TESTS_ON_CPU=1 runs it on the CPU)."
        ),
    ),
    pytest.mark.usefixtures("standard_promotion"),  # user-style code: optax, Flax
]

CONFIG = TransformerConfig(vocab=96, length=64, width=128, heads=4, layers=2)
MODEL = Transformer(CONFIG)
LOSS = token_loss(MODEL)
KEY = jax.random.key(0)


@functools.cache
def host_params():
    return jax.tree.map(np.asarray, init_params(MODEL))


@functools.cache
def host_batch():
    return jax.tree.map(np.asarray, synthetic_batch(CONFIG, 64, seed=1))


def device_counts() -> list[int]:
    return [d for d in (1, 2, 4, 8) if d <= jax.device_count()]


def data_mesh(n: int, axis_type=jax.sharding.AxisType.Auto):
    return jax.make_mesh((n,), ("data",), axis_types=(axis_type,))


def bitwise_out(n: int, microbatches: int, chunk_size=None, loss=LOSS, mesh=None):
    mesh = mesh or data_mesh(n)
    step = unsplit.value_and_grad(
        loss, weighted=True, mesh=mesh, microbatches=microbatches, bitwise=True,
        chunk_size=chunk_size,
    )  # fmt: skip
    return jax.device_get(step(on_mesh(host_params(), mesh), host_batch(), KEY))


def test_bitwise_bits_over_microbatches_and_devices():
    first = bitwise_out(1, 1)
    for n in device_counts():
        for microbatches in (1, 2, 4, 8):
            out = bitwise_out(n, microbatches)
            assert unsplit.testing.bits_equal(out, first), (n, microbatches)
    # No mesh: the same one-device program.
    step = unsplit.value_and_grad(LOSS, weighted=True, bitwise=True)
    assert unsplit.testing.bits_equal(jax.device_get(step(host_params(), host_batch(), KEY)), first)


def test_a_one_device_explicit_mesh_gives_the_bits_of_no_mesh():
    def fresh():  # a loss function of its own: programs compiled for it alone
        return lambda p, ex, k: LOSS(p, ex, k)

    explicit = bitwise_out(1, 1, loss=fresh(), mesh=data_mesh(1, jax.sharding.AxisType.Explicit))
    step = unsplit.value_and_grad(fresh(), weighted=True, bitwise=True)
    assert unsplit.testing.bits_equal(
        explicit, jax.device_get(step(host_params(), host_batch(), KEY))
    )


def test_another_chunk_size_gives_its_own_bits_on_every_schedule():
    first = bitwise_out(1, 1, chunk_size=16)
    assert np.isfinite(first[0])
    for n in (d for d in device_counts() if 64 // d % 16 == 0):  # whole chunks per device
        for microbatches in (1, 4):
            out = bitwise_out(n, microbatches, chunk_size=16)
            assert unsplit.testing.bits_equal(out, first), (n, microbatches)


def train(microbatches: int, bitwise: bool, steps: int = 5):
    n = max(device_counts())
    mesh = data_mesh(n)
    params = on_mesh(host_params(), mesh, fsdp_specs(host_params(), "data", n))
    optimizer = optax.adamw(1e-3)
    with jax.set_mesh(mesh):
        opt_state = optimizer.init(params)
    step = unsplit.value_and_grad(
        LOSS, weighted=True, mesh=mesh, microbatches=microbatches, bitwise=bitwise
    )
    run = unsplit.train_step(step, optimizer)
    losses = []
    for i in range(steps):
        loss, params, opt_state = run(params, opt_state, host_batch(), jax.random.fold_in(KEY, i))
        losses.append(float(loss))
    return losses, jax.device_get((params, opt_state))


def test_bitwise_train_steps_are_bit_identical_over_microbatches():
    losses, state = train(1, bitwise=True)
    losses4, state4 = train(4, bitwise=True)
    assert losses == losses4
    assert unsplit.testing.bits_equal(state, state4)


def test_a_default_train_step_runs_and_learns():
    losses, _ = train(1, bitwise=False, steps=8)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


# ---- a loss that couples examples ----


def tower(w, x, key):
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    hidden = jnp.tanh(jnp.where(keep, x / 0.9, 0.0) @ w["w1"])
    return hidden @ w["w2"]


def features_fn(params, example, key):
    ka, kb = jax.random.split(key)
    a, b = tower(params["a"], example["a"], ka), tower(params["b"], example["b"], kb)
    return {"a": a / jnp.linalg.norm(a), "b": b / jnp.linalg.norm(b)}


def batch_loss_fn(params, f):
    logits = f["a"] @ f["b"].T / jnp.exp(params["log_t"])
    labels = jnp.arange(logits.shape[0])
    rows = jax.nn.log_softmax(logits, axis=1)[labels, labels]
    cols = jax.nn.log_softmax(logits, axis=0)[labels, labels]
    return -(jnp.mean(rows) + jnp.mean(cols)) / 2


def contrastive_problem(batch: int = 128):
    keys = jax.random.split(jax.random.key(5), 6)
    params = {
        "a": {"w1": jax.random.normal(keys[0], (32, 64)) / 6, "w2": jax.random.normal(keys[1], (64, 16)) / 8},
        "b": {"w1": jax.random.normal(keys[2], (24, 64)) / 5, "w2": jax.random.normal(keys[3], (64, 16)) / 8},
        "log_t": jnp.log(jnp.float32(0.07)),
    }  # fmt: skip
    data = {
        "a": jax.random.normal(keys[4], (batch, 32)),
        "b": jax.random.normal(keys[5], (batch, 24)),
    }
    return params, data


def test_batch_loss_bitwise_over_microbatches_and_default_mode_against_the_plain_loss():
    params, data = contrastive_problem()
    outs = [
        jax.device_get(
            unsplit.value_and_grad(
                features_fn, batch_loss=batch_loss_fn, microbatches=k, bitwise=True
            )(params, data, KEY)
        )
        for k in (1, 2, 4)
    ]
    assert all(unsplit.testing.bits_equal(out, outs[0]) for out in outs[1:])

    def plain(params):
        keys = unsplit.example_keys(KEY, jnp.arange(128))
        return batch_loss_fn(params, jax.vmap(features_fn, (None, 0, 0))(params, data, keys))

    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.value_and_grad(plain))(params)
        for k in (1, 4):
            step = unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn, microbatches=k)
            got = step(params, data, KEY)
            assert unsplit.testing.rel_l2(got, want) < 1e-5, k


# ---- the dropout kernels against their reference: the host's bits ----


def host_device():
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        pytest.skip("no CPU backend beside the accelerator (JAX_PLATFORMS names only it)")


def on_device_and_host(fn, *args):
    """``jit(fn)(*args)`` on the default device and on the host's CPU."""
    here = jax.device_get(jax.jit(fn)(*args))
    with jax.default_device(host_device()):
        host = jax.device_get(jax.jit(fn)(*jax.device_put(args, host_device())))
    return here, host


def dropout_layers(rate: float):
    import equinox as eqx

    from unsplit import equinox as ueqx
    from unsplit import linen as ulinen
    from unsplit import nnx as unnx

    linen = ulinen.Dropout(rate, deterministic=False)
    return {
        "unsplit.dropout": lambda key, x: unsplit.dropout(key, x, rate),
        "unsplit.linen.Dropout": lambda key, x: linen.apply({}, x, rngs={"dropout": key}),
        "unsplit.nnx.Dropout": lambda key, x: unnx.Dropout(rate)(x, rngs=key),
        "unsplit.equinox.Dropout": lambda key, x: eqx.filter_jit(lambda m, x: m(x, key=key))(
            ueqx.Dropout(rate), x
        ),
    }


@pytest.mark.parametrize("name", list(dropout_layers(0.1)))
def test_dropout_layers_give_the_hosts_bits(name):
    fn = dropout_layers(0.3)[name]
    x = jax.random.normal(jax.random.key(1), (8, 128, 96))
    here, host = on_device_and_host(fn, KEY, x)
    np.testing.assert_array_equal(here != 0, host != 0)  # the mask: the contract
    np.testing.assert_array_equal(here, host)  # x / keep, exactly rounded on both


@pytest.mark.parametrize("broadcast", [False, True])
def test_attention_dropout_gives_the_hosts_mask(broadcast):
    from unsplit import linen as ulinen

    length, heads, real = 64, 4, 48
    # Zero queries and keys: each query's weights are uniform over the real keys; one-hot
    # values show every dropped weight in the output.
    q = jnp.zeros((2, length, heads, 8))
    v = jnp.broadcast_to(jnp.eye(length)[:, None, :], (2, length, heads, length))
    mask = jnp.broadcast_to(jnp.arange(length) < real, (length, length))

    def weights(q, v, mask, key):
        return ulinen.dot_product_attention(
            q, q, v, mask=mask, dropout_rng=key, dropout_rate=0.3,
            broadcast_dropout=broadcast, deterministic=False,
        )  # fmt: skip

    # "highest": a TPU's default precision rounds the weights-values product through bf16
    # (measured there: 7.8e-4 apart, the same mask); the mask is the contract.
    with jax.default_matmul_precision("highest"):
        here, host = on_device_and_host(weights, q, v, mask, KEY)
    np.testing.assert_array_equal(here != 0, host != 0)
    np.testing.assert_allclose(here, host, rtol=1e-5)
    kept = np.mean(host[..., :real] != 0)
    assert 0.6 < kept < 0.8  # rate 0.3


# ---- default mode against the user's own jitted step ----


def users_step(size: int):
    def batched(params, batch, key):
        keys = unsplit.example_keys(key, jnp.arange(size))
        sums, weights = jax.vmap(LOSS, in_axes=(None, 0, 0))(params, batch, keys)
        return jnp.sum(sums) / jnp.sum(weights)

    return jax.jit(jax.value_and_grad(batched))


@pytest.mark.parametrize("microbatches", [1, 4])
def test_default_mode_is_the_users_jitted_step_with_the_same_keys(microbatches):
    n = max(device_counts())
    mesh = data_mesh(n)
    params = on_mesh(host_params(), mesh)
    step = unsplit.value_and_grad(LOSS, weighted=True, mesh=mesh, microbatches=microbatches)
    with jax.default_matmul_precision("highest"):
        got = step(params, host_batch(), KEY)
        want = users_step(64)(params, host_batch(), KEY)
    assert unsplit.testing.rel_l2(got, want) < 1e-5


@pytest.mark.parametrize("bitwise", [False, True])
def test_the_precision_set_around_the_call_reaches_the_loss(bitwise):
    seen = []

    def loss(params, example, key):
        seen.append(jax.config.jax_default_matmul_precision)
        return LOSS(params, example, key)

    step = unsplit.value_and_grad(loss, weighted=True, bitwise=bitwise)
    with jax.default_matmul_precision("highest"):
        jax.block_until_ready(step(host_params(), host_batch(), KEY))
    assert seen and set(seen) == {"highest"}


# ---- memory: the check, and a chunk that fits ----


def wide_loss(w, x, key):
    """One example's activations: an (R, C) outer product, held whole.

    The optimization barrier keeps XLA from fusing the product into its consumers: on a
    TPU it fused even a Gram matrix of it into the matmul and the sum (9,728 bytes per
    example were left; the "too big" batch's input alone would have been 32 GiB)."""
    hidden = jax.lax.optimization_barrier(jnp.tanh(x[:, None] * w[None, :]))
    return jnp.sum(hidden * jax.random.uniform(key, hidden.shape))


def free_bytes() -> int:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    pytest.skip(f"{device} reports no free memory (memory_stats): nothing to check")


def too_big_problem(rows: int = 2048, cols: int = 2048):
    """A batch whose whole share needs about twice the device's free memory."""
    w = jax.random.normal(jax.random.key(1), (cols,))
    one = unsplit.value_and_grad(wide_loss).lower(w, jnp.ones((1, rows)), KEY).compile()
    analysis = one.memory_analysis()
    per_example = int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)
    size = 1 << max(2 * free_bytes() // per_example, 1).bit_length()
    if size * rows * 4 > free_bytes() // 8:  # the input itself must fit many times over
        pytest.skip(f"{per_example} bytes per example: a batch twice the free memory "
                    f"({size} examples) would not fit as an input either")  # fmt: skip
    return w, jax.random.normal(jax.random.key(2), (size, rows)), per_example


def test_the_memory_check_refuses_a_step_too_big_before_it_runs():
    w, x, _ = too_big_problem()
    step = unsplit.value_and_grad(wide_loss)
    with pytest.raises(MemoryError, match="it was not run"):
        step(w, x, KEY)
    # The device is still usable: a step that fits runs.
    loss, _ = unsplit.value_and_grad(wide_loss)(w, x[:4], KEY)
    assert np.isfinite(loss)


def test_chunk_size_for_picks_a_chunk_that_runs_where_the_whole_share_does_not():
    w, x, _ = too_big_problem()
    size = x.shape[0]
    with pytest.raises(MemoryError, match="it was not run"):
        unsplit.value_and_grad(wide_loss, bitwise=True, chunk_size=size)(w, x, KEY)
    step = unsplit.value_and_grad(wide_loss, bitwise=True)
    chunk = unsplit.chunk_size_for(size, 1, step=step, params=w, batch=x, key=KEY)
    # Smaller than the share; that it fits is shown by running it (the memory check would
    # refuse it). chunk * per_example overstates a chunk's need: it counts the outputs and
    # the program's fixed buffers once per example.
    assert 1 <= chunk < size
    loss, grads = unsplit.value_and_grad(wide_loss, bitwise=True, chunk_size=chunk)(w, x, KEY)
    assert np.isfinite(loss) and np.all(np.isfinite(grads))
