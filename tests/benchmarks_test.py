"""The benchmark scripts' own machinery, on CPU: what an accelerator run would meet.

On a TPU the first run of the benchmarks stopped twice (issue 39): ``common.compare``
divided by the baseline's process CPU time, which is 0 there (the work runs on the
chip), and the realistic check's one-chunk-per-device row, refused by the memory check,
took the whole table with it. Benchmarks are not timed tests: nothing here asserts a speed.
"""

import os
import sys
import time

import example_scripts
import jax
import jax.numpy as jnp
import pytest


@pytest.fixture
def common():
    with example_scripts.loaded("common", example_scripts.BENCHMARKS) as module:
        yield module


def test_compare_reports_no_cpu_ratio_where_the_baseline_took_no_cpu_time(common, monkeypatch):
    # An accelerator's host: the process's CPU time does not move while the device works.
    monkeypatch.setattr(time, "process_time", lambda: 7.0)
    calls = {"plain": lambda: jnp.ones(4), "ours": lambda: jnp.ones(4) * 2}
    results = common.compare(calls, baseline="plain", repeats=3, inner=1, warmup=1)
    ours = next(r for r in results if r.name == "ours")
    assert ours.ratio_median > 0  # wall time still measured
    assert common.times_cell(ours.cpu_ratio_median) == "n/a"


def test_ratios_of_nothing_are_not_a_number(common):
    assert common.times_cell(common.ratio(2.0, 0)) == "n/a"
    assert common.times_cell(common.ratio(3.0, 2.0)) == "1.50x"
    assert common.times_cell(common.median_ratio([1.0, 5.0, 2.0], [0.0, 0.0, 1.0])) == "2.00x"


def test_compare_measures_the_others_when_one_candidate_raises(common):
    calls = {
        "plain": lambda: jnp.ones(4),
        "refused": lambda: (_ for _ in ()).throw(MemoryError("RESOURCE_EXHAUSTED: too big")),
        "ours": lambda: jnp.ones(4) + 1,
    }
    failed = {}
    results = common.compare(calls, baseline="plain", repeats=3, inner=1, warmup=1, failed=failed)
    assert [r.name for r in results] == ["plain", "ours"]
    assert failed == {"refused": "failed: MemoryError: RESOURCE_EXHAUSTED: too big"}
    with pytest.raises(MemoryError):  # without a dict for them, a failure stops the run
        common.compare(calls, baseline="plain", repeats=1, inner=1, warmup=0)


def test_a_row_that_raises_is_reported_and_the_others_measured(common):
    step = jax.jit(lambda x: x * 2)
    x = jnp.ones(8)

    def row(fn):
        return common.Candidate(call=lambda: fn(x), memory=lambda: 1024)

    def refused():
        raise MemoryError(
            "RESOURCE_EXHAUSTED: unsplit: the step's program needs 15.25 GiB on TPU_0, "
            "and the device has 14.28 GiB free; it was not run."
        )

    def fails_later():  # builds and runs once, then fails in the timed rounds
        calls = []

        def call():
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("INTERNAL: the second call failed")
            return step(x)

        return common.Candidate(call=call, memory=lambda: 2048)

    rows = {
        "plain": lambda: row(step),
        "refused": refused,
        "fails later": fails_later,
        "ours": lambda: row(jax.jit(lambda x: x + 1)),
    }
    table = common.measure_rows(rows, baseline="plain", repeats=3)
    by_name = {line.split(" | ")[0].removeprefix("| "): line for line in table[2:]}
    assert list(by_name) == list(rows)  # every row reported, in order
    assert "failed: MemoryError: RESOURCE_EXHAUSTED" in by_name["refused"]
    assert "needs 15.25 GiB" in by_name["refused"]
    assert "failed: RuntimeError: INTERNAL: the second call failed" in by_name["fails later"]
    for name in ("plain", "ours"):  # measured: a time ratio, a first call, memory 1.00x
        cells = by_name[name].split(" | ")
        assert cells[1].endswith(")") and cells[3].endswith(" s") and cells[-1] == "1.00x |"


