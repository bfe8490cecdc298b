"""Runs every ``benchmarks/*_bench.py`` in turn; each rewrites its table in docs/benchmarks.md.

Usage::

    python benchmarks/run_all.py            # full runs, tables written into the docs
    python benchmarks/run_all.py --quick    # smoke run: tiny sizes, docs untouched
    python benchmarks/run_all.py scaling    # only the scripts whose name contains "scaling"

Each script runs in its own process (so each sets XLA_FLAGS before importing
jax, and one script's compiled programs do not skew the next one's memory).
The exit status is non-zero if any script failed; the others still run.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def scripts(only: list[str]) -> list[pathlib.Path]:
    found = sorted(HERE.glob("*_bench.py"))
    if only:
        found = [p for p in found if any(name in p.stem for name in only)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="pass --quick to every script (smoke run)"
    )
    parser.add_argument(
        "only", nargs="*", help="run only scripts whose file name contains one of these"
    )
    args = parser.parse_args(argv)
    todo = scripts(args.only)
    if not todo:
        print(f"no benchmarks/*_bench.py matched {args.only}", file=sys.stderr)
        return 2
    failed = []
    for path in todo:
        cmd = [sys.executable, str(path)] + (["--quick"] if args.quick else [])
        print(f"\n=== {path.name}{' --quick' if args.quick else ''}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call(cmd, cwd=HERE.parent)
        print(f"=== {path.name}: exit {rc} after {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(path.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
