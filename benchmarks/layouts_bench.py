"""unsplit's default step vs a plain jitted step with the same shardings, per params layout.

The plain step is what a user writes without unsplit: ``jax.jit(jax.value_and_grad(loss))``
over the whole batch, the params placed with the same ``NamedSharding`` and the batch
sharded over ``data``. Both compute the same per-example losses (the plain step draws
each example's dropout from the same ``example_keys``), so they do the same work.

Per layout (replicated, FSDP over ``data``, tensor parallel over ``model``, both) on
8 simulated CPU devices, a 2-layer MLP (32 MiB of params, batch 64):

* per-device memory: XLA's compiled memory analysis, arguments + outputs + temp
  (goal: unsplit <= 1.10x plain);
* FLOPs per device: XLA's ``cost_analysis`` (goal <= 1.05x);
* step time: alternating rounds, median ratio with min and max (goal <= 1.05x);
* async dispatch: 5 steps issued back to back; the time until the 5 calls return as a
  fraction of the time until their results are ready (like plain: the call returns
  before the device is done, no host sync).

Run: ``python benchmarks/layouts_bench.py`` (``--quick``: smaller, docs untouched).
"""

from __future__ import annotations

import time

import common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unsplit

MARKER = "layouts"
DOC = "benchmarks.md"
LAYOUTS = {
    "replicated": ((8, 1), {"w1": P(), "w2": P()}),
    "FSDP (data=8)": ((8, 1), {"w1": P("data", None), "w2": P(None, "data")}),
    "tensor parallel (data=4, model=2)": ((4, 2), {"w1": P(None, "model"), "w2": P("model", None)}),
    "FSDP + TP (data=4, model=2)": (
        (4, 2),
        {"w1": P("data", "model"), "w2": P("model", "data")},
    ),
}


def loss_fn(p, x, key):
    h = jax.nn.relu(x @ p["w1"])
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    h = jnp.where(keep, h / 0.9, 0.0)
    return jnp.sum((h @ p["w2"]) ** 2) / h.shape[-1]


def plain_step():
    def batched(p, xs, key):
        keys = unsplit.example_keys(key, jnp.arange(xs.shape[0]))
        return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0, 0))(p, xs, keys))

    return jax.jit(jax.value_and_grad(batched))


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


def async_fraction(fn, n=5) -> float:
    common.block(fn())
    start = time.perf_counter()
    outs = [fn() for _ in range(n)]
    issued = time.perf_counter() - start
    common.block(outs)
    return issued / (time.perf_counter() - start)


def measure(name, shape, specs, host, xs, quick) -> dict:
    key = jax.random.key(0)
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    x = jax.device_put(xs, NamedSharding(mesh, P("data")))
    ours = unsplit.value_and_grad(loss_fn, mesh=mesh)
    plain = plain_step()

    def run_ours():
        return ours(params, x, key)

    def run_plain():
        return plain(params, x, key)

    compiled_ours = ours.lower(params, x, key).compile()
    compiled_plain = plain.lower(params, x, key).compile()
    timing = common.compare(
        {"plain": run_plain, "unsplit": run_ours},
        baseline="plain",
        repeats=3 if quick else 31,
        inner=1 if quick else 3,
    )
    _, grads = run_ours()
    return {
        "layout": name,
        "memory": (common.compiled_bytes(compiled_ours), common.compiled_bytes(compiled_plain)),
        "flops": (flops(compiled_ours), flops(compiled_plain)),
        "time": {r.name: r for r in timing}["unsplit"],
        "async": (async_fraction(run_ours), async_fraction(run_plain)),
        "grads_sharded_like_params": all(grads[k].sharding == params[k].sharding for k in params),
    }


def main() -> None:
    args = common.bench_parser(__doc__).parse_args()
    width = 1024 if args.quick else 2048
    batch = 64
    rng = np.random.default_rng(0)
    host = {
        "w1": rng.normal(0, 0.02, (width, width)).astype(np.float32),
        "w2": rng.normal(0, 0.02, (width, width)).astype(np.float32),
    }
    xs = rng.normal(size=(batch, width)).astype(np.float32)
    rows = [
        measure(name, shape, specs, host, xs, args.quick)
        for name, (shape, specs) in LAYOUTS.items()
    ]
    header = ["layout", "memory per device: unsplit / plain", "FLOPs per device",
              "step time (median, min-max)", "5 calls return at, fraction of done: unsplit / plain",
              "grads sharded like params"]  # fmt: skip
    cells = []
    for r in rows:
        (mo, mp), (fo, fp), t, (ao, ap) = r["memory"], r["flops"], r["time"], r["async"]
        cells.append(
            [
                r["layout"],
                f"{mo / 2**20:.1f} / {mp / 2**20:.1f} MiB ({mo / mp:.2f}x)",
                common.times_cell(common.ratio(fo, fp), 3),
                common.ratio_cell(t),
                f"{ao:.2f} / {ap:.2f}",
                "yes" if r["grads_sharded_like_params"] else "NO",
            ]
        )
    title = f"unsplit default step vs plain jit, same shardings (MLP {width}x{width})"
    common.print_table(title, header, cells)
    if common.should_write(args):
        common.write_table(DOC, MARKER, common.markdown_table(header, cells))


if __name__ == "__main__":
    main()
