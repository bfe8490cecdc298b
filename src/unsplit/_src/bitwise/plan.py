"""Bitwise mode's static plan: chunks, device groups, and how params and sums travel.

For a params layout and a global batch size the plan fixes:

* the **chunk**: ``chunk_size`` examples, the unit every schedule computes with
  the same program; chunk ``c`` holds global rows ``[c * chunk_size, ...)``;
* the **groups**: one per coordinate of the *outer* batch axes (the batch axes
  not in ``chunk_axes``). A group is one device, or the devices of the
  ``chunk_axes`` (FSDP groups: the chunk's rows split over them) and of the
  model axes params are sharded over (tensor parallel), which run the chunk
  program as one SPMD program. The mesh axes no param is sharded over play no
  part (the *compute mesh* leaves them out), so replicated params on a 2-D mesh
  compute like one device;
* the **flat plans**: each device's local blocks of the params (params sharded
  over outer batch axes gathered; sharded over group axes kept) and of the
  partial sums, as flat vectors; frozen inputs travel as themselves instead (the
  caller's own buffers where they need no gather), never copied into the vectors.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from unsplit._src import keys as keys_lib
from unsplit._src import partition
from unsplit._src.bitwise import reduce
from unsplit._src.bitwise.flat import FlatPlan
from unsplit._src.step import constraints, sums
from unsplit._src.step.layout import Layout
from unsplit._src.trees import canonical_dtype


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about a bitwise step that depends on the params layout and batch size."""

    layout: Layout  # the user's mesh (a one-device mesh for mesh=None) and batch axes
    structure: sums.Params
    specs: tuple[P, ...]  # each array leaf's PartitionSpec on the user's mesh (full length)
    given: tuple[P, ...]  # the same as the params had them (for the grads' shardings)
    group_axes: tuple[str, ...]  # chunk axes, then the model axes params are sharded over
    chunk_axes: tuple[str, ...]  # the batch axes a chunk's rows are split over (FSDP groups)
    outer_axes: tuple[str, ...]  # the compute mesh's axes that index the groups
    compute: Mesh  # outer axes x group axes (unused axes at index 0)
    local_specs: tuple[P, ...]  # each leaf's spec inside its group (over group axes only)
    params_flat: FlatPlan  # one device's local blocks of every array leaf (some direct)
    sums_flat: FlatPlan  # one device's local blocks of (grad sums..., loss_sum, weight)
    chunk: int
    chunks: int  # in the global batch
    per_group: int  # chunks per group
    slots: int  # aligned blocks a group's chunks add up to, at most (the combine's inputs)
    canonical_blocks: int = 8  # blocks of a dimension a model or sequence axis splits
    region_axes: tuple[str, ...] = ()  # the axes of the loss's own shard_map regions

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The group axes that are not chunk axes: model and sequence axes."""
        return tuple(a for a in self.group_axes if a not in self.chunk_axes)

    @property
    def groups(self) -> int:
        return self.chunks // self.per_group

    @property
    def devices_per_group(self) -> int:
        """How many devices compute each group's chunks together (the group axes')."""
        return math.prod(self.compute.shape[a] for a in self.group_axes)

    @property
    def outer_entry(self) -> Any:
        return partition.entry(self.outer_axes)

    @property
    def packed_specs(self) -> tuple[P, ...]:
        """The specs of the leaves the pack program packs (no direct frozen leaf)."""
        return tuple(self.params_flat.packed(self.specs))

    @property
    def packed_mask(self) -> tuple[bool, ...]:
        """Per params leaf: an array the pack program packs (not a direct frozen one)."""
        direct = iter(self.params_flat.direct)
        return tuple(m and not next(direct) for m in self.structure.array_mask)

    def group_devices(self, g: int) -> np.ndarray:
        """Group ``g``'s devices, shaped like the group axes (g: row-major over the outer axes)."""
        grid = np.asarray(self.compute.devices)
        rest = grid.shape[len(self.outer_axes) :]
        return np.asarray(grid.reshape(-1, *rest)[g], dtype=object).reshape(rest)

    def group_mesh(self, g: int) -> Mesh:
        if not self.group_axes:
            return Mesh(self.group_devices(g).reshape(1), ("_",))
        return Mesh(self.group_devices(g), self.group_axes)

    def pack_sums(self, parts: Sequence[Any]) -> list[Any]:
        """A chunk's ``(grads..., loss_sum, weight)`` as the sums' flat vectors, as computed
        (signed zeros and all: the paths' totals differ in their zeros' signs alone, which the
        unpack writes ``+0``: :mod:`~unsplit._src.bitwise.combine.pairwise`)."""
        return self.sums_flat.pack(list(parts))

    def blocks(self, g: int) -> list[reduce.Block]:
        return reduce.aligned_blocks(g * self.per_group, (g + 1) * self.per_group)


