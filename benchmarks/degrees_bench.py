"""Bitwise mode at every tensor-parallel degree: time and memory per device beside default mode.

An MLP of 1024 -> 4096 -> 1024 (8.4M params, dropout after the activation), batch 64,
on 8 (simulated) devices, Megatron's layout (the up projection column-parallel, the down
projection row-parallel) at (data, model) = (8, 1), (4, 2), (2, 4), (1, 8), and
replicated and FSDP params at data=8 for comparison. Each row: bitwise and default mode
measured side by side (alternating rounds: the ratio is per round), the memory per
device of each (XLA's compiled memory analysis: the peak over a bitwise step's programs),
and whether the bitwise loss and grads are bit-identical to the (4, 2) layout's. Two last
rows, for comparison: bitwise mode at (4, 2) and replicated with its CPU programs compiled
as XLA fuses them (the library's measuring switch ``UNSPLIT_BENCH_CPU_DEFAULT_LEVEL=1``: no
product rounded on its own; bits then held across data degrees, not across model-parallel
degrees). The table goes
into docs/benchmarks.md (marker ``degrees``).

    python benchmarks/degrees_bench.py           # full run, writes the table
    python benchmarks/degrees_bench.py --quick   # a smoke run (small MLP), no write
    python benchmarks/degrees_bench.py --chunks  # only the cost against chunks per group
"""

from __future__ import annotations

import common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit

LAYOUTS = [("tensor parallel", d, m) for d, m in [(8, 1), (4, 2), (2, 4), (1, 8)]]
OTHERS = [("replicated", 8, 1), ("FSDP over data", 8, 1)]
BATCH = 64
# The chunk every layout here accepts (8 rows at batch 64: what bitwise mode takes without
# `chunk_size`), from the public API rather than restated.
DEFAULT_CHUNK = unsplit.chunk_size_for(BATCH, batch_devices=[d for _, d, _ in LAYOUTS])


def loss_fn(params, x, key):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = unsplit.dropout(key, h, 0.1)
    y = h @ params["w2"] + params["b2"]
    return jnp.mean((y - x) ** 2)


