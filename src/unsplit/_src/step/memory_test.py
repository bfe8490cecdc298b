"""A program too big for the devices is refused before it runs, with the mode's fix."""

import contextlib

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit._src import test_util
from unsplit._src.step import memory

pytestmark = pytest.mark.usefixtures("standard_promotion")  # optax mixes floats and int32
KEY = jax.random.key(0)
X = test_util.tiny_batch()
loss_fn, params = test_util.tiny_loss, test_util.tiny_params


@contextlib.contextmanager
def compiles():
    """Counts XLA compiles (JAX's public monitoring events) inside the block."""
    seen = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def tiny(monkeypatch):
    """Every device has 1 KiB free."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1024)


def test_needed_bytes_is_outputs_plus_temporaries_less_donated():
    x = jnp.ones((256, 256))
    compiled = jax.jit(lambda a: (a @ a, a + 1), donate_argnums=0).lower(x).compile()
    m = compiled.memory_analysis()
    expected = m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert memory.needed_bytes(compiled) == expected
    assert memory.needed_bytes(compiled) >= 256 * 256 * 4  # one output is new


def test_a_cpu_device_gets_its_share_of_the_hosts_available_memory():
    host = memory.host_available_bytes()
    assert host is not None and host > 0
    share = memory.available_bytes(jax.devices()[0])
    assert share == host // len(jax.local_devices()) or abs(share - host // 8) < 2**26


def test_the_error_names_needed_available_and_the_fix(tiny):
    compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64))).compile()
    with pytest.raises(memory.OutOfMemoryError) as raised:
        memory.check(compiled, "Fix: do this.")
    text = str(raised.value)
    assert text.startswith("RESOURCE_EXHAUSTED")
    assert "16.00 KiB (16384 bytes)" in text and "1.00 KiB (1024 bytes) free" in text
    assert "Fix: do this." in text and "UNSPLIT_MEMORY_CHECK=0" in text
    # Caught as JAX's own out-of-memory error is, and as a MemoryError.
    assert isinstance(raised.value, MemoryError)
    assert isinstance(raised.value, jax.errors.JaxRuntimeError)


def test_the_environment_variable_turns_the_check_off(tiny, monkeypatch):
    compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64))).compile()
    monkeypatch.setenv("UNSPLIT_MEMORY_CHECK", "0")
    memory.check(compiled, "Fix: do this.")  # no error
    monkeypatch.setenv("UNSPLIT_MEMORY_CHECK", "1")
    with pytest.raises(MemoryError):
        memory.check(compiled, "Fix: do this.")


def test_a_backend_that_reports_nothing_is_not_checked(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)
    compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64))).compile()
    memory.check(compiled, "Fix: do this.")  # no error


def counted_loss(runs):
    """``loss_fn`` that counts, on the host, how often its program ran."""

    def loss(w, x, key):
        jax.debug.callback(lambda: runs.append(1))
        return loss_fn(w, x, key)

    return loss


@pytest.mark.parametrize("bitwise", [False, True])
def test_a_step_too_big_is_refused_before_it_runs_with_the_modes_fix(tiny, bitwise):
    runs = []
    mesh = jax.make_mesh((2,), ("data",))
    step = unsplit.value_and_grad(counted_loss(runs), mesh=mesh, bitwise=bitwise, microbatches=2)
    fix = r"chunk_size=\.\.\. \(it changes the bits" if bitwise else r"raise microbatches=\.\.\."
    with pytest.raises(MemoryError, match=r"RESOURCE_EXHAUSTED: unsplit: .*free; it was not run"):
        step(params(), X, KEY)
    with pytest.raises(MemoryError, match=fix):
        step(params(), X, KEY)  # refused again: a refused program is not kept
    assert runs == []


@pytest.mark.parametrize("state", [False, True])
def test_a_default_train_step_too_big_is_refused_before_it_runs(tiny, state):
    from flax.training import train_state

    runs = []
    mesh = jax.make_mesh((2,), ("data",))
    optimizer = optax.adam(1e-2)
    step = unsplit.value_and_grad(counted_loss(runs), mesh=mesh)
    train = unsplit.train_step(step, None if state else optimizer)
    w = jax.device_put(params(), NamedSharding(mesh, P()))
    opt_state = optimizer.init(w)
    with pytest.raises(MemoryError, match=r"needs .* free; it was not run.*microbatches"):
        if state:
            train(train_state.TrainState.create(apply_fn=None, params=w, tx=optimizer), X, KEY)
        else:
            train(w, opt_state, X, KEY)
    assert runs == []
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(w))  # not donated: nothing ran


def test_a_bitwise_train_step_too_big_is_refused_before_it_runs(tiny):
    runs = []
    step = unsplit.value_and_grad(counted_loss(runs), bitwise=True)
    optimizer = optax.sgd(0.1)
    train = unsplit.train_step(step, optimizer)
    with pytest.raises(MemoryError, match=r"it was not run.*smaller chunk_size"):
        train(params(), optimizer.init(params()), X, KEY)
    assert runs == []


@pytest.mark.parametrize("train", [False, True])
def test_the_check_compiles_nothing_more_and_changes_nothing(monkeypatch, train):
    mesh = jax.make_mesh((2,), ("data",))
    w = jax.device_put(params(), NamedSharding(mesh, P()))
    optimizer = optax.sgd(0.1)

    def first_calls():
        step = unsplit.value_and_grad(loss_fn, mesh=mesh)
        if not train:
            with compiles() as seen:
                out = step(w, X, KEY)
                out2 = step(w, X, jax.random.key(5))
            return seen, (out, out2)
        fn = unsplit.train_step(step, optimizer)
        with compiles() as seen:
            one = fn(jax.tree.map(jnp.copy, w), optimizer.init(w), X, KEY)
            two = fn(one[1], one[2], X, KEY)
        return seen, (one[0], two)

    monkeypatch.setenv("UNSPLIT_MEMORY_CHECK", "0")
    first_calls()  # the small programs around the step, compiled once for both runs
    unchecked, out_unchecked = first_calls()
    monkeypatch.setenv("UNSPLIT_MEMORY_CHECK", "1")
    checked, out_checked = first_calls()
    assert len(unchecked) >= 1  # the step's program (a fresh step compiles it again)
    assert len(checked) == len(unchecked)  # lowered and compiled once, then reused
    assert unsplit.testing.bits_equal(out_checked, out_unchecked)


def test_a_second_train_call_compiles_nothing():
    mesh = jax.make_mesh((2,), ("data",))
    w = jax.device_put(params(), NamedSharding(mesh, P()))
    optimizer = optax.adam(1e-2)
    train = unsplit.train_step(unsplit.value_and_grad(loss_fn, mesh=mesh), optimizer)
    opt_state = jax.device_put(optimizer.init(w), NamedSharding(mesh, P()))
    keys = [jax.random.fold_in(KEY, i) for i in range(3)]
    loss, w, opt_state = train(w, opt_state, X, keys[0])
    with compiles() as seen:
        for key in keys[1:]:
            loss, w, opt_state = train(w, opt_state, X, key)
        jax.block_until_ready(loss)
    assert seen == []