def make_plan(
    spec: sums.LossSpec,
    layout: Layout,
    params: Any,
    batch: Any,
    key: jax.Array,
    size: int,
    chunk: int,
    chunk_axes: tuple[str, ...] = (),
    *,
    blocks: int = 8,
) -> tuple[Plan, list[Any]]:
    """The plan for these inputs, and the params' array leaves (on the layout's mesh)."""
    structure, arrays = sums.Params.split(params)
    mesh = layout.required_mesh()
    specs = tuple(_spec_on(a, mesh) for a in arrays)
    given = tuple(
        a.sharding.spec if isinstance(getattr(a, "sharding", None), NamedSharding) else P()
        for a in arrays
    )
    used = {n for s in specs for n in partition.spec_axes(s)}
    # A chunk axis of one device is no group: its groups are one device, as without it.
    chunk_axes = tuple(a for a in chunk_axes if mesh.shape[a] > 1)
    # Axes that shard an example's activations but not the batch or the params (context
    # parallelism) compute a chunk together too, like model axes (step/constraints).
    activation, regions = _activation_axes(spec, structure, arrays, batch, key, layout)
    used |= activation
    model = tuple(a for a in mesh.axis_names if a in used and a not in layout.batch_axes)
    group_axes = (*chunk_axes, *model)
    outer = tuple(a for a in layout.batch_axes if a not in chunk_axes)
    _check_dimensions(structure.paths, specs, outer, group_axes, model)
    compute = _compute_mesh(mesh, outer, group_axes)
    outer_axes = outer if outer else (_GROUPS,)
    local_specs = tuple(partition.keep_axes(s, group_axes) for s in specs)
    local_shapes = [
        NamedSharding(compute, ls).shard_shape(np.shape(a)) if group_axes else np.shape(a)
        for a, ls in zip(arrays, local_specs, strict=True)
    ]
    # Frozen and large leaves travel as themselves (the caller's buffers, or gathered over the
    # outer batch axes), never copied into the vectors: placement.Held.
    direct = [f or _large(a) for f, a in zip(structure.frozen, arrays, strict=True)]
    params_flat = FlatPlan.of(arrays, local_shapes, direct=direct)
    chunks = size // chunk
    groups = math.prod(compute.shape[a] for a in outer_axes)
    # Padded to a multiple of the groups: the combine cuts each vector into one piece per group.
    sums_flat = _sums_layout(spec, layout, structure, arrays, local_shapes, batch, key, groups)
    per_group = chunks // groups
    # The blocks a group ends with (one when its share is one aligned subtree).
    slots = max(
        len(reduce.aligned_blocks(g * per_group, (g + 1) * per_group)) for g in range(groups)
    )
    plan = Plan(
        layout=layout,
        structure=structure,
        specs=specs,
        given=given,
        group_axes=group_axes,
        chunk_axes=chunk_axes,
        outer_axes=outer_axes,
        compute=compute,
        local_specs=local_specs,
        params_flat=params_flat,
        sums_flat=sums_flat,
        chunk=chunk,
        chunks=chunks,
        per_group=per_group,
        slots=slots,
        canonical_blocks=blocks,
        region_axes=regions,
    )
    return plan, arrays


# Leaves of at least this many elements are no part of the flat params vectors: packing
# them copied every device's params on every step (8.4M floats on 8 devices: about 70 ms a
# step of about 500 in a bitwise replicated step on 2 CPU cores); the smaller ones are
# packed, so a chunk program takes a few vectors, not one argument per bias.
_DIRECT_ELEMENTS = 1 << 16


