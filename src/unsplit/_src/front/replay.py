"""Replaying a recorded step on another layout, with a per-leaf digest comparison.

A bitwise step's loss and grads are a function of (params, batch, ids, key,
frozen inputs) and the bitwise options, not of the layout: data, model,
sequence and expert degrees, FSDP group sizes (dividing the canonical blocks),
microbatches and processes. :func:`record` runs a step and keeps a SHA-256
digest of every leaf of its inputs and outputs (:class:`StepRecord`, saved as
JSON); :func:`replay` runs the same step on this process's layout and compares:
first the inputs (a replay of other params or another batch is not the same
step, and says which leaf differs), then the outputs, leaf by leaf, naming the
first that differs (:class:`ReplayReport`).

Example:
    >>> import jax, jax.numpy as jnp, unsplit
    >>> def loss_fn(w, x, key):
    ...     return jnp.sum(jnp.where(jax.random.bernoulli(key, 0.9, (2,)), jnp.tanh(x @ w), 0.0))
    >>> step = unsplit.value_and_grad(loss_fn, bitwise=True)
    >>> w, x = jnp.ones((3, 2)), jnp.arange(48.0).reshape(16, 3) / 48
    >>> rec = unsplit.record_step(step, w, x, jax.random.key(0), step_number=7)
    >>> step4 = unsplit.value_and_grad(loss_fn, bitwise=True, microbatches=4)
    >>> report = unsplit.replay_step(step4, w, x, jax.random.key(0), against=rec)
    >>> report.match, report.first_difference
    (True, None)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from unsplit._src import keys as keys_lib


def _host(x: Any) -> np.ndarray:
    """A leaf's whole value on this host (gathered from every process when needed)."""
    if isinstance(x, jax.Array) and keys_lib.is_typed_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def digests(tree: Any) -> dict[str, str]:
    """Each leaf's SHA-256 (of its dtype, shape and bytes), keyed by its path.

    Example:
        >>> import numpy as np
        >>> d = digests({"w": np.zeros((2,), np.float32), "n": None})
        >>> list(d), len(d["['w']"])
        (["['w']"], 64)
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.ascontiguousarray(_host(leaf))
        h = hashlib.sha256(f"{x.dtype.str}{x.shape}".encode())
        h.update(x.tobytes())
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """A step's digests: its inputs and its outputs (loss, aux, grads), leaf by leaf.

    ``layout`` says where it was recorded (for the report only); ``settings`` the
    bitwise options that fix the bits (a replay with other ones is refused). ``save`` and
    ``load`` keep it in a file; ``to_json`` and ``from_json`` in a string (a run's metadata,
    a checkpoint's extra item).
    """

    inputs: dict[str, str]
    outputs: dict[str, str]
    layout: dict[str, Any]
    settings: dict[str, Any]
    step_number: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StepRecord:
        return cls(**json.loads(text))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> StepRecord:
        with open(path) as f:
            return cls.from_json(f.read())


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    """What a replay found: ``match`` when every input and output leaf is bit-identical.

    ``rows`` are ``(leaf, recorded digest, replayed digest, equal)`` for the inputs
    (``['inputs']...``) then the outputs (``['outputs']...``); ``first_difference`` the first
    leaf that differs (None when all match). ``inputs_match`` tells whether the replay was
    given the recorded inputs (params, batch, key, ids): when it was not, a difference in the
    outputs says nothing about the layouts.
    """

    rows: list[tuple[str, str, str, bool]]
    recorded_layout: dict[str, Any]
    layout: dict[str, Any]

    @property
    def inputs_match(self) -> bool:
        return all(ok for name, _, _, ok in self.rows if name.startswith("['inputs']"))

    @property
    def match(self) -> bool:
        return all(ok for *_, ok in self.rows)

    @property
    def first_difference(self) -> str | None:
        return next((name for name, _, _, ok in self.rows if not ok), None)

    def __str__(self) -> str:
        lines = [f"recorded on {self.recorded_layout}, replayed on {self.layout}"]
        for name, want, got, ok in self.rows:
            lines.append(f"  {'same' if ok else 'DIFF'}  {name}  {want[:12]}  {got[:12]}")
        if self.match:
            lines.append("every leaf is bit-identical")
        elif not self.inputs_match:
            lines.append(
                f"the inputs differ ({self.first_difference}): this is not the recorded step. "
                "Fix: restore the recorded step's params (its checkpoint), batch, ids and key."
            )
        else:
            lines.append(f"first differing output leaf: {self.first_difference}")
        return "\n".join(lines)


def _layout(step: Any) -> dict[str, Any]:
    options = step.options
    mesh = options.mesh
    return {
        "mesh": None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()},
        "microbatches": options.microbatches,
        "processes": jax.process_count(),
    }


def _settings(step: Any) -> dict[str, Any]:
    bitwise = step.options.bitwise
    if bitwise is None:
        return {"bitwise": False}
    return {"bitwise": True, "chunk_size": bitwise.chunk_size, "blocks": bitwise.blocks}


def _run(step, params, batch, key, ids, frozen, step_number):
    kwargs = {} if frozen is None else {"frozen": frozen}
    if step_number is not None:
        key = jax.random.fold_in(key, step_number)
    inputs = {"params": params, "batch": batch, "ids": ids, "key": key}
    if frozen is not None:
        inputs["frozen"] = frozen
    out = step(params, batch, key, ids, **kwargs)
    return digests({"inputs": inputs}), digests({"outputs": out})


def record_step(
    step, params, batch, key, ids=None, *, frozen=None, step_number: int | None = None
) -> StepRecord:
    """Runs ``step`` (made by :func:`unsplit.value_and_grad`) and records its digests.

    ``step_number``: the key of step ``N`` of a run is ``fold_in(key, N)`` (as the
    README's loop makes it); give the run's key and ``N`` to record that step.
    """
    ins, outs = _run(step, params, batch, key, ids, frozen, step_number)
    return StepRecord(ins, outs, _layout(step), _settings(step), step_number)


def replay_step(
    step, params, batch, key, ids=None, *, frozen=None, against: StepRecord
) -> ReplayReport:
    """Runs ``step`` on this layout and compares its digests with ``against``'s.

    Raises ValueError when the step's bitwise settings are not the recorded ones
    (other settings are other bits by design).
    """
    settings = _settings(step)
    if settings != against.settings:
        raise ValueError(
            f"the replaying step's settings {settings} are not the recorded step's "
            f"{against.settings}: they fix the bits, so the replay would differ by design. "
            "Fix: build the step with the recorded bitwise options (chunk_size, blocks)."
        )
    ins, outs = _run(step, params, batch, key, ids, frozen, against.step_number)
    rows = []
    for recorded, got in ((against.inputs, ins), (against.outputs, outs)):
        for name in sorted(set(recorded) | set(got), key=list({**recorded, **got}).index):
            want, have = recorded.get(name, "-"), got.get(name, "-")
            rows.append((name, want, have, want == have))
    return ReplayReport(rows, against.layout, _layout(step))


def parse_mesh(text: str | None) -> jax.sharding.Mesh | None:
    """``"data=4,model=2"`` as a mesh over this process's first devices (Auto axes); None
    for no text (the step then runs without a mesh)."""
    if not text:
        return None
    try:
        pairs = [part.split("=") for part in text.split(",")]
        names, sizes = zip(*((n.strip(), int(s)) for n, s in pairs), strict=True)
    except ValueError:
        raise ValueError(
            f"--mesh expects AXIS=SIZE pairs separated by commas; got {text!r}. Fix: e.g. "
            "--mesh data=4,model=2."
        ) from None
    count = int(np.prod(sizes))
    if count > len(jax.devices()):
        raise ValueError(
            f"--mesh {text} needs {count} devices; this process has {len(jax.devices())}. Fix: "
            "a smaller mesh (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N)."
        )
    return jax.make_mesh(
        sizes, names, devices=jax.devices()[:count],
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
    )  # fmt: skip


def run_factory(
    factory, mesh_text: str | None, *, save: str | None, against: str | None
) -> tuple[str, bool]:
    """The CLI's replay: ``factory(mesh)`` builds the step and its inputs on ``--mesh``;
    records them to ``save``, or replays them against the record in ``against``. Returns
    the text to print (a :class:`ReplayReport`, or where the record went) and whether
    every leaf matched (True for a record)."""
    made = factory(parse_mesh(mesh_text))
    missing = {"step", "params", "batch", "key"} - set(made)
    if missing:
        raise ValueError(
            f"the factory returned a dict without {sorted(missing)}. Fix: return "
            "dict(step=..., params=..., batch=..., key=...) (and ids=, frozen=, step_number=)."
        )
    args = (made["step"], made["params"], made["batch"], made["key"], made.get("ids"))
    if save is not None:
        rec = record_step(*args, frozen=made.get("frozen"), step_number=made.get("step_number"))
        rec.save(save)
        return f"recorded {len(rec.outputs)} output leaves on {rec.layout} to {save}", True
    assert against is not None
    report = replay_step(*args, frozen=made.get("frozen"), against=StepRecord.load(against))
    return str(report), report.match
