"""Topology-free data order: the records of global step ``s`` from ``(seed, epoch, s)`` alone.

A training run that can be resumed on another topology needs more than a
schedule-invariant step: the *same records* must form global step ``s``
whatever the number of processes and devices, and a resumed run must pick up
at the right place. :func:`global_steps` defines that order on a ``grain``
random-access dataset:

* epoch ``e`` reads the dataset in grain's shuffled order for ``seed``
  (``dataset.shuffle(seed=seed)``, which reshuffles every epoch);
* the epoch is cut into ``len(dataset) // global_batch`` global batches; step
  ``s`` is batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``.
  The ``len(dataset) % global_batch`` records at the end of an epoch's order
  are skipped (a different few every epoch), so no step mixes two epochs and
  no record appears twice in one step;
* each process reads only **its own rows** of the step (the rows its devices
  hold on the mesh's batch axis, in the layout ``unsplit.global_batch``
  expects), by random access: nothing else of the dataset is read or copied;
* every row comes with its **record index** as global id, so its noise
  ``fold_in(step_key, record)`` does not depend on where the row lands.

The position in the data is the step number: save it with the checkpoint and
index the same :class:`GlobalSteps` with it after a restart, on any topology.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src.processes import global_batch as distributed


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What fixes the data order; a resumed run must keep all three."""

    seed: int
    global_batch: int
    records: int  # len(dataset): a dataset that grows or shrinks reorders every epoch


class GlobalSteps(grain.MapDataset):
    """A ``grain.MapDataset`` of global steps: element ``s`` is this process's rows of step ``s``.

    Made by :func:`global_steps`. ``steps[s]`` returns ``(rows, ids)``: the
    process's rows of global step ``s`` stacked into one pytree of NumPy arrays
    (leading axis: its rows) and their record indices (``int64``), ready for
    ``unsplit.global_batch(rows, mesh, ids)``. Being a ``MapDataset`` it can be
    sliced (``steps[start:]``) and read ahead by grain
    (``steps[start:].to_iter_dataset()``).
    """

    def __init__(self, dataset, *, settings: DataSettings, positions: np.ndarray, num_epochs):
        self._stream = dataset.shuffle(seed=settings.seed)
        super().__init__(self._stream)
        self._order = grain.MapDataset.range(settings.records).shuffle(seed=settings.seed)
        self.settings = settings
        self.positions = positions
        self.num_epochs = num_epochs

    @property
    def steps_per_epoch(self) -> int:
        """Global steps in one epoch: ``len(dataset) // global_batch``."""
        return self.settings.records // self.settings.global_batch

    def __len__(self) -> int:
        if self.num_epochs is None:
            return sys.maxsize
        return self.num_epochs * self.steps_per_epoch

    def __str__(self) -> str:
        s = self.settings
        return f"GlobalSteps(seed={s.seed}, global_batch={s.global_batch}, records={s.records})"

    def epoch(self, step: int) -> int:
        """The epoch global step ``step`` belongs to."""
        return self._check_step(step) // self.steps_per_epoch

    def records(self, step: int) -> np.ndarray:
        """Record indices of global step ``step``, in global-batch order (``int64[B]``).

        The same on every process and topology: a function of
        ``(seed, epoch, step)`` and the dataset's length.
        """
        return self._records(step, np.arange(self.settings.global_batch))

    def local_records(self, step: int) -> np.ndarray:
        """Record indices of this process's rows of global step ``step``."""
        return self._records(step, self.positions)

    def __getitem__(self, step):
        if isinstance(step, slice):
            return self.slice(step)
        epoch, first = self._first_position(step)
        rows, ids = [], []
        for p in self.positions.tolist():
            at = epoch * self.settings.records + first + p
            element = self._stream[at]
            if element is None:
                raise ValueError(
                    f"record {self._order[at]} of global step {step} is None (a grain filter "
                    "dropped it); a global step needs exactly global_batch records. Fix: "
                    "filter the dataset before global_steps (e.g. into a new source), not lazily."
                )
            rows.append(element)
            ids.append(self._order[at])
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *rows)
        return stacked, np.asarray(ids, np.int64)

    def _records(self, step: int, positions: np.ndarray) -> np.ndarray:
        epoch, first = self._first_position(step)
        base = epoch * self.settings.records + first
        return np.asarray([self._order[base + int(p)] for p in positions], np.int64)

    def _first_position(self, step: int) -> tuple[int, int]:
        epoch, k = divmod(self._check_step(step), self.steps_per_epoch)
        return epoch, k * self.settings.global_batch

    def _check_step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise TypeError(f"a global step is an int >= 0; got {step!r}.")
        if step >= len(self):
            raise IndexError(
                f"global step {step} is past the end: {self.num_epochs} epoch(s) of "
                f"{self.steps_per_epoch} steps. Fix: pass a larger num_epochs, or None."
            )
        return int(step)