def _large(x: Any) -> bool:
    """Whether the array leaf ``x`` (its global shape: the same at every degree) is direct."""
    return math.prod(np.shape(x)) >= _DIRECT_ELEMENTS


def _check_dimensions(paths, specs, outer, group_axes, model) -> None:
    """Refuses a params dimension sharded over both a batch axis and a group axis."""
    for path, s in zip(paths, specs, strict=True):
        for e in s:
            names = partition.names(e)
            if any(n in outer for n in names) and any(n in group_axes for n in names):
                what = "a model axis" if any(n in model for n in names) else "a chunk axis"
                raise ValueError(
                    f"params{path} has PartitionSpec {s}: one dimension sharded over both a "
                    f"batch axis and {what} ({e}), which bitwise mode cannot gather "
                    "exactly per group. Fix: shard that dimension over the batch axes or over "
                    f"the {'model' if what == 'a model axis' else 'chunk'} axes, or use "
                    "different dimensions for each."
                )


def _activation_axes(spec, structure, arrays, batch, key, layout: Layout):
    """The axes the loss's annotations and its own ``shard_map`` regions name (not batch
    axes), and those of the regions alone."""
    """The mesh axes the loss's sharding annotations name or its ``shard_map`` regions use, other
    than batch axes."""
    example = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], canonical_dtype(x.dtype)), batch
    )
    shapes = [jax.ShapeDtypeStruct(np.shape(a), canonical_dtype(a.dtype)) for a in arrays]
    mesh = layout.required_mesh()
    # Traced once per loss, inputs' types and mesh (like the loss dtype): not per batch size.
    signature = (
        "axes",
        structure,
        tuple((s.shape, str(s.dtype)) for s in shapes),
        jax.tree.structure(example),
        tuple((e.shape, str(e.dtype)) for e in jax.tree.leaves(example)),
        (np.shape(key), str(key.dtype)),
        tuple(mesh.axis_names),
        tuple(mesh.axis_types),
    )
    try:
        memo = _LOSS_DTYPES.setdefault(spec.loss_fn, {})
    except TypeError:  # a loss that cannot be weakly referenced: traced for every plan
        memo = {}
    if signature not in memo:
        params = structure.merge(shapes)
        memo[signature] = constraints.activation_axes(
            spec.loss_fn, mesh, params, example, example_key(key)
        )
    named, manual = memo[signature]
    # Every axis the loss names joins the group, size 1 too: the names fix the canonical
    # blocks (the bits of every degree); the loss's own shard_map axes always do.
    axes = manual | set(named)
    return {a for a in axes if a not in layout.batch_axes}, tuple(
        sorted(a for a in manual if a not in layout.batch_axes)
    )


def _sums_layout(spec, layout, structure, arrays, local_shapes, batch, key, multiple) -> FlatPlan:
    """The flat layout of a chunk's sums: the grads (wide floats), then loss and weight."""
    diff_shapes = [s for s, d in zip(local_shapes, structure.diff, strict=True) if d]
    grads = [
        jax.ShapeDtypeStruct(s, sums.wide_float(a.dtype))
        for s, a in zip(diff_shapes, structure.diff_of(arrays), strict=True)
    ]
    # A coupled loss's chunks carry only grads: their loss and weight slots are 0.
    coupled = spec.batch_loss is not None
    loss_dtype = (
        np.dtype(np.float32)
        if coupled
        else _loss_dtype(spec, layout, structure, arrays, batch, key)
    )
    scalars = [jax.ShapeDtypeStruct((), loss_dtype), jax.ShapeDtypeStruct((), loss_dtype)]
    # The sums of large leaves get a vector each (packed: a reshape, no copy; _large's rule).
    alone = [_large(a) for a in structure.diff_of(arrays)] + [False, False]
    return FlatPlan.of([*grads, *scalars], alone=alone, multiple=multiple)


def _spec_on(x: Any, mesh: Mesh) -> P:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.shape_tuple == mesh.shape_tuple:
        spec = sharding.spec
        return P(*spec, *([None] * (np.ndim(x) - len(spec))))
    return P(*([None] * np.ndim(x)))


