"""Agreement between processes: the messages, the fingerprints, and 2 real processes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import unsplit
from unsplit._src import test_util as tu
from unsplit._src.processes import agreement, launch
from unsplit._src.processes import fingerprint as fp

TIMEOUT = 180  # seconds for the one launch; every process is killed when it expires


# ---- one process: nothing is exchanged, messages and fingerprints ---------------------


def test_one_process_agrees_without_exchanging_and_local_errors_propagate_unchanged():
    assert not agreement.needed()
    agreement.agree({"microbatches": 4}, what="the test")
    with pytest.raises(KeyError, match="mine"), agreement.agreeing("the test") as items:
        items["a"] = 1
        raise KeyError("mine")


def test_mismatch_message_names_the_item_the_processes_their_values_and_the_fix():
    mine = agreement.canonical({"microbatches": 2, "params structure": ["['b']", "['w']"]})
    other = agreement.canonical({"microbatches": 4, "params structure": ["['b']", "['v']"]})
    message = agreement._mismatch_message(
        "the step's first call", [mine, mine, other], {"microbatches": "pass the same k"}
    )
    assert message.startswith(
        "the 3 processes disagree on the microbatches and the params structure in the "
        "step's first call:"
    )
    assert "microbatches: process 0, 1 have 2; process 2 has 4" in message
    assert "Fix: pass the same k." in message
    assert "params structure: at [1]: process 0, 1 have ['w']; process 2 has ['v']" in message
    assert "Fix: every process must pass the same params structure." in message


def test_canonical_forms_are_equal_exactly_when_the_values_are():
    key = jax.random.key(3)
    assert agreement.canonical(key) == agreement.canonical(jax.random.key(3))
    assert agreement.canonical(key) != agreement.canonical(jax.random.key(4))
    assert agreement.canonical(np.float32(1.5)) == 1.5
    assert agreement.canonical(float("nan")) == "nan"
    big = np.arange(1000, dtype=np.int64) + 2**40
    assert agreement.canonical(big) != agreement.canonical(big + 1)  # exact, past 2**32
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert agreement.canonical(mesh)["mesh"] == {"data": 4, "model": 2}


def test_tree_items_describe_structure_shapes_shardings_and_values():
    mesh = jax.make_mesh((2,), ("data",))
    params = {
        "w": np.ones((2, 3), np.float32),
        "b": jax.device_put(jnp.zeros(3), jax.NamedSharding(mesh, jax.P())),
    }
    items = agreement.tree_items("params", params)
    assert items["params structure"] == ["['b']", "['w']"]
    assert items["params shapes and dtypes"] == {"['b']": "float32[3]", "['w']": "float32[2, 3]"}
    assert items["params shardings"]["['w']"] == "host"
    assert items["params shardings"]["['b']"] == "P() over {'data': 2}"
    changed = dict(params, w=np.array([[1, 1, 1], [1, 1, 1.0000001]], np.float32))
    values = items["params values"]
    assert agreement.tree_items("params", dict(params))["params values"] == values
    assert agreement.tree_items("params", changed)["params values"]["['w']"] != values["['w']"]


def test_every_item_of_a_step_has_its_fix():
    mesh = jax.make_mesh((2,), ("data",))
    settings = {"bitwise": False, "microbatches": 2, "chunk_size": None, "weighted": True}
    settings |= {"batch_axes": ("data",), "mesh": mesh}
    batch = {"x": np.ones((4, 3), np.float32)}
    items = agreement.step_items(settings, {"w": np.ones(3)}, batch, jax.random.key(0), None)
    assert set(items) - {"ids"} <= set(agreement.STEP_FIXES)
    items = agreement.step_items(
        settings, {"w": np.ones(3)}, batch, jax.random.key(0), np.arange(4)
    )
    assert set(items) <= set(agreement.STEP_FIXES)
    assert items["batch values"] == {"['x']": agreement.tree_items("b", batch)["b values"]["['x']"]}
    # Every step also agrees on what bits depend on: versions, backend, device kind, XLA flags
    # and the collectives implementation (the order of XLA's reductions inside a group); here
    # also the suite's switch of the bitwise chunk programs' level ("cpu programs").
    assert set(items["process settings"]) - {"cpu programs"} == {
        "jax", "jaxlib", "backend", "device kind", "xla flags", "collectives"
    }  # fmt: skip


def test_fingerprint_sees_one_bit_and_is_the_same_on_any_device_and_sharding():
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    flipped = x.copy()
    flipped.view(np.uint32)[5, 3] ^= 1  # one bit of one element
    base = np.asarray(fp.fingerprint([x]))
    assert not (np.asarray(fp.fingerprint([flipped])) == base).all()
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other positions
    assert not (np.asarray(fp.fingerprint([swapped])) == base).all()
    mesh = jax.make_mesh((8,), ("data",))
    sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data")))
    assert (np.asarray(jax.jit(fp.fingerprint)([sharded])) == base).all()
    # Host words are exact for 64-bit values (JAX would truncate them without x64).
    big = np.array([2**40 + 1, 7], np.int64)
    assert fp.host_fingerprints([big]) != fp.host_fingerprints([big - 2**40])
    bf16 = jnp.ones(3, jnp.bfloat16)
    assert fp.host_fingerprints([np.asarray(bf16)]) == fp.host_fingerprints([bf16])


def _per_device(values, sharding, shape):
    devices = sharding.mesh.devices.flat
    arrays = [jax.device_put(v, d) for v, d in zip(values, devices, strict=True)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


@pytest.mark.parametrize("jit", [False, True])
def test_replicas_agree_compares_every_copy_of_replicated_data(jit):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    check = jax.jit(lambda t: fp.replicas_agree(t, mesh)) if jit else (
        lambda t: fp.replicas_agree(t, mesh)
    )  # fmt: skip
    replicated = jax.NamedSharding(mesh, jax.P())
    same = jax.device_put(jnp.arange(6.0), replicated)
    key = jax.device_put(jax.random.key(0), replicated)
    assert bool(check({"w": same, "key": key}))
    one_off = [np.arange(6.0, dtype=np.float32) + (i == 5) for i in range(8)]
    assert not bool(check({"w": _per_device(one_off, replicated, (6,)), "key": key}))
    # Sharded over "data": only the copies along "model" must agree.
    by_data = jax.NamedSharding(mesh, jax.P("data"))
    blocks = [np.full(2, float(i // 2), np.float32) for i in range(8)]
    specs = [jax.P("data")]
    assert bool(fp.replicas_agree([_per_device(blocks, by_data, (8,))], mesh, specs))
    blocks[3] = blocks[3] + 1
    assert not bool(fp.replicas_agree([_per_device(blocks, by_data, (8,))], mesh, specs))


def test_poison_unless_keeps_integers_and_poisons_floats():
    out = fp.poison_unless(jnp.bool_(False), {"loss": jnp.float32(1), "n": jnp.int32(3)})
    assert bool(jnp.isnan(out["loss"])) and int(out["n"]) == 3
    out = fp.poison_unless(jnp.bool_(True), {"loss": jnp.float32(1)})
    assert float(out["loss"]) == 1.0


# ---- two processes x two devices: every case in one launch ----------------------------


def _attempt(fn):
    try:
        result = fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}" + "".join(f"\n{n}" for n in getattr(e, "__notes__", []))
    return "ok" if result is None else result


def worker_cases():
    """Each case on both processes; returns what each raised (or "ok")."""
    from unsplit._src.processes import global_batch as distributed

    me = jax.process_index()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    params = {"b": np.zeros(3, np.float32), "w": np.ones((2, 3), np.float32)}
    other = {"b": params["b"], "w": params["w"] + (me == 1)}
    settings = {"bitwise": False, "microbatches": 2, "mesh": mesh}

    def agree(items):
        return agreement.agree(items, what="the step's first call")

    def replicated(x):
        return jax.make_array_from_process_local_data(jax.NamedSharding(mesh, jax.P()), x)

    def local_failure():
        with agreement.agreeing("the step's first call") as items:
            items.update(settings)
            if me == 1:
                raise ValueError("batch leaf ['x'] is a scalar (on purpose)")

    def step_first_call(batch, key=None, **changes):
        key = jax.random.key(0) if key is None else key
        items = agreement.step_items({**settings, **changes}, params, batch, key)
        agreement.agree(items, what="the step's first call", fixes=agreement.STEP_FIXES)

    rows = {"x": np.ones((4 if me == 0 else 6, 3), np.float32)}
    rows_equal = {"x": np.ones((4, 3), np.float32)}
    ragged = {"x": np.ones((4, 3), np.float32), "y": np.ones((4 if me == 0 else 5,))}
    traced_key = jax.jit(lambda k: fp.replicas_agree(jax.random.wrap_key_data(k), mesh))
    traced_params = jax.jit(lambda p: fp.replicas_agree(p, mesh))
    # Each process traces its own constant: different programs, the same collectives.
    mine = agreement.signature({"microbatches": 2 + 2 * me})
    traced_settings = jax.jit(lambda: fp.replicas_agree(jnp.asarray(mine), mesh))

    @jax.jit
    def user_step(raw_key, x):  # a user's jitted step: poisons and raises on a mismatch
        ok = fp.replicas_agree(jax.random.wrap_key_data(raw_key), mesh)
        fp.raise_unless(ok, "processes disagree on the step key inside jax.jit")
        return fp.poison_unless(ok, 2.0 * x)

    def run_user_step(raw_key):
        out = user_step(np.asarray(raw_key, np.uint32), np.ones(2, np.float32))
        return np.asarray(out.addressable_data(0)).tolist()

    return {
        "equal": _attempt(lambda: agree({**settings, **agreement.tree_items("params", params)})),
        "settings": _attempt(lambda: agree({**settings, "microbatches": 2 + 2 * me})),
        "step equal": _attempt(lambda: step_first_call({"x": np.ones((4, 3), np.float32)})),
        "step bitwise": _attempt(lambda: step_first_call(rows, bitwise=me == 1)),
        "params": _attempt(lambda: agree(agreement.tree_items("params", other))),
        "replicated params": _attempt(
            lambda: agree(agreement.tree_items("params", replicated(other["w"])))
        ),
        "structure": _attempt(
            lambda: agree(agreement.tree_items("params", {"b": 0.0, f"w{me}": 1.0}))
        ),
        "key": _attempt(lambda: step_first_call(rows_equal, key=jax.random.key(5 + me))),
        "local failure": _attempt(local_failure),
        "rows": _attempt(lambda: distributed.global_batch(rows, mesh, check="always")),
        "ragged": _attempt(lambda: distributed.global_batch(ragged, mesh, check="always")),
        "traced key equal": bool(traced_key(np.array([0, 5], np.uint32))),
        "traced key": bool(traced_key(np.array([0, 5 + me], np.uint32))),
        "traced params": bool(traced_params(other)),
        "traced settings": bool(traced_settings()),
        "user step equal": _attempt(lambda: run_user_step([0, 5])),
        "user step": _attempt(lambda: run_user_step([0, 5 + me])),
        "after": _attempt(lambda: agree(settings)),  # still in step after all the above
    }


MISMATCHES = {
    "settings": r"disagree on the microbatches in the step's first call:\n"
    r"  microbatches: process 0 has 2; process 1 has 4\n    Fix: every process",
    "params": r"disagree on the params values .*at \['w'\]: process 0 has [0-9a-f]{16}; "
    r"process 1 has [0-9a-f]{16}",
    "replicated params": r"disagree on the params values",
    "step bitwise": r"disagree on the bitwise and the batch shapes and dtypes and the batch "
    r"values in the step's first call:\n  bitwise: process 0 has false; process 1 has true\n"
    r"    Fix: build the step with the same bitwise= on every process.\n  batch shapes and "
    r"dtypes: at \['x'\]: process 0 has float32\[4, 3\]; process 1 has float32\[6, 3\]",
    "structure": r"disagree on the params structure in the step's first call:\n  params "
    r"structure: at \[1\]: process 0 has \['w0'\]; process 1 has \['w1'\]\n    Fix: [^\n]*$",
    "key": r"disagree on the step key in the step's first call:\n  step key: process 0 has "
    r"key<threefry2x32>\[\] data \[0, 5\]; process 1 has key<threefry2x32>\[\] data "
    r"\[0, 6\]\n    Fix: derive the key from a shared seed",
    "rows": r"disagree on the local rows in unsplit.global_batch:\n  local rows: process 0 has "
    r"4; process 1 has 6\n    Fix: every process must pass the same number of rows",
}


@pytest.mark.multiprocess
def test_two_processes_agree_or_all_raise_naming_the_difference():
    # One launch for every case (each process runs them in turn): few processes on CI.
    cases = launch.run_local_processes(
        "unsplit._src.processes.agreement_test:worker_cases", timeout_s=TIMEOUT
    )
    # Processes that agree pass, and stay in step after every failure below.
    assert [c["equal"] for c in cases] == ["ok", "ok"]
    assert [c["step equal"] for c in cases] == ["ok", "ok"]
    assert [c["after"] for c in cases] == ["ok", "ok"]
    assert [c["traced key equal"] for c in cases] == [True, True]
    # A mismatch raises on every process, naming the item, the processes and the fix.
    for case, expected in MISMATCHES.items():
        for c in cases:
            assert c[case].startswith("AgreementError: the 2 processes disagree"), c[case]
            assert re.search(expected, c[case], re.S), c[case]
    # A local error on one process raises there and, naming it, on the other one.
    mine, theirs = cases[1]["local failure"], cases[0]["local failure"]
    assert mine.startswith("ValueError: batch leaf ['x'] is a scalar (on purpose)")
    assert "this is process 1 of 2; the other processes were told and raise too" in mine
    assert theirs.startswith(
        "AgreementError: process 1 of 2 failed its local checks in the step's first call"
    )
    assert "process 1: ValueError: batch leaf ['x'] is a scalar (on purpose)" in theirs
    # global_batch's own local checks travel the same way.
    assert cases[1]["ragged"].startswith("ValueError: local_batch leaves have different row")
    assert (
        "process 1: ValueError: local_batch leaves have different row counts"
        in (cases[0]["ragged"])
    )
    # Traced values (a user's jit) that differ between processes are seen on device.
    assert [c["traced key"] for c in cases] == [False, False]
    assert [c["traced params"] for c in cases] == [False, False]
    assert [c["traced settings"] for c in cases] == [False, False]
    # ... and a user's step can raise on every process, from a callback run only then.
    assert [c["user step equal"] for c in cases] == [[2.0, 2.0], [2.0, 2.0]]
    for c in cases:
        assert c["user step"].startswith("JaxRuntimeError"), c["user step"]
        assert "processes disagree on the step key inside jax.jit" in c["user step"]


@pytest.mark.multiprocess
def test_processes_that_disagree_on_the_key_get_a_clear_error():
    with pytest.raises(launch.LaunchError, match=r"processes disagree on the step key"):
        launch.run_local_processes(
            "unsplit._src.processes.global_batch_test:worker_step",
            kwargs={"microbatches": 1, "bitwise": False, "skew_key": True},
            timeout_s=240,
        )


@pytest.mark.multiprocess
def test_processes_that_disagree_inside_their_own_jit_get_an_error_too():
    # The key is traced there: the step compares key, params and settings on device.
    with pytest.raises(
        launch.LaunchError, match=r"disagree on the step key, the params, the frozen inputs or"
    ):
        launch.run_local_processes(
            "unsplit._src.processes.global_batch_test:worker_step",
            kwargs={"microbatches": 2, "bitwise": False, "skew_key": True, "in_jit": True},
            timeout_s=240,
        )


# ---- a step called under the user's jax.set_mesh, on 2 processes ------------------------


def worker_under_set_mesh(names: tuple[str, ...] = ("data", "seq ring")) -> dict:
    """Steps called inside ``with jax.set_mesh(mesh)``, default and bitwise: a (data,) mesh
    of every device with replicated params and the whole batch on every process, and a
    (data, seq) mesh whose loss holds a ring attention over ``seq``. Results as hex."""
    out = {}
    data_mesh = jax.make_mesh((jax.device_count(),), ("data",))
    seq_mesh = jax.make_mesh((jax.device_count() // 4, 4), ("data", "seq"))

    def mlp_loss(p, example, key):
        h = jnp.tanh(example["x"] @ p["q"])
        return jnp.mean(jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h, 0.0) ** 2)

    setups = {
        "data": (data_mesh, mlp_loss),
        "seq ring": (seq_mesh, tu.ring_loss(tu.toy_ring, seq_mesh, "reshard")),
    }
    for name in names:
        mesh, loss = setups[name]
        params = jax.device_put(tu.ring_params(), jax.NamedSharding(mesh, jax.P()))
        for bitwise in (False, True):
            options = {"chunk_size": 2} if bitwise else {}
            step = unsplit.value_and_grad(loss, mesh=mesh, bitwise=bitwise, **options)
            with jax.set_mesh(mesh):
                result = step(params, tu.ring_batch(16), jax.random.key(9))
            out[f"{name} {'bitwise' if bitwise else 'default'}"] = tu.to_hex(
                jax.tree.map(tu.local_value, result)
            )
    return out


@pytest.mark.multiprocess
def test_a_step_under_set_mesh_runs_on_two_processes_in_both_modes():
    # The agreement's fingerprints ran under the user's mesh: "incompatible devices".
    cases = launch.run_local_processes(
        "unsplit._src.processes.agreement_test:worker_under_set_mesh",
        devices_per_process=4,
        timeout_s=TIMEOUT,
    )
    assert cases[0] == cases[1]
    one_process = worker_under_set_mesh()  # the same steps on this process's 8 devices
    for name, hexes in cases[0].items():
        # Bitwise: the same bits as one process, except where a group's sequence axis sums
        # over its devices (the collectives implementation: gloo here; docs/bitwise.md).
        if name == "data bitwise":
            assert hexes == one_process[name], name
        else:
            for a, b in zip(hexes, one_process[name], strict=True):
                x, y = (np.frombuffer(bytes.fromhex(h), np.float32) for h in (a, b))
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7, err_msg=name)
