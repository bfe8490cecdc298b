"""The accelerator check: the device tests, bitwise bits and every benchmark in one call.

Run on a machine with a GPU or TPU (the one prepared call; ``./dev device-check`` runs
it with the flags and paths it needs)::

    python benchmarks/device_check.py --budget 540 --out-dir $OUT

It sets the flags bitwise mode needs on GPU (``--xla_gpu_deterministic_ops=true
--xla_gpu_autotune_level=0``), then runs its parts **each in a process of its own**,
in this order, each within its share of ``--budget`` seconds (a part that runs out of
time says what it skipped; a part that fails or dies is reported with the reason, and
the next one runs):

1. ``tests``: the device test suite, ``pytest -m device tests/device_test.py``
   (bitwise bits over microbatches and chunk layouts, ``train_step``, ``batch_loss``,
   the dropout kernels against their reference, default mode against the user's own
   jitted step, the memory check and ``chunk_size_for``);
2. ``timing``: the user's own jitted step (the baseline), default mode and bitwise mode
   (the default chunk, one chunk per device, the largest chunk that fits) on the small
   test transformer and on a 4-layer width-256 one at batch 32: time, first call
   (compile) and memory (``device_parts.timing``);
3. ``realistic`` (``realistic_check.py``): the rows of ``timing`` at GPT-2-small size,
   and a ``jax.profiler`` summary of a bitwise step;
4. ``benches``: ``dropout_bench.py`` and ``attention_bench.py`` at full size, their
   tables written into docs/benchmarks.md (the dropout layers against Flax's, attention
   with dropout against Flax's without);
5. ``precision``: default mode's grads across microbatches, bitwise's and the user's
   jitted step's against default mode, at the backend's default matmul precision and
   at ``"highest"``;
6. ``grid``: bitwise bits over the devices found and microbatches, and AdamW steps
   through ``unsplit.train_step``;
7. ``coupled``: a contrastive step (``batch_loss``);
8. ``others``: every other ``benchmarks/*_bench.py``, full size, tables written (a
   bench that needs more devices than the machine has fails fast, with its reason).

``--parts`` picks parts (comma-separated; they run in the order given, each with its
share scaled up when the budget exceeds the shares of the parts picked). Each part runs in a
process of its own: a TPU chip is held by one process at a time, a part that dies
(out of memory, a crash) takes nothing else with it, and each starts with the
device's memory free.

With ``--out-dir`` (default: ``$OUT`` when set) it writes ``device_check.md`` (the
report, headed by the device's name), ``device_tests.log`` (the test suite's output)
and every page of docs/ the run changed (``benchmarks.md`` with the tables the benches wrote
and the report under the marker ``device-check-<platform>``; ``rule.md`` if the trajectory
bench ran): copy them over docs/ and read the diff. ``--no-write`` leaves the docs alone. On CPU
(no accelerator) the parts run small and write nothing, as a smoke run (``--tiny``
runs small anywhere; ``--write`` writes anyway).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

GPU_FLAGS = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
BUDGET_S = 9 * 60  # one call of the device tool: at most 10 minutes
# (part, the most seconds it may take): shares of the budget, in the order they run.
PARTS = {
    "tests": 360,  # 18 tests: 330 s on the lent TPU v5e (compiles of 15-25 s each)
    "timing": 100,
    "realistic": 270,
    "benches": 120,
    "precision": 60,
    "grid": 60,
    "coupled": 45,
    "others": 600,
}
FIRST_BENCHES = ("dropout_bench.py", "attention_bench.py")
# Benches that measure simulated CPU devices whatever the machine has: not an accelerator's.
CPU_ONLY = {
    "agreement_bench.py": "it measures 2 processes of simulated CPU devices (gloo)",
    "chunk_split_bench.py": "it measures what XLA:CPU makes of two chunks on 8 CPU devices",
}
RESERVE_S = 10  # for the report at the end
MARKER = "device-check"


def setup_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        flags += " " + GPU_FLAGS
    if "xla_force_host_platform_device_count" not in flags:
        flags += " --xla_force_host_platform_device_count=8"  # used only on CPU
    os.environ["XLA_FLAGS"] = flags.strip()


class Report(list):
    """Markdown lines, written to ``path`` as they come: a part stopped for time keeps
    what it had measured."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = path

    def _flush(self) -> None:
        self.path.write_text("\n".join(self) + "\n")

    def append(self, line) -> None:
        super().append(line)
        self._flush()

    def __iadd__(self, lines):
        super().__iadd__(lines)
        self._flush()
        return self


