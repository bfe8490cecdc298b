"""The core alone: ``pip install unsplit`` (JAX, NumPy, optax, rich) runs the whole core API.

CI runs this file in a fresh venv where only the built wheel and its core
dependencies are installed. In the full development venv, the same checks run
in a subprocess that blocks the extras' libraries (Flax, Equinox, grain, orbax,
matplotlib) from being imported, so both places test the core without them.
"""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

EXTRAS = ("flax", "equinox", "grain", "orbax", "matplotlib")

# A plain-JAX model: an MLP with unsplit's functional dropout, written for one example.
CORE_PROGRAM = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import unsplit

    loaded = sorted({m.split(".")[0] for m, mod in sys.modules.items() if mod} & set(EXTRAS))
    assert not loaded, f"import unsplit imported {loaded}"

    def loss_fn(params, example, key):
        h = jnp.tanh(example["x"] @ params["w1"])
        h = unsplit.dropout(key, h, 0.1)
        return jnp.mean((h @ params["w2"] - example["y"]) ** 2)

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (4, 8)), "w2": jax.random.normal(k2, (8, 2))}
    batch = {"x": np.ones((16, 4), np.float32), "y": np.zeros((16, 2), np.float32)}
    key = jax.random.key(1)

    keys = unsplit.example_keys(key, jnp.arange(3))
    assert jax.random.key_data(keys[2]).tolist() == jax.random.key_data(
        jax.random.fold_in(key, 2)).tolist()

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    l1, g1 = unsplit.value_and_grad(loss_fn)(params, batch, key)
    l2, g2 = unsplit.value_and_grad(loss_fn, microbatches=2, mesh=mesh)(params, batch, key)
    assert abs(float(l1) - float(l2)) < 1e-5, (l1, l2)

    bitwise = [unsplit.value_and_grad(loss_fn, bitwise=True, chunk_size=4, microbatches=m, mesh=mesh_)
               for m, mesh_ in ((1, None), (2, mesh))]
    (b1, h1), (b2, h2) = (step(params, batch, key) for step in bitwise)
    assert unsplit.testing.bits_equal((b1, h1), (b2, h2))

    optimizer = optax.adamw(1e-2)
    train = unsplit.train_step(bitwise[0], optimizer)
    loss, new_params, state = train(params, optimizer.init(params), batch, key)
    assert unsplit.bitwise_train_step is unsplit.train_step

    assert unsplit.audit(loss_fn, params, batch, key) == []
    rows, ids = unsplit.global_batch(batch, mesh)
    assert ids.tolist() == list(range(16))

    for name, extra in (("linen", "flax"), ("nnx", "flax"), ("models", "flax"),
                        ("equinox", "equinox"), ("data", "data"), ("checkpoint", "checkpoint")):
        try:
            getattr(unsplit, name)
        except ImportError as e:
            assert f"pip install 'unsplit[{extra}]'" in str(e), str(e)
        else:
            raise AssertionError(f"unsplit.{name} imported without its extra")
    print("core ok")
    """
)

# Makes the extras' libraries unimportable, as in a venv without them: a None entry in
# sys.modules makes `import flax` raise ModuleNotFoundError and find_spec return None.
BLOCKER = textwrap.dedent(
    """
    import sys
    for name in EXTRAS:
        sys.modules[name] = None
    """
)


def extras_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in EXTRAS)


def run_core_program(block_extras: bool) -> subprocess.CompletedProcess:
    code = f"EXTRAS = {EXTRAS!r}\n" + (BLOCKER if block_extras else "") + CORE_PROGRAM
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )


def test_the_core_api_runs_without_any_extra():
    if os.environ.get("UNSPLIT_EXPECT_WHEEL"):  # ./dev test-core: the installed wheel, not src/
        import unsplit

        assert "site-packages" in unsplit.__file__, unsplit.__file__
        assert not extras_installed()
    done = run_core_program(block_extras=extras_installed())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "core ok" in done.stdout


def test_the_cli_help_audit_example_runs_on_the_core():
    # `unsplit audit --help` shows this command: it runs without any extra.
    code = (
        f"EXTRAS = {EXTRAS!r}\n"
        + (BLOCKER if extras_installed() else "")
        + (
            "import sys\nfrom unsplit import cli\n"
            "sys.exit(cli.main(['audit', 'unsplit.audit_corpus.batched:same_key_microbatches']))\n"
        )
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "batch_draw" in done.stdout, done.stdout


@pytest.mark.skipif(
    not os.environ.get("UNSPLIT_EXPECT_WHEEL"), reason="./dev test-core: the installed wheel"
)
def test_the_wheel_holds_the_library_alone_with_its_type_hints():
    files = [str(f) for f in importlib.metadata.files("unsplit") or ()]
    assert "unsplit/py.typed" in files
    assert "unsplit/_src/front/value_and_grad.py" in files
    tests = [f for f in files if f.endswith(("_test.py", "test_util.py"))]
    assert not tests, f"tests are not for the wheel: {tests}"
    assert importlib.metadata.version("unsplit") == __import__("unsplit").__version__


@pytest.mark.skipif(not extras_installed(), reason="the extras are not installed (core venv)")
def test_the_integrations_import_when_their_extras_are_installed():
    import unsplit

    for name in ("linen", "nnx", "models", "equinox", "data", "checkpoint"):
        assert getattr(unsplit, name).__name__ == f"unsplit.{name}"
