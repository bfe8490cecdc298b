"""``chunk_size_for``: the largest chunk every listed schedule accepts, and its errors.

The returned chunk is checked on real bitwise steps: a small MLP's loss and
grads on each listed device count of the 8 simulated devices (replicated, and
FSDP groups with ``chunk_axes``) are bit-identical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import unsplit
from unsplit._src import test_util as testing
from unsplit._src.bitwise import chunk_size
from unsplit._src.bitwise.blocked.values import block_count
from unsplit._src.bitwise.chunk_size import chunk_size_for
from unsplit._src.step import memory

AUTO = AxisType.Auto


@pytest.mark.parametrize(
    "batch,devices,group,at_most,want",
    [
        (64, (1, 8, 64), 1, None, 1),  # the last device holds one example
        (512, (1, 8, 64), 1, None, 8),
        (512, (1, 8), 1, None, 64),
        (512, (1, 8), 1, 16, 16),
        (512, (1, 8), 1, 24, 16),  # the largest divisor of 64 not above 24
        (48, (2, 3), 1, None, 8),  # shares 24 and 16: gcd 8
        (12, 3, 1, None, 4),
        (96, (4, 8), 4, None, 48),  # one or two groups of 4: shares 96 and 48
        (24, (2, 4, 8), 2, None, 6),  # shares 24, 12, 6; multiples of 2
        (16, (4,), 4, 6, 4),
        (64, 8, (2, 4, 8), None, 16),  # 8 row blocks of 2 rows: groups of 2, 4, 8 share them
        (32, (4, 8), (2, 4), None, 8),  # 4 row blocks of 2 rows
        (64, (4, 8), (2, 4), 8, 8),
    ],
)
def test_largest_valid_chunk(batch, devices, group, at_most, want):
    got = chunk_size_for(batch, devices, group_devices=group, at_most=at_most)
    assert got == want
    counts = (devices,) if isinstance(devices, int) else devices
    groups = (group,) if isinstance(group, int) else group
    for d in counts:  # every schedule's rule, read from the definition
        for g in groups:
            share = batch // (d // g)
            assert got % g == 0 and share % got == 0
            if len(groups) > 1:  # the row blocks every group size shares
                assert block_count(got, 8) % g == 0


def test_default_devices():
    assert unsplit.chunk_size_for(4096) == 64  # (1, 8, 64): the 64-device share


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(global_batch=100, batch_devices=(1, 8)), ValueError, "8 does not divide 100"),
        (
            dict(global_batch=16, batch_devices=(2, 3), group_devices=2),
            ValueError,
            "multiple of 2 .*3 is not",
        ),
        (
            dict(global_batch=12, batch_devices=(2, 4), group_devices=4),
            ValueError,
            "multiple of 4 .*2 is not",
        ),
        (
            dict(global_batch=16, batch_devices=(4,), group_devices=4, at_most=2),
            ValueError,
            "multiple of 4, at most at_most=2; got none.*at_most >= 4",
        ),
        (dict(global_batch=0), TypeError, "global_batch must be a positive int"),
        (dict(global_batch=8.0), TypeError, "global_batch must be a positive int"),
        (dict(global_batch=8, batch_devices=()), TypeError, "non-empty sequence"),
        (dict(global_batch=8, batch_devices=(1, 0)), TypeError, r"with \[0\]"),
        (dict(global_batch=8, batch_devices="8"), TypeError, "positive ints"),
        (dict(global_batch=8, group_devices=True), TypeError, "group_devices must be"),
        (dict(global_batch=8, group_devices=()), TypeError, "group_devices must be.*non-empty"),
        (dict(global_batch=8, group_devices=(2, 0)), TypeError, "group_devices must be"),
        (
            dict(global_batch=64, batch_devices=8, group_devices=(1, 4)),
            ValueError,
            r"lists 1 beside larger groups.*group_devices=\(4,\)",
        ),
        (
            dict(global_batch=32, batch_devices=8, group_devices=(2, 4, 8)),
            ValueError,
            r"groups of \(2, 4, 8\) devices share its row blocks.*\[8\] have \[4\] row blocks"
            r".*16 or more rows per group",
        ),
        (
            dict(global_batch=64, batch_devices=8, group_devices=(2, 4, 8), blocks=4),
            ValueError,
            r"at most blocks=4.*Fix: blocks=8",
        ),
        (
            dict(global_batch=144, batch_devices=6, group_devices=(2, 3)),
            ValueError,
            "Fix: group sizes that are powers of two",
        ),
        (
            dict(global_batch=24, batch_devices=6, group_devices=(2, 3)),
            ValueError,
            r"a multiple of 6\) and divides every group's share.*\[8, 12\].*multiple of 36",
        ),
        (
            dict(global_batch=64, batch_devices=(4, 8), group_devices=(2, 4), at_most=2),
            ValueError,
            "multiple of 4, at most at_most=2",
        ),
        (dict(global_batch=8, blocks=0), TypeError, "blocks must be"),
        (dict(global_batch=8, blocks=6), ValueError, "blocks must be a power of two.*blocks=6"),
        (dict(global_batch=8, at_most=0), TypeError, "at_most must be"),
    ],
)
def test_errors_say_what_was_expected_got_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        chunk_size_for(**kwargs)
    assert "Fix:" in str(info.value)


# ---- the returned chunk on real bitwise steps ----

IN, HIDDEN = 4, 8


def mlp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) * 0.5,
        "w2": jax.random.normal(k2, (HIDDEN, 1)) * 0.5,
    }


def mlp_loss(params, example, key):
    del key
    hidden = jnp.tanh(example["x"] @ params["w1"])
    return jnp.sum((hidden @ params["w2"] - example["y"]) ** 2)


def mlp_batch(size):
    x = jax.random.normal(jax.random.key(1), (size, IN))
    return {"x": x, "y": jnp.sin(x[:, :1])}


def bitwise_step(batch, chunk, data, group):
    """One bitwise step on ``data * group`` devices (FSDP groups of ``group`` when > 1)."""
    params = mlp_params()
    if group == 1:
        mesh = jax.make_mesh((data,), ("data",), axis_types=(AUTO,))
        extra = {}
    else:
        devices = np.array(jax.devices()[: data * group]).reshape(data, group)
        mesh = Mesh(devices, ("data", "fsdp"), axis_types=(AUTO, AUTO))
        params = testing.replicated(
            jax.tree.map(np.asarray, params), mesh, testing.fsdp_specs(params, "fsdp", group)
        )
        extra = {"batch_axes": ("data", "fsdp"), "chunk_axes": "fsdp"}
    step = unsplit.value_and_grad(
        mlp_loss, mesh=mesh, bitwise=True, chunk_size=chunk, weighted=False, **extra
    )
    return step(params, batch, jax.random.key(2))


@pytest.mark.parametrize(
    "size,devices,group",
    [
        (24, (1, 2, 4, 8), 1),  # shares 24, 12, 6 and 3: chunk 3
        (32, (1, 2, 8), 1),  # shares 32, 16 and 4: chunk 4
        (24, (2, 4, 8), 2),  # groups of 2: shares 24, 12 and 6: chunk 6
    ],
)
@pytest.mark.filterwarnings(
    "ignore::unsplit._src.bitwise.schedule.GroupSizeWarning"
)  # 1 row per device
def test_the_chunk_gives_the_same_bits_on_every_listed_device_count(size, devices, group):
    chunk = chunk_size_for(size, devices, group_devices=group)
    batch = mlp_batch(size)
    outs = [bitwise_step(batch, chunk, d // group, group) for d in devices]
    for out in outs[1:]:
        assert testing.bits_equal(out, outs[0])
    # A larger chunk than the one returned fails on the schedule with the smallest share.
    with pytest.raises(ValueError, match="whole number of chunks"):
        bitwise_step(batch, 2 * chunk, devices[-1] // group, group)


def test_the_chunk_for_several_group_sizes_gives_their_groups_the_same_bits():
    # Groups of 2 and 4 devices over 4 or 8 batch devices: 4 schedules, chunk 8 of 4 row blocks.
    chunk = chunk_size_for(32, (4, 8), group_devices=(2, 4))
    assert chunk == 8
    batch = mlp_batch(32)
    outs = [bitwise_step(batch, chunk, d // g, g) for d in (4, 8) for g in (2, 4)]
    for out in outs[1:]:
        assert testing.bits_equal(out, outs[0])


# ---- with a step: the largest chunk that fits the devices' memory ----

WIDE = 1024  # each example's activations: (64, WIDE) floats, so a chunk's grow with it


def wide_loss():
    """A new loss function each time: its compiled programs are its own (bitwise mode keeps
    them per loss function, and checks a program's memory when it compiles it)."""

    def loss(w, x, key):
        hidden = jnp.tanh(x[:, None] * w[None, :])
        return jnp.sum(hidden * jax.random.uniform(key, hidden.shape))

    return loss


WIDE_INPUTS = (jnp.ones(WIDE), jnp.ones((32, 64)), jax.random.key(0))


@pytest.fixture
def needed(monkeypatch):
    """chunk -> what the memory check reads of its program (``memory.needed_bytes``)."""
    seen = []
    check = memory.check

    def recording(compiled, fix, devices=None):
        seen.append(memory.needed_bytes(compiled))
        return check(compiled, fix, devices)

    with monkeypatch.context() as patch:
        patch.setattr(memory, "check", recording)
        for c in (8, 16, 32):
            unsplit.value_and_grad(wide_loss(), bitwise=True, chunk_size=c)(*WIDE_INPUTS)
    assert len(seen) == 3 and seen[0] < seen[1] < seen[2], seen  # activations grow
    return dict(zip((8, 16, 32), seen, strict=True))


def free_memory(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device: nbytes)


def fitted(loss=None, **kwargs) -> int:
    step = unsplit.value_and_grad(loss or wide_loss(), bitwise=True)
    w, x, key = WIDE_INPUTS
    return chunk_size_for(32, 1, step=step, params=w, batch=x, key=key, **kwargs)


def test_a_chunk_too_big_for_the_memory_check_is_not_picked(monkeypatch, needed):
    # The arithmetic alone picks 32 (one chunk), which the memory check refuses here.
    free_memory(monkeypatch, needed[32] - 1)
    with pytest.raises(MemoryError, match="it was not run"):
        unsplit.value_and_grad(wide_loss(), bitwise=True, chunk_size=32)(*WIDE_INPUTS)
    loss = wide_loss()
    chunk = fitted(loss)
    assert chunk == 16
    unsplit.value_and_grad(loss, bitwise=True, chunk_size=chunk)(*WIDE_INPUTS)  # runs


def test_the_chunk_leaves_the_margin_the_step_needs_beside_its_program(monkeypatch, needed):
    # Chunk 32 would pass the check alone (its program fits, barely), but not with the
    # headroom; chunk 16 leaves its partial sum and the headroom: picked.
    free = needed[32] + 1
    assert needed[32] + int(chunk_size.HEADROOM * free) > free
    free_memory(monkeypatch, free)
    assert fitted() == 16
    # With room for both, the largest; capped by at_most as without a step.
    free_memory(monkeypatch, 2 * needed[32])
    assert fitted() == 32
    assert fitted(at_most=8) == 8


def test_the_fitting_chunk_is_found_in_few_compiles(monkeypatch, needed):
    free_memory(monkeypatch, needed[8] + needed[8] // 2)
    probed = []
    verdict = chunk_size._verdict
    monkeypatch.setattr(chunk_size, "_verdict", lambda *a: probed.append(a[2]) or verdict(*a))
    assert fitted() == 8
    assert probed == [32, 4, 16, 8]  # the largest, then bisection over 1..16


def test_when_no_chunk_fits_the_error_says_what_was_needed_and_the_fix(monkeypatch, needed):
    free_memory(monkeypatch, 1024)
    with pytest.raises(
        ValueError, match=r"no chunk size fits.*chunk_size=1, .*needs .*free.*Fix: chunk_axes"
    ):
        fitted()


def test_the_memory_check_turned_off_is_not_applied(monkeypatch, needed):
    free_memory(monkeypatch, 1024)
    monkeypatch.setenv("UNSPLIT_MEMORY_CHECK", "0")
    assert fitted() == 32


@pytest.mark.parametrize(
    "step,kwargs,error,match",
    [
        (dict(), {}, TypeError, "compiles a bitwise step's chunk programs"),
        (dict(bitwise=True, batch_loss=lambda p, f: jnp.sum(f)), {}, TypeError, "batch_loss"),
        (dict(bitwise=True), dict(params=None), TypeError, r"got no \['params'\]"),
        (dict(bitwise=True), dict(batch=jnp.ones((16, 64))), ValueError, "batch of 16 examples"),
    ],
)
def test_step_errors_say_what_was_expected_got_and_the_fix(step, kwargs, error, match):
    w, x, key = WIDE_INPUTS
    inputs = {"params": w, "batch": x, "key": key, **kwargs}
    made = unsplit.value_and_grad(wide_loss(), **step)
    with pytest.raises(error, match=match) as info:
        chunk_size_for(32, 1, step=made, **inputs)
    assert "Fix:" in str(info.value)


def test_the_picked_chunks_program_is_kept_for_the_step(monkeypatch, needed):
    free_memory(monkeypatch, needed[16] + needed[16] // 2)
    loss = wide_loss()
    chunk = fitted(loss)
    assert chunk == 16
    checked = []
    monkeypatch.setattr(memory, "check", lambda *args, **kwargs: checked.append(args))
    step = unsplit.value_and_grad(loss, bitwise=True, chunk_size=chunk)
    jax.block_until_ready(step(*WIDE_INPUTS))
    assert checked == []  # its chunk program was compiled (and checked) by chunk_size_for


def test_a_step_with_frozen_inputs_is_fitted_with_them(monkeypatch, needed):
    def loss(w, x, key, frozen):  # frozen: a scale, never differentiated
        hidden = jnp.tanh(x[:, None] * (w * frozen)[None, :])
        return jnp.sum(hidden * jax.random.uniform(key, hidden.shape))

    free_memory(monkeypatch, needed[32] - 1)
    w, x, key = WIDE_INPUTS
    step = unsplit.value_and_grad(loss, bitwise=True)
    frozen = jnp.full(WIDE, 0.5)
    chunk = chunk_size_for(32, 1, step=step, params=w, batch=x, key=key, frozen=frozen)
    assert chunk == 16
    unsplit.value_and_grad(loss, bitwise=True, chunk_size=chunk)(w, x, key, frozen=frozen)