def child(part: str, report: pathlib.Path, seconds: float, tiny: bool) -> int:
    """Runs one in-process part (``--child``), its lines written to ``report``."""
    end = time.monotonic() + seconds

    def left() -> float:
        return end - time.monotonic()

    sys.path.insert(0, str(HERE))
    lines = Report(report)
    try:
        if part == "realistic":
            import realistic_check

            realistic_check.realistic(lines, tiny=tiny, time_left=left)
        else:
            import device_parts

            getattr(device_parts, part)(lines, left)
    except Exception as error:  # the part's own failure: reported, not raised
        lines += ["", f"{part} failed: {type(error).__name__}: {error}", "", "```",
                  traceback.format_exc(limit=-6).strip()[-3000:], "```"]  # fmt: skip
    return 0


def run(cmd: list[str], seconds: float, env: dict | None = None) -> tuple[int | None, str]:
    """``cmd``'s exit status (``None``: stopped after ``seconds``) and its output."""
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(seconds, 1), env=env
        )
    except subprocess.TimeoutExpired as stopped:
        out = (stopped.stdout or b"") + (stopped.stderr or b"")
        return None, out.decode(errors="replace") if isinstance(out, bytes) else out
    return done.returncode, done.stdout + done.stderr


def tests_part(seconds: float, out_dir: pathlib.Path | None) -> list[str]:
    env = dict(os.environ, UNSPLIT_TEST_XLA_OPTIMIZE="1")
    env.setdefault("JAX_PLATFORMS", "")  # the accelerator (conftest would pick the CPU)
    cmd = [sys.executable, "-m", "pytest", "-m", "device", "tests/device_test.py",
           "-p", "no:cacheprovider", "-W", "default", "-v", "-rfEsx", "--durations=10"]  # fmt: skip
    status, out = run(cmd, seconds, env)
    if out_dir is not None:
        (out_dir / "device_tests.log").write_text(out)
    # A line per test as it ends (kept if the run is stopped), then the reasons and the total.
    outcomes = (" PASSED", " FAILED", " SKIPPED", " XFAIL", " XPASS", " ERROR")
    ended = [line for line in out.splitlines() if "::" in line and any(o in line for o in outcomes)]
    tail = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED"))]
    summary = ended + tail + out.strip().splitlines()[-1:]
    said = "stopped after its share of the time" if status is None else f"exit {status}"
    return ["", f"### Device tests: `pytest -m device tests/device_test.py` ({said})", "",
            "```", *summary[-60:], "```"]  # fmt: skip


def bench_part(scripts: list[str], seconds: float, write: bool, tiny: bool) -> list[str]:
    lines: list[str] = []
    end = time.monotonic() + seconds
    for script in scripts:
        if script in CPU_ONLY and not tiny:
            lines += ["", f"{script}: not run on an accelerator ({CPU_ONLY[script]})"]
            continue
        left = end - time.monotonic()
        if left < 15:
            lines += ["", f"{script}: skipped (time)"]
            continue
        flags = (["--quick"] if tiny else []) + (["--write"] if write else ["--no-write"])
        start = time.monotonic()
        status, out = run([sys.executable, str(HERE / script), *flags], left)
        took = time.monotonic() - start
        said = "stopped after its share of the time" if status is None else f"exit {status}"
        lines += ["", f"### {script} {' '.join(flags)} ({said}, {took:.0f} s)", "", "```",
                  out.strip()[-3500:], "```"]  # fmt: skip
    return lines


PROBE = """
import importlib.metadata
import jax

def version(name):
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"no {name}"

d = jax.devices()[0]
packages = ", ".join(version(n) for n in ("jax", "jaxlib", "flax", "optax", "equinox"))
print(d.platform, "|", jax.device_count(), "|", d.device_kind, "|", packages)
"""


