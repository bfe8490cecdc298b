"""Test setup: 8 simulated CPU devices and strict numerics, set before jax is imported."""

import gc
import os

# XLA's backend (LLVM) optimizations off: compiling is most of a test's time here, and the
# level changes no HLO pass and no order of a reduction (fast math stays off), so what the
# tests compare -- bits across schedules, values against references -- is the same.
# `./dev test-newest` compiles at XLA's default level (UNSPLIT_TEST_XLA_OPTIMIZE=1), so every
# test function's first case also runs on the code users run; the benchmarks do too.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    + (
        []
        if os.environ.get("UNSPLIT_TEST_XLA_OPTIMIZE") == "1"
        else ["--xla_backend_optimization_level=0"]
    )
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Bitwise mode pins its CPU chunk programs to XLA's default level whatever the process's
# flags; here they compile at the suite's level 0 as the rest do (measured: the suite's
# bitwise modules about 30% faster), their rounding identities kept. The modules that test
# the bits across model-parallel degrees and the rounding itself get the pinned level back
# (``users_chunk_level``), and `./dev test-newest` runs everything at the level users get.
if os.environ.get("UNSPLIT_TEST_XLA_OPTIMIZE") != "1":
    os.environ["UNSPLIT_TEST_CHUNK_PROGRAMS_AT_PROCESS_LEVEL"] = "1"

import jax
import pytest

from unsplit._src.bitwise import cache

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="module")
def users_chunk_level():
    """Bitwise CPU chunk programs at XLA's default level, as users compile them (the suite
    compiles them at its level 0 otherwise), for a whole module (its module fixtures too): a
    module that tests the bits across model-parallel degrees asks for it with ``pytestmark =
    pytest.mark.usefixtures("users_chunk_level")``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("UNSPLIT_TEST_CHUNK_PROGRAMS_AT_PROCESS_LEVEL", raising=False)
        yield


@pytest.fixture
def standard_promotion():
    """JAX's standard dtype promotion for a test that runs user-style code (optax mixes
    Python floats and int32), not the tests' strict mode: a module asks for it with
    ``pytestmark = pytest.mark.usefixtures("standard_promotion")``."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def pytest_collection_modifyitems(items):
    """The long tests first (those marked ``slow`` or ``multiprocess``; the rest keep their
    order): pytest-xdist hands out tests in collection order, so a minute-long launch
    collected last would leave one worker running it alone at the end of the suite."""
    items.sort(key=_is_short)  # stable: False (long) before True


def _is_short(item) -> bool:
    return (
        item.get_closest_marker("slow") is None and item.get_closest_marker("multiprocess") is None
    )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop every compiled program JAX and unsplit hold.

    The tests' loss functions live as long as the worker (module globals, cached
    helpers), so the programs compiled for them would too: XLA's CPU runtime maps
    each executable's code into the process, and a worker running the whole suite
    reached the kernel's limit on mappings (``vm.max_map_count``, 65530), where the
    next compile crashed with a segmentation fault.
    """
    yield
    cache.clear()
    jax.clear_caches()
    gc.collect()