def global_steps(
    dataset: Any,
    *,
    global_batch: int,
    seed: int,
    mesh: jax.sharding.Mesh | None = None,
    batch_axes: str | tuple[str, ...] | None = None,
    num_epochs: int | None = None,
) -> GlobalSteps:
    """The records of every global step, and this process's share of each.

    Args:
        dataset: a ``grain.MapDataset`` (any of grain's transformations) or a
            random-access source (``__len__`` and ``__getitem__``, such as
            ``grain.sources.ArrayRecordDataSource``). Its elements are pytrees
            of arrays of one shape, so that rows stack into a batch.
        global_batch: examples per global step, on all processes together.
        seed: the data order's seed, ``0 <= seed < 2**32`` (grain's shuffle).
        mesh: the step's mesh. Each process gets the rows its devices hold
            along ``batch_axes``; ``None`` (one process) gets every row.
        batch_axes: the mesh axis (or axes) the batch is split over; default
            the mesh's first axis, as in ``unsplit.global_batch``.
        num_epochs: how many epochs to define; ``None`` for endless.

    Returns:
        A :class:`GlobalSteps`: ``steps[s]`` is ``(rows, ids)`` for global step
        ``s`` (this process's rows and their record indices).

    Example:
        >>> import numpy as np, unsplit
        >>> source = np.arange(10) * 100                     # 10 records
        >>> steps = unsplit.data.global_steps(source, global_batch=4, seed=0)
        >>> steps.steps_per_epoch
        2
        >>> rows, ids = steps[0]
        >>> bool((rows == ids * 100).all()), ids.dtype.name
        (True, 'int64')
        >>> epoch0 = np.concatenate([steps.records(0), steps.records(1)])
        >>> len(set(epoch0.tolist()))  # 8 distinct records: none read twice in an epoch
        8
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive int; got {global_batch!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(
            f"seed must be an int in [0, 2**32) (grain's shuffle seed); got {seed!r}. "
            "Fix: pass e.g. seed % 2**32."
        )
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
        raise ValueError(f"num_epochs must be a positive int or None; got {num_epochs!r}.")
    if not isinstance(dataset, grain.MapDataset):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(
                f"dataset must be a grain.MapDataset or a random-access source with __len__ "
                f"and __getitem__; got {type(dataset).__name__}. Fix: wrap an iterable in a "
                "random-access source (global steps read records by index)."
            )
        dataset = grain.MapDataset.source(dataset)
    records = len(dataset)
    if records < global_batch:
        raise ValueError(
            f"the dataset has {records} records, fewer than one global batch "
            f"(global_batch={global_batch}). Fix: a smaller global_batch or more data."
        )
    settings = DataSettings(seed=seed, global_batch=global_batch, records=records)
    return GlobalSteps(
        dataset,
        settings=settings,
        positions=_local_positions(mesh, batch_axes, global_batch),
        num_epochs=num_epochs,
    )


def _local_positions(mesh, batch_axes, global_batch: int) -> np.ndarray:
    """This process's row positions in the global batch, as ``unsplit.global_batch`` lays them out."""
    if mesh is None:
        if jax.process_count() > 1:
            raise ValueError(
                f"global_steps without a mesh gives every row to this process, but this is "
                f"process {jax.process_index()} of {jax.process_count()}. Fix: pass the step's "
                "mesh, so each process reads only the rows its devices hold."
            )
        return np.arange(global_batch, dtype=np.int64)
    axes = mesh.axis_names[0] if batch_axes is None else batch_axes
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"batch_axes={axes!r} names axes {unknown} that the mesh does not have; its axes "
            f"are {mesh.axis_names}. Fix: pass one of them."
        )
    shares = int(np.prod([mesh.shape[a] for a in names]))
    if global_batch % shares:
        raise ValueError(
            f"global_batch={global_batch} does not split evenly over the {shares} devices of "
            f"batch axes {names}. Fix: a global_batch that is a multiple of {shares}."
        )
    spec = P(names[0] if len(names) == 1 else names)
    return distributed.local_positions(NamedSharding(mesh, spec), global_batch).astype(np.int64)
