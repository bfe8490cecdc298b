"""Checkpoints of a whole run with orbax: state, step (the data position), and checked settings.

A checkpoint holds the training state (params, optimizer state: any pytree of
arrays), the global step it was taken after, which is also the data position
of :func:`unsplit.data.global_steps`, and the run's **settings**: the values
that fix what every step computes (seed, global batch, chunk size, ...). A
resumed run must keep them; :meth:`Checkpointer.restore` compares them first
and raises :class:`SettingsMismatch` naming the one that changed.

Everything else may change between save and restore: the number of devices
and processes, the mesh, the microbatches. The state is restored to the
shardings of the ``like`` tree given to :meth:`Checkpointer.restore` (orbax
reads each array into the target layout), so a run saved by one process on 4
devices resumes on 2 processes x 2 devices.

Saves are atomic: orbax writes into a temporary directory and renames it when
every process has finished, so a process killed during a save leaves the
previous checkpoints intact and the unfinished one is ignored (and removed
when the next :class:`Checkpointer` opens the directory).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from unsplit._src.processes.items import tree_items

_FORMAT = "unsplit-run/1"


class SettingsMismatch(ValueError):
    """A resumed run's settings differ from the checkpoint's (the message names them)."""


# Long: the checkpoint API of a run (save, restore, latest, metadata, close) over one
# orbax manager, each method short; the settings check is the only logic of its own.
class Checkpointer:
    """Saves and restores a training run in ``directory`` (an orbax ``CheckpointManager``).

    Args:
        directory: where the checkpoints live, one subdirectory per step.
        settings: the run's invariance settings, a flat mapping of JSON values
            (e.g. ``{"seed": 0, "global_batch": 64, "chunk_size": 8}``). They
            are saved with every checkpoint and must be equal on restore.
        max_to_keep: how many of the newest checkpoints to keep (None: all).
        async_save: return from :meth:`save` once the arrays are copied off the
            devices and write in the background (:meth:`wait` or :meth:`close`
            to finish).

    Every process of a multi-process run makes the same calls.

    Example:
        >>> import tempfile, jax.numpy as jnp, unsplit
        >>> folder = tempfile.mkdtemp()
        >>> state = {"w": jnp.arange(3.0)}
        >>> with unsplit.checkpoint.Checkpointer(folder, settings={"seed": 0}) as ckpt:
        ...     ckpt.save(10, state)
        >>> with unsplit.checkpoint.Checkpointer(folder, settings={"seed": 0}) as ckpt:
        ...     step, restored = ckpt.restore(like=state)
        >>> step, restored["w"].tolist()
        (10, [0.0, 1.0, 2.0])
        >>> unsplit.checkpoint.Checkpointer(folder, settings={"seed": 1}).restore(like=state)
        Traceback (most recent call last):
        ...
        unsplit._src.elastic.checkpoint.SettingsMismatch: cannot resume ... seed: saved 0, this run 1...
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        settings: Mapping[str, Any],
        max_to_keep: int | None = 2,
        async_save: bool = True,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.settings = _json_settings(settings)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            cleanup_tmp_directories=True,  # a save cut short by a kill is removed, never read
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint, oldest first."""
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        *,
        info: Mapping[str, Any] | None = None,
        frozen: Any = None,
    ) -> None:
        """Saves ``state`` as the checkpoint after global step ``step``.

        Args:
            step: the number of global steps done; the next step to run, and the
                data position of :func:`unsplit.data.global_steps`.
            state: a pytree of arrays (params, optimizer state, ...), sharded
                in any way over any mesh.
            info: optional JSON values saved alongside for people (e.g. the
                topology that wrote it); never checked.
            frozen: the step's frozen inputs (``frozen=``, a LoRA base model): not
                saved (they are loaded as the run started), but their structure,
                shapes, dtypes and a 64-bit fingerprint of each leaf's values are,
                and :meth:`restore` with ``frozen=`` checks them: a resumed run on
                another base would silently train something else.
        """
        meta = {
            "format": _FORMAT,
            "step": int(step),
            "data": {"next_step": int(step)},
            "settings": self.settings,
            "info": dict(info or {}),
        }
        if frozen is not None:
            meta["frozen"] = _frozen_record(frozen)
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON saved with a checkpoint: step, data position, settings, info."""
        step = self._step(step)
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(self, like: Any, step: int | None = None, *, frozen: Any = None) -> tuple[int, Any]:
        """Restores the state saved after ``step`` (default: the newest) onto ``like``'s layout.

        Args:
            like: a pytree with the state's structure whose leaves are
                ``jax.Array`` s or ``jax.ShapeDtypeStruct`` s with a
                ``sharding``, laid out as this run wants them (its mesh, its
                processes); e.g. the freshly initialized state.
            step: which checkpoint; default the newest complete one.
            frozen: this run's frozen inputs, checked against those the checkpoint
                was saved with (``save(..., frozen=...)``; their shardings may differ).

        Returns:
            ``(step, state)``: the checkpoint's step (the next global step to
            run) and the state, sharded like ``like``.

        Raises:
            FileNotFoundError: no complete checkpoint in the directory.
            SettingsMismatch: the checkpoint was saved with other settings, or with
                other frozen inputs (or with frozen inputs, and none were given).
        """
        step = self._step(step)
        meta = self.metadata(step)
        self._check_settings(step, meta.get("settings", {}))
        _check_frozen(self.directory, step, meta.get("frozen"), frozen)
        target = jax.tree.map(_abstract, like)
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )
        return int(meta["step"]), out["state"]

    def wait(self) -> None:
        """Blocks until a background save has finished writing."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes any background save and releases the directory."""
        self._manager.wait_until_finished()
        self._manager.close()

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(
                    f"no complete checkpoint in {self.directory}. Fix: start the run without "
                    "resuming, or point at the directory the run saved to."
                )
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory}; there are "
                f"{self.all_steps()}. Fix: pass one of those, or None for the newest."
            )
        return int(step)

    def _check_settings(self, step: int, saved: Mapping[str, Any]) -> None:
        names = sorted(set(saved) | set(self.settings))
        changed = [n for n in names if saved.get(n, "<absent>") != self.settings.get(n, "<absent>")]
        if not changed:
            return
        lines = "; ".join(
            f"{n}: saved {_show(saved.get(n, '<absent>'))}, this run "
            f"{_show(self.settings.get(n, '<absent>'))}"
            for n in changed
        )
        keep = ", ".join(f"{n}={_show(saved[n])}" for n in changed if n in saved)
        raise SettingsMismatch(
            f"cannot resume from the checkpoint of step {step} in {self.directory}: the run's "
            f"settings changed. {lines}. These settings fix which records, noise and bits every "
            f"step gets, so a resumed run must keep them. Fix: resume with "
            f"{keep or 'the saved settings'}, or start a new run in an empty directory."
        )