def specs(kind: str) -> dict:
    if kind == "tensor parallel":
        return {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    if kind == "FSDP over data":
        return {"w1": P("data", None), "b1": P(), "w2": P("data", None), "b2": P()}
    return {k: P() for k in ("w1", "b1", "w2", "b2")}


def inputs(kind: str, data: int, model: int, width: int, hidden: int):
    mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    host = {
        "w1": rng.normal(size=(width, hidden)).astype(np.float32) / np.sqrt(width),
        "b1": np.zeros(hidden, np.float32),
        "w2": rng.normal(size=(hidden, width)).astype(np.float32) / np.sqrt(hidden),
        "b2": np.zeros(width, np.float32),
    }
    s = specs(kind)
    params = {k: jax.device_put(v, NamedSharding(mesh, s[k])) for k, v in host.items()}
    x = jax.device_put(
        rng.normal(size=(BATCH, width)).astype(np.float32), NamedSharding(mesh, P("data"))
    )
    return mesh, params, x


def row(kind, data, model, width, hidden, repeats, reference, default_level=False, chunk=None):
    mesh, params, x = inputs(kind, data, model, width, hidden)
    key = jax.random.key(0)
    steps = {
        "default": unsplit.value_and_grad(loss_fn, mesh=mesh),
        "bitwise": unsplit.value_and_grad(loss_fn, mesh=mesh, bitwise=True, chunk_size=chunk),
    }
    with common.cpu_default_level(default_level):  # read when the programs compile
        out = jax.device_get(steps["bitwise"](params, x, key))
    same = (
        kind != "tensor parallel" or reference is None or unsplit.testing.bits_equal(out, reference)
    )
    memory = {m: common.step_memory(s, params, x, key) for m, s in steps.items()}
    failed: dict[str, str] = {}
    results = common.compare(
        {m: (lambda s=s: s(params, x, key)) for m, s in steps.items()},
        baseline="default", repeats=repeats, inner=1, failed=failed,
    )  # fmt: skip
    by = {r.name: r for r in results}
    bitwise = by.get("bitwise")
    return out, [
        f"{kind}, CPU programs as XLA fuses them" if default_level else kind,
        f"({data}, {model})",
        f"{by['default'].median_s * 1e3:.0f} ms" if "default" in by else failed["default"],
        f"{bitwise.median_s * 1e3:.0f} ms" if bitwise else failed["bitwise"],
        common.ratio_cell(bitwise) if bitwise else "n/a",
        f"{memory['default'] / 2**20:.1f} MiB",
        f"{memory['bitwise'] / 2**20:.1f} MiB",
        common.times_cell(common.ratio(memory["bitwise"], memory["default"])),
        ("yes" if same else "NO") if kind == "tensor parallel" and not default_level else "-",
    ]


def chunks_table(width: int, hidden: int, repeats: int, write: bool) -> None:
    """Each tensor-parallel layout at the default chunk (8 rows: the chunk every layout here
    accepts, so their bits agree) and at one chunk per group (its rows per group: its bits
    agree with every layout whose groups hold a multiple of them). Marker ``degrees-chunks``."""
    rows = []
    for kind, data, model in LAYOUTS:
        per_group = BATCH // data
        for chunk in sorted({DEFAULT_CHUNK, per_group}):
            _, cells = row(kind, data, model, width, hidden, repeats, None, chunk=chunk)
            rows.append(
                [cells[1], str(per_group), str(chunk), str(per_group // chunk), *cells[2:5]]
            )
            print(" | ".join(rows[-1]), flush=True)
    header = [
        "(data, model)", "rows per group", "chunk size", "chunks per group", "default step",
        "bitwise step", "bitwise / default (rounds)",
    ]  # fmt: skip
    common.print_table("bitwise mode's cost and the chunks per group", header, rows)
    if write:
        body = (
            f"MLP {width} -> {hidden} -> {width} with dropout, batch {BATCH}, 8 devices, "
            f"tensor parallel; median of {repeats} alternating rounds.\n\n"
            + common.markdown_table(header, rows)
        )
        print("wrote", common.write_table("benchmarks.md", "degrees-chunks", body))


def main() -> None:
    parser = common.bench_parser(__doc__)
    parser.add_argument(
        "--chunks", action="store_true", help="only the table of cost against chunks per group"
    )
    args = parser.parse_args()
    width, hidden, repeats = (64, 256, 2) if args.quick else (1024, 4096, 15)
    if args.chunks:
        chunks_table(width, hidden, repeats, common.should_write(args))
        return
    rows, reference = [], None
    for kind, data, model in [LAYOUTS[1], LAYOUTS[0], *LAYOUTS[2:], *OTHERS]:
        out, cells = row(kind, data, model, width, hidden, repeats, reference)
        if reference is None and kind == "tensor parallel":
            reference = out  # (4, 2): the first row
        rows.append(cells)
        print(" | ".join(cells), flush=True)
    # For comparison: bitwise mode with its CPU programs as XLA fuses them (bits then
    # held across data degrees, not across model-parallel degrees): what exactness costs.
    for kind, data, model in (LAYOUTS[1], OTHERS[0]):
        _, cells = row(kind, data, model, width, hidden, repeats, None, default_level=True)
        rows.append(cells)
        print(" | ".join(cells), flush=True)
    header = [
        "params", "(data, model)", "default step", "bitwise step", "bitwise / default (rounds)",
        "default memory per device", "bitwise memory per device", "memory ratio",
        "bits = (4, 2)'s",
    ]  # fmt: skip
    common.print_table("bitwise mode at every tensor-parallel degree", header, rows)
    if common.should_write(args):
        body = (
            f"MLP {width} -> {hidden} -> {width} with dropout, batch 64, 8 devices; "
            f"median of {repeats} alternating rounds.\n\n" + common.markdown_table(header, rows)
        )
        print("wrote", common.write_table("benchmarks.md", "degrees", body))


if __name__ == "__main__":
    main()