# The compute mesh's one-coordinate group axis when every batch axis is a chunk axis.
_GROUPS = "_groups"


def _compute_mesh(mesh: Mesh, batch_axes: tuple[str, ...], group_axes: tuple[str, ...]) -> Mesh:
    """The mesh over ``batch_axes + group_axes`` (other axes at index 0), in that order.

    No ``batch_axes`` (one group): a leading axis ``_groups`` of size 1.
    """
    names = list(mesh.axis_names)
    order = [names.index(a) for a in (*batch_axes, *group_axes)]
    rest = [i for i in range(len(names)) if i not in order]
    grid = np.transpose(np.asarray(mesh.devices), order + rest)
    grid = grid[(Ellipsis, *([0] * len(rest)))] if rest else grid
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    axes = (*batch_axes, *group_axes)
    axis_types = tuple(types[a] for a in axes)
    if not batch_axes:
        grid, axes, axis_types = grid[None], (_GROUPS, *axes), (axis_types[0], *axis_types)
    return Mesh(grid, axes, axis_types=axis_types)


# Per loss function: the loss sums' dtype per (params, example, key) signature, so a new
# batch size (a new plan) does not trace the loss again.
_LOSS_DTYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _loss_dtype(spec, layout, structure, arrays, batch, key) -> Any:
    """The dtype of the loss sums (float32 unless the loss is wider), from one example's trace
    (traced once per signature: the batch size is not part of it)."""
    example = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], canonical_dtype(x.dtype)), batch
    )
    signature = (
        spec.weighted,
        spec.has_aux,
        structure,
        tuple((np.shape(a), str(a.dtype)) for a in arrays),
        jax.tree.structure(example),
        tuple((e.shape, str(e.dtype)) for e in jax.tree.leaves(example)),
        (np.shape(key), str(key.dtype)),
    )
    try:
        memo = _LOSS_DTYPES.setdefault(spec.loss_fn, {})
    except TypeError:  # a loss that cannot be weakly referenced: traced for every plan
        memo = {}
    if signature not in memo:
        memo[signature] = _traced_loss_dtype(spec, layout, structure, arrays, example, key)
    return memo[signature]


def _traced_loss_dtype(spec, layout, structure, arrays, example, key) -> Any:
    shapes = [jax.ShapeDtypeStruct(np.shape(a), canonical_dtype(a.dtype)) for a in arrays]
    args = (shapes, example, example_key(key))
    try:  # the loss as written, on the user's mesh (a shard_map of theirs runs there)
        one = _loss_sums(spec, structure)
        loss, _ = constraints.on_user_mesh(
            layout.required_mesh(), lambda: jax.eval_shape(one, *args)
        )
    except Exception:  # traced with no mesh, as the chunk program is: shardings left to XLA
        loss, _ = jax.eval_shape(_loss_sums(retargeted(spec, layout, ()), structure), *args)
    return jax.numpy.dtype(loss.dtype)


def _loss_sums(spec: sums.LossSpec, structure: sums.Params):
    """One example's ``(loss_sum, weight)`` as a function of the params' array leaves."""

    def one(arrays, example, key):
        loss_sum, weight, _ = sums.call_loss(spec, structure.merge(arrays), example, key)
        return loss_sum, weight

    return one


def retargeted(spec: sums.LossSpec, layout: Layout, group_axes: tuple[str, ...], gmesh=None):
    """``spec`` whose loss has its shardings on the group's mesh (the user's mesh's other
    axes dropped: data parallel there), as a chunk program traces it."""
    loss_fn = constraints.retargeted(spec.loss_fn, layout.mesh, keep=group_axes, target=gmesh)
    return dataclasses.replace(spec, loss_fn=loss_fn)


def example_key(key: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of one example's key, as the loss receives it in every mode.

    A typed key gives a typed key of shape ``()``; a legacy raw key
    (``jax.random.PRNGKey``, ``uint32[2]``) gives raw key data ``uint32[2]``,
    as ``example_keys`` returns for it.
    """
    one_id = np.zeros((), np.uint32)
    return jax.eval_shape(lambda k: keys_lib.example_keys(k, one_id), key)