def probe() -> tuple[str, list[str]]:
    """The backend's platform and the report's heading, read in a process of its own (this
    one never opens the device: a TPU chip is held by one process at a time)."""
    status, out = run([sys.executable, "-c", PROBE], 180)
    return heading(status, out)


def heading(status: int | None, out: str) -> tuple[str, list[str]]:
    """The platform and heading from the probe's exit status and output."""
    # The probe's line, wherever the backend's warnings (on stderr, merged) put it: a TPU's
    # runtime warns after the line is printed.
    lines = [line for line in out.splitlines() if line.count("|") == 3] or [""]
    fields = [f.strip() for f in lines[-1].split("|")]
    if status != 0 or len(fields) != 4:
        return "unknown", [f"## Device check: no device found ({out.strip()[-500:]})"]
    platform_name, count, kind, version = fields
    return platform_name, [
        f"## Device check: {count} x {kind} ({platform_name})",
        "",
        f"{version}; XLA_FLAGS={os.environ['XLA_FLAGS']}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}"
    )
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds in all")
    parser.add_argument("--out-dir", type=pathlib.Path, help="report, logs, docs (default $OUT)")
    parser.add_argument("--tiny", action="store_true", help="small sizes everywhere (smoke run)")
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the tables into docs/benchmarks.md (default: on an accelerator only)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--report", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    setup_flags()
    if args.child:
        return child(args.child, args.report, args.budget, args.tiny)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: expected some of {tuple(PARTS)}, got {unknown}")
    out_dir = args.out_dir or (pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    docs = {path: path.read_text() for path in (ROOT / "docs").glob("*.md")}
    platform_name, head = probe()
    small = args.tiny or platform_name == "cpu"
    write = platform_name not in ("cpu", "unknown") if args.write is None else args.write
    lines: list[str] = []
    skipped: list[str] = []
    for index, part in enumerate(parts):
        left = args.budget - (time.monotonic() - start) - RESERVE_S
        # Its share, scaled up when the budget exceeds what the parts still to run ask for.
        asked = sum(PARTS[p] for p in parts[index:])
        share = min(PARTS[part] * max(1.0, left / asked), left)
        if share < 20:
            lines += ["", f"{part}: skipped (time)"]
            skipped.append(part)
            continue
        print(f">> {part} (up to {share:.0f} s)", flush=True)
        begun = time.monotonic()
        if part == "tests":
            lines += tests_part(share, out_dir)
        elif part in ("benches", "others"):
            scripts = list(FIRST_BENCHES) if part == "benches" else [
                p.name for p in sorted(HERE.glob("*_bench.py")) if p.name not in FIRST_BENCHES
            ]  # fmt: skip
            lines += bench_part(scripts, share, write, small)
        else:
            report = pathlib.Path(tempfile.mkstemp(suffix=".md")[1])
            cmd = [sys.executable, __file__, "--child", part, "--report", str(report),
                   "--budget", str(share - 5)] + (["--tiny"] if small else [])  # fmt: skip
            status, out = run(cmd, share)
            lines += report.read_text().splitlines() if report.exists() else []
            if status != 0:  # died or stopped: what it had measured is above
                said = "stopped after its share of the time" if status is None else f"exit {status}"
                lines += ["", f"{part}: {said}", "", "```", out.strip()[-2000:], "```"]
            report.unlink(missing_ok=True)
        print(f">> {part}: {time.monotonic() - begun:.0f} s", flush=True)
    lines += ["", f"Total {time.monotonic() - start:.0f} s (budget {args.budget:.0f} s)."]
    if skipped:
        lines += ["", f"Not run (time): {', '.join(skipped)}. Next: `./dev device-check --parts "
                  f"{','.join(skipped)}`."]  # fmt: skip
    text = "\n".join(head + lines)
    print(text)
    if out_dir is not None:
        (out_dir / "device_check.md").write_text(text + "\n")
    if write:
        sys.path.insert(0, str(HERE))
        import common

        common.write_table("benchmarks.md", MARKER, text)
    if out_dir is not None:  # the pages the benches and the report wrote, to copy back
        for path, before in docs.items():
            if path.read_text() != before:
                shutil.copy(path, out_dir / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
