"""What the examples share: a schedule's flags and mesh, and its curve beside the one-device one.

``train_clip.py`` and ``train_lora.py`` train the same run on two schedules -- the
reference (1 device, 1 microbatch) and the one their flags name -- and print both loss
curves: they agree to float rounding in default mode and bit for bit with
``--bitwise``. They import this module from their own folder (``python
examples/train_clip.py`` puts it first on ``sys.path``). It imports JAX only inside
its functions: :func:`compare` sets the simulated device count before JAX starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def parser(script: str, doc: str, *, processes: bool, dropout: str) -> argparse.ArgumentParser:
    """The flags of a schedule (``--devices``, ``--microbatches``, ``--bitwise``; with
    ``processes``, ``--processes``) and of the run (``--steps``, ``--batch``,
    ``--dropout``: where ``dropout`` says, ``--seed``)."""
    p = argparse.ArgumentParser(prog=f"python examples/{script}", description=doc.split("\n\n")[0])
    per = " per process" if processes else ""
    p.add_argument("--devices", type=int, default=4, help=f"devices{per} (default 4)")
    if processes:
        p.add_argument("--processes", type=int, default=1, help="local JAX processes (default 1)")
    p.add_argument("--microbatches", type=int, default=2, help="per device (default 2)")
    p.add_argument("--bitwise", action="store_true", help="bit-identical across schedules")
    p.add_argument("--steps", type=int, default=10, help="Adam steps (default 10)")
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--dropout", type=float, default=0.1, help=f"{dropout} (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    return p


def data_mesh(devices: int) -> Any:
    """A ``("data",)`` mesh over the first ``devices`` devices (of every process); ``None``
    for one device (the step's one-device program)."""
    import jax
    import numpy as np

    chosen = jax.devices()[:devices]
    return jax.sharding.Mesh(np.array(chosen), ("data",)) if len(chosen) > 1 else None


def exact(loss: Any) -> str:
    """A loss as the hex of its float32 bytes: curves compare bit for bit."""
    import jax
    import numpy as np

    return np.asarray(jax.device_get(loss), np.float32).tobytes().hex()


def compare(
    args: argparse.Namespace,
    train: Callable[[argparse.Namespace], list[str]],
    run: Callable[[argparse.Namespace], list[str]] | None = None,
) -> int:
    """Trains the reference schedule and ``args``' schedule, prints both curves.

    Args:
        args: the parsed flags (:func:`parser`).
        train: the run on one process: its loss curve (:func:`exact` strings).
        run: the run on ``args``' schedule, when it is not ``train`` (several processes).

    Returns:
        The exit code: 0 when the curves agree (bit for bit with ``--bitwise``, else to a
        relative 1e-4), 1 when they do not.
    """
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={max(args.devices, 1)}"
    )
    import numpy as np

    flags = vars(args)
    one = {"devices": 1, "microbatches": 1, **({"processes": 1} if "processes" in flags else {})}
    reference = train(argparse.Namespace(**{**flags, **one}))
    yours = (run or train)(args)

    def value(h: str) -> float:
        return float(np.frombuffer(bytes.fromhex(h), np.float32)[0])

    label = f"{args.devices} device(s) x {args.microbatches} microbatch(es)"
    if "processes" in flags:
        label = f"{args.processes} process(es) x {label}"
    print(f"step  loss: 1 device, 1 microbatch   loss: {label}")
    for s, (r, y) in enumerate(zip(reference, yours, strict=True)):
        print(f"{s:4d}  {value(r):.7f}                   {value(y):.7f}")
    worst = max(
        abs(value(r) - value(y)) / abs(value(r)) for r, y in zip(reference, yours, strict=True)
    )
    same = reference == yours
    print(f"bit-identical curves: {same}; largest relative difference: {worst:.2e}")
    if args.bitwise and not same:
        print("bitwise mode promised identical bits: this is a bug, please report it")
        return 1
    return 0 if worst <= 1e-4 else 1
