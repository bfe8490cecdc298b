"""A bitwise step on GPUs without deterministic ops warns once, naming the flags; on CPU
clients that deadlock on two collective programs in flight, groups' programs run one at a
time (and a train step called without waiting never hangs)."""

import os
import subprocess
import sys
import textwrap
import types
import warnings

import jax
import numpy as np
import optax
import pytest

import unsplit
from unsplit import models
from unsplit._src.bitwise import accelerators

# Two plain jitted programs over 8 CPU devices with collectives and no data between them,
# called alternately without waiting (no unsplit code). A watchdog says "hung" when they
# make no progress for 15 s (the jaxlib's client deadlocked; XLA itself aborts after 40 s).
_TWO_PROGRAMS = textwrap.dedent(
    """
    import os, threading
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    done = threading.Event()
    def watch():
        if not done.wait(15):
            print("hung", flush=True)
            os._exit(3)
    threading.Thread(target=watch, daemon=True).start()
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    def shard_mapped(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"),
                                     check_vma=False))
    summed = shard_mapped(lambda a: jnp.tile(
        jax.lax.psum_scatter(a, "data", scatter_dimension=1, tiled=True), (1, 2)))
    gathered = shard_mapped(lambda a: jax.lax.all_gather(a, "fsdp", tiled=True)[: a.shape[0]])
    xs = [jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P("fsdp"))) for _ in range(4)]
    for _ in range(500):
        xs = [summed(xs[0]), gathered(xs[1]), summed(xs[2]), gathered(xs[3])]
    jax.block_until_ready(xs)
    done.set()
    print("ran", flush=True)
    """
)


def test_two_collective_programs_in_flight_hang_exactly_where_groups_run_one_at_a_time():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", _TWO_PROGRAMS], capture_output=True, text=True, timeout=120,
        env=env, check=False,
    )  # fmt: skip
    hung = "hung" in done.stdout
    assert hung or "ran" in done.stdout, done.stderr[-3000:]
    # jaxlib < 0.12 on CPU: the client deadlocks, so groups must run one at a time there;
    # 0.12 and later: it runs them through, so they need not.
    assert hung == accelerators.groups_one_at_a_time(jax.devices("cpu"))


@pytest.mark.parametrize(
    ("version", "platform", "expected"),
    [("0.10.2", "cpu", True), ("0.11.2", "cpu", True), ("0.12.0", "cpu", False),
     ("0.12.1", "cpu", False), ("1.0.0", "cpu", False), ("0.10.2", "tpu", False),
     ("0.10.2", "gpu", False)],
)  # fmt: skip
def test_groups_run_one_at_a_time_on_cpu_before_jaxlib_0_12(version, platform, expected):
    devices = [types.SimpleNamespace(platform=platform)] * 8
    assert accelerators.groups_one_at_a_time(devices, version) is expected


def _fsdp_groups_train(steps: int, wait_each: bool):
    config = models.TransformerConfig(width=32, layers=1)
    model = models.Transformer(config)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = jax.tree.map(np.asarray, models.init_params(model, 0))
    params = models.on_mesh(params, mesh, models.fsdp_specs(params, "fsdp", 4))
    batch = jax.device_put(
        models.synthetic_batch(config, 64, seed=1),
        jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp"))),
    )
    step = unsplit.value_and_grad(
        models.token_loss(model), weighted=True, mesh=mesh, batch_axes=("data", "fsdp"),
        bitwise=True, chunk_axes="fsdp",
    )  # fmt: skip
    optimizer = optax.adamw(1e-3)
    train = unsplit.train_step(step, optimizer)
    state = jax.jit(optimizer.init)(params)
    for _ in range(steps):
        _, params, state = train(params, state, batch, jax.random.key(2))
        if wait_each:
            jax.block_until_ready(params)
    return jax.device_get(params)


@pytest.mark.usefixtures("standard_promotion")  # optax's update mixes Python floats in
def test_an_fsdp_groups_train_step_called_without_waiting_never_hangs():
    # Each step's two FSDP groups gather their params and run their chunk programs with no
    # data between them: on jaxlib < 0.12 this loop hung within its first 10 steps when the
    # runner did not wait for each (measured, 4 of 4 runs). The waits change no bit.
    unwaited = _fsdp_groups_train(20, wait_each=False)
    assert unsplit.testing.bits_equal(unwaited, _fsdp_groups_train(20, wait_each=True))


def gpus(n=2):
    return [types.SimpleNamespace(platform="gpu") for _ in range(n)]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(accelerators, "_warned", set())


def test_gpu_without_deterministic_ops_warns_once_with_the_fix(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    with pytest.warns(UserWarning, match=r"xla_gpu_deterministic_ops=true.*Fix: start every"):
        accelerators.warn_once_without_gpu_flags(gpus())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerators.warn_once_without_gpu_flags(gpus())  # once per process


@pytest.mark.parametrize(
    ("platform", "flags"),
    [("gpu", "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"), ("cpu", ""),
     ("tpu", "")],
)  # fmt: skip
def test_no_warning_with_the_flags_or_off_gpu(monkeypatch, platform, flags):
    monkeypatch.setenv("XLA_FLAGS", flags)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerators.warn_once_without_gpu_flags([types.SimpleNamespace(platform=platform)])


def cpus(n):
    return [types.SimpleNamespace(platform="cpu") for _ in range(n)]


def test_several_cpu_devices_with_the_compilation_cache_warn_once_with_the_fix():
    with pytest.warns(UserWarning, match=r"persistent compilation cache.*Fix: run bitwise"):
        accelerators.warn_once_with_compilation_cache(cpus(4), "/tmp/jax-cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerators.warn_once_with_compilation_cache(cpus(4), "/tmp/jax-cache")  # once


@pytest.mark.parametrize(
    ("devices", "cache_dir"),
    [(cpus(4), ""), (cpus(1), "/tmp/jax-cache"), ([types.SimpleNamespace(platform="tpu")] * 4,
     "/tmp/jax-cache")],
)  # fmt: skip
def test_no_cache_warning_without_the_cache_on_one_device_or_off_cpu(devices, cache_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerators.warn_once_with_compilation_cache(devices, cache_dir)


def test_the_suite_runs_without_the_compilation_cache():
    # The bitwise steps of every other test would warn (an error here) if it were on.
    assert not jax.config.jax_compilation_cache_dir
