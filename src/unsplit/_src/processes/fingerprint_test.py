"""The settings a bitwise step's bits depend on."""

import jax

from unsplit._src.processes import fingerprint


def test_bits_settings_leave_out_the_thread_count(monkeypatch):
    monkeypatch.setenv(
        "XLA_FLAGS",
        "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x --xla_cpu_enable_fast_math=false",
    )
    one = fingerprint.bits_settings()
    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=1"
    )
    assert fingerprint.bits_settings() == one
    assert one["xla flags"] == "--xla_cpu_enable_fast_math=false"
    assert one["jax"] == jax.__version__
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert fingerprint.bits_settings() != one


def test_bits_settings_name_the_collectives_implementation(monkeypatch):
    # A plain process adds in XLA's in-process collectives; under jax.distributed the CPU
    # collectives (gloo) add in another order (tensor-parallel and sequence axes in a group).
    assert fingerprint.bits_settings()["collectives"] == "in-process"
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert fingerprint.collectives("cpu") == "cpu gloo"
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert fingerprint.collectives("gpu") == "nccl NCCL_ALGO=Ring"


def test_the_benchmarks_xla_group_sums_switch_is_a_setting_that_must_match(monkeypatch):
    # It turns FSDP groups' fixed-order sums back into XLA's reduce-scatter: other bits.
    from unsplit._src.bitwise.fsdp import group_reduce

    plain = fingerprint.bits_settings()
    monkeypatch.setenv(group_reduce.BENCH_XLA_ENV, "1")
    assert not group_reduce.fixed_order()
    switched = fingerprint.bits_settings()
    assert switched != plain and "UNSPLIT_BENCH_XLA_GROUP_REDUCE=1" in switched["fsdp group sums"]


def test_the_benchmarks_cpu_level_switch_is_a_setting_that_must_match(monkeypatch):
    # It compiles bitwise CPU programs as XLA fuses them: other bits.
    from unsplit._src.bitwise import canonical_dots

    monkeypatch.delenv(canonical_dots.SUITE_PROCESS_LEVEL_ENV, raising=False)

    plain = fingerprint.bits_settings()
    assert canonical_dots.cpu_options()["xla_backend_optimization_level"] == "3"
    monkeypatch.setenv(canonical_dots.BENCH_DEFAULT_LEVEL_ENV, "1")
    assert not canonical_dots.exact()
    assert "xla_backend_optimization_level" not in canonical_dots.cpu_options()
    switched = fingerprint.bits_settings()
    assert switched != plain and "UNSPLIT_BENCH_CPU_DEFAULT_LEVEL=1" in switched["cpu programs"]


def test_the_suites_chunk_level_switch_is_a_setting_that_must_match(monkeypatch):
    from unsplit._src.bitwise import canonical_dots

    monkeypatch.delenv(canonical_dots.SUITE_PROCESS_LEVEL_ENV, raising=False)
    plain = fingerprint.bits_settings()
    assert canonical_dots.pinned_level() and "cpu programs" not in plain
    assert canonical_dots.cpu_options()["xla_backend_optimization_level"] == "3"
    monkeypatch.setenv(canonical_dots.SUITE_PROCESS_LEVEL_ENV, "1")
    assert not canonical_dots.pinned_level()
    assert "xla_backend_optimization_level" not in canonical_dots.cpu_options()
    switched = fingerprint.bits_settings()
    assert "PROCESS_LEVEL=1" in switched["cpu programs"]
