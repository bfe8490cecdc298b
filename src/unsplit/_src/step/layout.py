"""Where a step runs: its mesh, the axes that split the batch, and moving inputs there.

A step's *layout* is a ``jax.sharding.Mesh`` (or none: one device) and the
mesh axes that split the global batch (``batch_axes``, default: the mesh's
first axis). The other mesh axes are model axes: params may be sharded over
any axes (FSDP over the batch axes, tensor parallel over model axes) and stay
so. Inputs that live elsewhere (another mesh, one device outside the mesh) are
moved onto the step's mesh.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, cast

import jax
import jax.core  # jax.core.Tracer: imported, so type checkers see the module
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import partition


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh (``None``: one device) and the axes that split the global batch."""

    mesh: jax.sharding.Mesh | None
    batch_axes: tuple[str, ...]

    def required_mesh(self) -> jax.sharding.Mesh:
        """The mesh, where the caller has one (a bitwise step, a branch past ``mesh is None``)."""
        assert self.mesh is not None, "this code path needs a mesh"
        return self.mesh

    @staticmethod
    def make(mesh: jax.sharding.Mesh | None, batch_axes: Any) -> Layout:
        if mesh is None:
            if batch_axes is not None:
                raise ValueError(
                    f"batch_axes={batch_axes!r} names mesh axes, but mesh=None (one device). "
                    "Fix: pass mesh=jax.make_mesh(...) too, or drop batch_axes."
                )
            return Layout(None, ())
        if batch_axes is None:
            return Layout(mesh, (mesh.axis_names[0],))
        names = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
        if not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"batch_axes must be a mesh axis name or a tuple of names; got {batch_axes!r}. "
                f"Fix: e.g. batch_axes='data' or batch_axes=('data', 'fsdp'); the mesh's axes "
                f"are {mesh.axis_names}."
            )
        unknown = [n for n in names if n not in mesh.axis_names]
        if unknown or not names or len(set(names)) != len(names):
            raise ValueError(
                f"batch_axes must be distinct axes of the mesh {mesh.axis_names}; got "
                f"{batch_axes!r}. Fix: name the axes that split the batch, e.g. "
                f"batch_axes={mesh.axis_names[0]!r}."
            )
        return Layout(mesh, tuple(names))

    @property
    def shards(self) -> int:
        """How many shares the global batch is split into."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def model_axes(self) -> tuple[str, ...]:
        if self.mesh is None:
            return ()
        return tuple(a for a in self.mesh.axis_names if a not in self.batch_axes)

    @property
    def batch_entry(self) -> Any:
        """The PartitionSpec entry of the batch dimension."""
        return partition.entry(self.batch_axes)

    def batch_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, P(self.batch_entry))

    def replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def is_explicit(self, axes: tuple[str, ...] | None = None) -> bool:
        """Whether any of ``axes`` (default: all) is an Explicit axis of the mesh."""
        if self.mesh is None:
            return False
        names = self.mesh.axis_names if axes is None else axes
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
        return any(types[n] == AxisType.Explicit for n in names)

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """A sharding constraint on ``x``'s Auto axes (inside the step's program).

        The step's program runs with the batch axes Auto (see
        :mod:`unsplit._src.step.default`); axes that are still Explicit are
        carried by ``x``'s type and left out of the constraint.
        """
        if self.mesh is None:
            return x
        auto = auto_spec(spec)
        if all(e is None for e in auto):
            return x
        return jax.lax.with_sharding_constraint(x, auto)

    def microbatched(self, x: jax.Array, k: int) -> jax.Array:
        """``(B, ...)`` -> ``(k, B // k, ...)``: microbatch ``j`` holds rows ``j`` of each shard.

        Each device keeps its own rows (no data moves): a device's share of
        the global batch is cut into ``k`` consecutive microbatches.
        """
        n, b, rest = self.shards, x.shape[0], x.shape[1:]
        if self.mesh is None:
            return x.reshape(k, b // k, *rest)
        blank = (None,) * len(rest)
        y = self.constrain(x.reshape(n, k, b // (n * k), *rest), P(self.batch_entry, None, None))
        y = jnp.swapaxes(y, 0, 1).reshape(k, b // k, *rest)
        return self.constrain(y, P(None, self.batch_entry, *blank))

    def unmicrobatched(self, y: jax.Array) -> jax.Array:
        """The inverse of :meth:`microbatched`: ``(k, B // k, ...)`` -> ``(B, ...)``."""
        k, bk, rest = y.shape[0], y.shape[1], y.shape[2:]
        if self.mesh is None:
            return y.reshape(k * bk, *rest)
        n = self.shards
        z = self.constrain(y.reshape(k, n, bk // n, *rest), P(None, self.batch_entry))
        z = jnp.swapaxes(z, 0, 1).reshape(k * bk, *rest)
        return self.constrain(z, P(self.batch_entry))


def auto_spec(spec: P) -> P:
    """``spec`` without the axes that are Explicit in the current (abstract) mesh context."""
    explicit = [n for n, t in zip(*_context_axes(), strict=True) if t == AxisType.Explicit]
    return partition.drop_axes(spec, explicit)


def _context_axes():
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(mesh.axis_names), tuple(mesh.axis_types)


def on_mesh(x: Any, mesh: jax.sharding.Mesh) -> bool:
    """False for a committed array placed other than by a NamedSharding over ``mesh``."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return True
    if not getattr(x, "committed", True):
        return True
    sharding = x.sharding
    if mesh.devices.size == 1 and sharding.device_set == set(mesh.devices.flat):
        return True
    if isinstance(sharding, NamedSharding):
        # A committed array's NamedSharding has a concrete Mesh (the stubs allow an AbstractMesh).
        other = cast(jax.sharding.Mesh, sharding.mesh)
        return other == mesh or (
            other.devices.shape == mesh.devices.shape
            and other.axis_names == mesh.axis_names
            and (other.devices == mesh.devices).all()
        )
    return False


def fits(x: jax.Array, sharding: NamedSharding) -> bool:
    try:
        sharding.shard_shape(x.shape)
    except ValueError:
        return False
    return True


def move_onto(tree: Any, layout: Layout, spec_of, what: str, warned: set) -> Any:
    """Moves committed leaves that live outside the step's mesh onto it (with a one-time warning).

    ``spec_of(leaf)`` gives the PartitionSpec to use on the step's mesh.
    """
    mesh = layout.required_mesh()

    def move(path, x):
        if on_mesh(x, mesh):
            return x
        target = NamedSharding(mesh, spec_of(x))
        if not fits(x, target):
            target = NamedSharding(mesh, P())
        name = f"{what}{jax.tree_util.keystr(path)}"
        if what not in warned:
            warned.add(what)
            warnings.warn(
                f"{name} is not placed on the step's mesh or device (it has {x.sharding}); "
                f"unsplit moves it there ({target}) on every call. Fix: place it once, before "
                "the training loop, e.g. jax.device_put(tree, NamedSharding(mesh, spec)) "
                "(with mesh=None: jax.device_put(tree, jax.devices()[0])).",
                stacklevel=4,
            )
        return jax.device_put(x, target)

    return jax.tree_util.tree_map_with_path(move, tree)


def named_spec(x: Any, mesh: jax.sharding.Mesh) -> P:
    """``x``'s PartitionSpec when it can be reused on ``mesh`` (same axis names), else ``P()``."""
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return P()
    return spec if partition.spec_axes(spec) <= set(mesh.axis_names) else P()