def _check_frozen(directory: str, step: int, saved: Any, frozen: Any) -> None:
    """Refuses a resume with other frozen inputs than the checkpoint was saved with."""
    if saved is None:  # saved without frozen=: nothing to compare
        return
    if frozen is None:
        raise SettingsMismatch(
            f"the checkpoint of step {step} in {directory} was saved with frozen "
            "inputs (save(..., frozen=...)), and restore got none: expected the run's "
            "frozen inputs, got frozen=None. Fix: restore(like, frozen=frozen), with the "
            "frozen inputs (e.g. the base model) the run trains with."
        )
    mine = _frozen_record(frozen)
    changed = [
        f"{name} of {path}: saved {saved[name].get(path, '<absent>')}, this run "
        f"{mine[name].get(path, '<absent>')}"
        for name in ("frozen shapes and dtypes", "frozen values")
        for path in sorted(set(saved[name]) | set(mine[name]))
        if saved[name].get(path) != mine[name].get(path)
        and not _unread(saved[name].get(path), mine[name].get(path))
    ]
    if saved["frozen structure"] != mine["frozen structure"]:
        changed.insert(0, f"frozen structure: saved {saved['frozen structure']}, this run "
                          f"{mine['frozen structure']}")  # fmt: skip
    if changed:
        raise SettingsMismatch(
            f"cannot resume from the checkpoint of step {step} in {directory}: the "
            f"frozen inputs changed. {'; '.join(changed[:5])}"
            f"{f' (and {len(changed) - 5} more)' if len(changed) > 5 else ''}. The frozen "
            "inputs fix what every step computes, so a resumed run must keep them. Fix: "
            "load the frozen inputs the run was saved with (the same base checkpoint), or "
            "start a new run in an empty directory."
        )


def _unread(*values: Any) -> bool:
    """A leaf split over several processes has no host fingerprint (each holds a part)."""
    return any(isinstance(v, str) and v.startswith("sharded over processes") for v in values)


def _frozen_record(frozen: Any) -> dict[str, Any]:
    """What a checkpoint keeps of the frozen inputs: structure, shapes and dtypes, and a
    fingerprint per leaf (of its global value: the same for any sharding)."""
    items = tree_items("frozen", frozen)
    names = ("frozen structure", "frozen shapes and dtypes", "frozen values")
    return json.loads(json.dumps({n: items[n] for n in names}))


def run_settings(fixed: Mapping[str, Any], *, bitwise: bool) -> dict[str, Any]:
    """A run's settings for :class:`Checkpointer`: ``fixed``, and in bitwise mode what
    else fixes the bits -- JAX's and jaxlib's versions (a resume on another version
    would silently give other bits).

    Example:
        >>> import unsplit.checkpoint
        >>> sorted(unsplit.checkpoint.run_settings({"seed": 0}, bitwise=True))
        ['jax', 'jaxlib', 'seed']
    """
    import jaxlib.version

    out = dict(fixed)
    if bitwise:
        out["jax"], out["jaxlib"] = jax.__version__, jaxlib.version.__version__
    return out


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:
            raise ValueError(
                f"restore needs a sharding for every leaf of like=; got a ShapeDtypeStruct "
                f"{x.shape} {x.dtype} without one. Fix: pass jax.ShapeDtypeStruct(shape, dtype, "
                "sharding=...) or the arrays of a freshly initialized state."
            )
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    raise TypeError(
        f"restore needs arrays or jax.ShapeDtypeStruct leaves in like=; got {type(x).__name__}. "
        "Fix: pass the freshly initialized state, placed as this run wants it (jax.device_put)."
    )


def _json_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(settings, Mapping):
        raise TypeError(
            f"settings must be a mapping of names to JSON values; got {type(settings).__name__}."
        )
    out = {str(k): v.item() if isinstance(v, np.generic) else v for k, v in settings.items()}
    try:
        return json.loads(json.dumps(out))
    except TypeError as e:
        raise TypeError(
            f"settings must hold JSON values (numbers, strings, bools, None); {e}. Fix: pass "
            "plain Python values, e.g. int(x)."
        ) from None


def _show(value: Any) -> str:
    return value if value == "<absent>" else json.dumps(value)