def test_rows_past_the_time_budget_are_skipped_and_said(common):
    x = jnp.ones(8)
    row = common.Candidate(call=lambda: x + 1, memory=lambda: 0)
    left = iter([100.0, 5.0])
    table = common.measure_rows(
        {"plain": lambda: row, "late": lambda: row},
        baseline="plain",
        repeats=1,
        time_left=lambda: next(left),
        row_s=30,
    )
    assert "| late | skipped (time) |" in table[-1]
    assert "n/a" in table[2]  # memory 0 bytes: no ratio, no ZeroDivisionError


DOC = """# Benchmarks

<!-- t:start -->
cpu table
<!-- t:end -->

## Accelerators

How they run.

## Next section

More.
"""


def test_an_accelerators_table_goes_beside_the_cpus_in_its_section(common, monkeypatch, tmp_path):
    (tmp_path / "benchmarks.md").write_text(DOC)
    monkeypatch.setattr(common, "DOCS", tmp_path)
    monkeypatch.setattr(common, "environment_line", lambda: "Measured on 1 x NVIDIA H200.")
    monkeypatch.setattr(common, "accelerator", lambda: "gpu")
    common.write_table("benchmarks.md", "t", "gpu table")
    common.write_table("benchmarks.md", "t", "gpu table, again")  # replaced, not added
    text = (tmp_path / "benchmarks.md").read_text()
    assert "cpu table" in text and "gpu table\n" not in text
    accelerators, rest = text.split("## Accelerators", 1)[1].split("## Next section")
    assert (
        "<!-- t-gpu:start -->\ngpu table, again\n\nMeasured on 1 x NVIDIA H200.\n" in accelerators
    )
    assert text.count("t-gpu:start") == 1 and "gpu" not in rest
    monkeypatch.setattr(common, "accelerator", lambda: None)  # on CPU: the CPU's table
    common.write_table("benchmarks.md", "t", "cpu table, again")
    assert "cpu table, again" in (tmp_path / "benchmarks.md").read_text().split("## Accel")[0]


@pytest.fixture
def device_check():
    with example_scripts.loaded("device_check", example_scripts.BENCHMARKS) as module:
        yield module


def test_a_part_stopped_for_time_keeps_what_it_had_written(device_check, tmp_path):
    report = device_check.Report(tmp_path / "part.md")
    report += ["### A part", ""]
    report.append("| row 1 | measured |")
    assert (tmp_path / "part.md").read_text() == "### A part\n\n| row 1 | measured |\n"
    # A process past its share is stopped, and what it printed comes back.
    code = "import time; print('row 1', flush=True); time.sleep(30)"
    status, out = device_check.run([sys.executable, "-c", code], seconds=3)
    assert status is None and "row 1" in out
    status, out = device_check.run([sys.executable, "-c", "raise SystemExit(3)"], seconds=30)
    assert status == 3


def test_the_reports_heading_names_the_device_among_the_backends_warnings(device_check):
    # Seen on a TPU v5e: the runtime's warning came after the probe's line.
    out = ("tpu | 1 | TPU v5 lite | jax 0.10.2, jaxlib 0.10.2\n"
           "cloud_tpu_init.py:88: UserWarning: Transparent hugepages are not enabled.\n"
           "  warnings.warn(\n")  # fmt: skip
    platform_name, head = device_check.heading(0, out)
    assert platform_name == "tpu"
    assert head[0] == "## Device check: 1 x TPU v5 lite (tpu)"
    assert device_check.heading(1, "Traceback ...\n")[0] == "unknown"


def test_the_cpu_default_level_switch_is_the_librarys_and_is_restored(common, monkeypatch):
    # The library reads this name (canonical_dots.BENCH_DEFAULT_LEVEL_ENV; its fingerprint
    # test pins the same string).
    name = "UNSPLIT_BENCH_CPU_DEFAULT_LEVEL"
    assert name == common.CPU_DEFAULT_LEVEL_ENV
    monkeypatch.delenv(name, raising=False)
    with common.cpu_default_level():
        assert os.environ[name] == "1"
    assert name not in os.environ
    monkeypatch.setenv(name, "1")  # set by the caller: kept
    with common.cpu_default_level(False):
        assert os.environ[name] == "1"
    assert os.environ[name] == "1"
