"""How the cost of ``unsplit.value_and_grad`` grows with batch size, microbatches and devices.

One run times every schedule side by side (``common.compare``: alternating
rounds, median with min and max) as a ratio to one reference row -- global
batch 32, ``microbatches=1``, no mesh -- and reports XLA's compiled temp memory
of each program (per device for a mesh). Rows vary one thing at a time:

* batch size 16, 32, 64 (``microbatches=1``, no mesh);
* microbatches 1, 2, 4, 8 at the reference batch;
* devices 1, 2, 4, 8: a ``jax.make_mesh`` over that many of the 8 simulated
  CPU devices (``--xla_force_host_platform_device_count=8``) at the reference
  batch. On CPU the simulated devices share the same cores, so this group is no
  accelerator speed-up: it checks that splitting the batch (one SPMD program,
  XLA's collectives) adds no overhead. Ratios below 1 there only
  mean that several simulated devices, run concurrently, keep the cores busier
  than one device's program does.

The step is the test transformer's weighted token loss with dropout, jitted,
with the batch already placed on the mesh (data loading is not timed).

Run: ``python benchmarks/scaling_bench.py`` (``--quick`` for a smoke run that
does not touch the docs).
"""

from __future__ import annotations

import dataclasses
import os

import common
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit
from unsplit.models import (
    Transformer,
    TransformerConfig,
    init_params,
    synthetic_batch,
    token_loss,
)

MARKER = "scaling"
DOC = "benchmarks.md"


@dataclasses.dataclass(frozen=True)
class Setup:
    config: TransformerConfig
    reference_batch: int
    batches: tuple[int, ...]
    microbatches: tuple[int, ...]
    devices: tuple[int, ...]
    repeats: int
    inner: int
    warmup: int


FULL = Setup(
    config=TransformerConfig(vocab=256, length=64, width=128, heads=4, layers=2),
    reference_batch=32,
    batches=(16, 32, 64),
    microbatches=(1, 2, 4, 8),
    devices=(1, 2, 4, 8),
    repeats=27,
    inner=1,
    warmup=1,
)
QUICK = Setup(
    config=TransformerConfig(),
    reference_batch=16,
    batches=(8, 16),
    microbatches=(1, 4),
    devices=(1, 4),
    repeats=2,
    inner=1,
    warmup=1,
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    group: str
    batch: int
    microbatches: int
    devices: int | None  # None: no mesh

    @property
    def name(self) -> str:
        mesh = "no mesh" if self.devices is None else f"mesh of {self.devices}"
        return f"B={self.batch}, microbatches={self.microbatches}, {mesh}"


def schedules(setup: Setup) -> list[Schedule]:
    ref = setup.reference_batch
    out = [Schedule("reference", ref, 1, None)]
    out += [Schedule("batch size", b, 1, None) for b in setup.batches if b != ref]
    out += [Schedule("microbatches", ref, k, None) for k in setup.microbatches if k != 1]
    out += [Schedule("devices", ref, 1, n) for n in setup.devices]
    return out


def prepare(s: Schedule, model: Transformer, params, seed_key):
    """The jitted step, and its arguments placed where a data loader would put them."""
    mesh = None
    if s.devices is not None:
        mesh = jax.make_mesh((s.devices,), ("data",), devices=jax.devices()[: s.devices])
    step = unsplit.value_and_grad(
        token_loss(model), weighted=True, microbatches=s.microbatches, mesh=mesh
    )
    batch = synthetic_batch(model.config, s.batch, seed=1)
    if mesh is not None:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        seed_key = jax.device_put(seed_key, NamedSharding(mesh, P()))

    def fn(params, batch, key):
        return step(params, batch, key)

    jitted = jax.jit(fn)
    args = (params, batch, seed_key)
    return (lambda: jitted(*args)), common.compiled_temp_bytes(fn, *args)


def run(setup: Setup) -> tuple[list[list[str]], str]:
    model = Transformer(setup.config)
    params = init_params(model)
    seed_key = jax.random.key(0)
    plan = schedules(setup)
    candidates, memory = {}, {}
    for s in plan:
        candidates[s.name], memory[s.name] = prepare(s, model, params, seed_key)
    ref = plan[0]
    results = {
        r.name: r
        for r in common.compare(
            candidates,
            baseline=ref.name,
            repeats=setup.repeats,
            inner=setup.inner,
            warmup=setup.warmup,
        )
    }
    rows = []
    for s in plan:
        r = results[s.name]
        per_example = r.ratio_median * ref.batch / s.batch
        rows.append(
            [
                s.group,
                str(s.batch),
                str(s.microbatches),
                "-" if s.devices is None else str(s.devices),
                common.ratio_cell(r),
                f"{per_example:.2f}x",
                f"{memory[s.name] / 2**20:.1f} MiB",
                common.times_cell(common.ratio(memory[s.name], memory[ref.name])),
            ]
        )
    c = setup.config
    n_params = sum(x.size for x in jax.tree.leaves(params))
    text = (
        f"Model: the test transformer (`TransformerConfig(vocab={c.vocab}, length={c.length}, "
        f"width={c.width}, heads={c.heads}, layers={c.layers})`, {n_params:,} parameters, "
        f"dropout on), `unsplit.value_and_grad(token_loss, weighted=True, ...)` jitted, no "
        f"optimizer. Reference row: {ref.name} (median {results[ref.name].median_s * 1e3:.0f} "
        f"ms, for scale only). Timing: {setup.repeats} alternating rounds over all rows, each "
        f"the mean of {setup.inner} steps. *Devices* are the 8 simulated CPU devices "
        f"(`--xla_force_host_platform_device_count=8`) sharing the same "
        f"{os.cpu_count()} cores, so that group is not an accelerator speed-up: it shows that "
        f"splitting the batch over a mesh (one SPMD program, XLA's collectives) adds no "
        f"overhead, and a ratio "
        f"below 1 only means several simulated devices running concurrently keep the cores "
        f"busier than one device's program does. On real accelerators each device brings its "
        f"own compute. Memory is per device for a mesh; microbatches cut it by about 1/k."
    )
    return rows, text


HEADER = [
    "varies",
    "batch",
    "microbatches",
    "devices",
    "time vs reference: median (min-max)",
    "time per example vs reference",
    "XLA temp memory",
    "memory vs reference",
]


def render(rows, text: str) -> str:
    return (
        "### Scaling: batch size, microbatches, devices\n\n"
        f"{text}\n\n{common.markdown_table(HEADER, rows)}\n"
    )


def print_table(rows, text: str) -> None:
    print(text)
    common.print_table("unsplit.value_and_grad scaling", HEADER, rows, width=150)


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(__doc__)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    rows, text = run(setup)
    print_table(rows, text)
    write = common.should_write(args)
    if write:
        print(f"wrote {common.write_table(DOC, MARKER, render(rows, text))}")


if __name__ == "__main__":
    main()
