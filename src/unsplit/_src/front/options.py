"""A step's options, in one home: validated once, read by every layer.

``unsplit.value_and_grad(loss_fn, **keywords)`` turns its keywords into one
frozen :class:`Options`; the step, both engines, the multi-process agreement and
``repr`` read that object, so an option is written out once (its field here)
and checked once (``__post_init__``).

Which options belong to which mode:

* both modes: ``batch_loss``, ``weighted``, ``has_aux``, ``mesh``,
  ``batch_axes``, ``group_size``, ``audit``, ``checked``;
* default mode: ``microbatches`` (bitwise mode computes one chunk at a time
  whatever it says, so it is accepted and has no effect there);
* bitwise mode: ``chunk_size`` and ``chunk_axes``, grouped in :class:`Bitwise`
  (``bitwise=True`` is ``bitwise=Bitwise()``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from unsplit._src.step import validate


@dataclasses.dataclass(frozen=True)
class Bitwise:
    """Bitwise mode's options, as one object: ``value_and_grad(..., bitwise=Bitwise(...))``.

    ``bitwise=True`` is ``bitwise=Bitwise()``; ``bitwise=True, chunk_size=8``
    (keywords) keeps working and means ``bitwise=Bitwise(chunk_size=8)``.

    Attributes:
        chunk_size: the fixed unit of work, in examples: it fixes the bits, so
            compare schedules at the same one (``None``: a default that depends
            on the global batch size only; with ``chunk_axes``, made a
            multiple of their device count). See :func:`unsplit.chunk_size_for`.
        chunk_axes: batch axes (a name or a tuple, the last of ``batch_axes``)
            whose devices compute each chunk together (FSDP groups): params stay
            sharded over them; each device computes its rows as the chunk's row
            blocks, so groups of every size dividing their number (2, 4 and 8 at
            ``chunk_size=16``) give the same bits. ``chunk_size_for(...,
            group_devices=(2, 4, 8))`` picks a chunk they all share.
        blocks: the canonical blocks of a dimension that a model-parallel or
            sequence axis splits (a power of two; fewer for a dimension whose size
            has fewer factors of two): every dot and sum over such a dimension is
            computed per block and the blocks added in a fixed tree, so the bits are
            the same at every degree that divides them (8: tensor, sequence and
            expert degrees 1, 2, 4 and 8).

    Example:
        >>> import jax, jax.numpy as jnp, unsplit
        >>> def loss_fn(w, x, key):
        ...     keep = jax.random.bernoulli(key, 0.9, x.shape)
        ...     return jnp.sum((jnp.where(keep, x / 0.9, 0.0) @ w) ** 2)
        >>> w, x = jnp.ones((3, 2)), jnp.ones((16, 3))
        >>> step = unsplit.value_and_grad(loss_fn, bitwise=unsplit.Bitwise(chunk_size=8))
        >>> loss, grads = step(w, x, jax.random.key(0))
        >>> step.options.bitwise
        Bitwise(chunk_size=8, chunk_axes=None, blocks=8)
    """

    chunk_size: int | None = None
    chunk_axes: str | tuple[str, ...] | None = None
    blocks: int = 8

    def __post_init__(self):
        object.__setattr__(
            self,
            "chunk_size",
            validate.check_positive_int(
                "chunk_size", self.chunk_size, meaning="examples per chunk", allow_none=True
            ),
        )
        axes = self.chunk_axes
        if isinstance(axes, list):
            axes = tuple(axes)
        if axes is not None and not (
            isinstance(axes, str)
            or (isinstance(axes, tuple) and all(isinstance(a, str) for a in axes))
        ):
            raise TypeError(
                f"chunk_axes must be a mesh axis name or a tuple of names; got {axes!r}. "
                "Fix: e.g. chunk_axes='fsdp' (one of batch_axes)."
            )
        object.__setattr__(self, "chunk_axes", axes)
        blocks = validate.check_positive_int(
            "blocks", self.blocks, meaning="canonical blocks of a model-parallel dimension"
        )
        assert blocks is not None  # not allow_none
        if blocks & (blocks - 1):
            raise ValueError(
                f"Bitwise(blocks=...) must be a power of two (its divisors are the degrees whose "
                f"bits agree); got {blocks=}. Fix: e.g. blocks=8 (degrees 1, 2, 4, 8) or 16."
            )
        object.__setattr__(self, "blocks", blocks)


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything a step is built with besides the loss function (see :func:`value_and_grad`).

    ``bitwise`` is ``None`` in default mode and a :class:`Bitwise` in bitwise
    mode, whatever spelling the caller used.
    """

    batch_loss: Any = None
    weighted: bool = False
    has_aux: bool = False
    microbatches: int = 1
    mesh: jax.sharding.Mesh | None = None
    batch_axes: str | tuple[str, ...] | None = None
    bitwise: Bitwise | None = None
    group_size: int | None = None
    audit: bool = False
    checked: bool = False

    @classmethod
    def make(
        cls,
        *,
        bitwise: bool | Bitwise = False,
        chunk_size: int | None = None,
        chunk_axes: str | tuple[str, ...] | None = None,
        **options: Any,
    ) -> Options:
        """The options of ``value_and_grad``'s keywords (``bitwise=True, chunk_size=...`` too)."""
        return cls(bitwise=_bitwise(bitwise, chunk_size, chunk_axes), **options)

    def __post_init__(self):
        fix = object.__setattr__
        for name in ("weighted", "has_aux", "audit", "checked"):
            fix(self, name, validate.check_flag(name, getattr(self, name)))
        fix(
            self,
            "microbatches",
            validate.check_positive_int(
                "microbatches",
                self.microbatches,
                meaning="sequential accumulation steps per device",
            ),
        )
        fix(
            self,
            "group_size",
            validate.check_positive_int(
                "group_size", self.group_size, meaning="rows per example", allow_none=True
            ),
        )
        validate.check_mesh(self.mesh)
        if self.batch_loss is not None:
            _check_batch_loss(self.batch_loss, self.weighted)

    @property
    def mode(self) -> str:
        return "default" if self.bitwise is None else "bitwise"

    def changed(self) -> dict[str, Any]:
        """The options that differ from their defaults (``repr``), in field order."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


def _bitwise(bitwise: Any, chunk_size: Any, chunk_axes: Any) -> Bitwise | None:
    """``bitwise=`` in any of its spellings as a :class:`Bitwise`, or None (default mode)."""
    keywords = {
        k: v for k, v in (("chunk_size", chunk_size), ("chunk_axes", chunk_axes)) if v is not None
    }
    if isinstance(bitwise, Bitwise):
        if keywords:
            raise ValueError(
                f"bitwise={bitwise!r} already holds bitwise mode's options; got "
                f"{', '.join(f'{k}={v!r}' for k, v in keywords.items())} as keywords too. "
                f"Fix: pass them inside it, e.g. bitwise=unsplit.Bitwise("
                f"{', '.join(f'{k}={v!r}' for k, v in keywords.items())})."
            )
        return bitwise
    if not validate.check_flag("bitwise", bitwise) and keywords:
        name, value = next(iter(keywords.items()))
        raise ValueError(
            f"{name}={value!r} only applies with bitwise=True; got bitwise=False"
            + (
                " (default mode already computes with params sharded as given)"
                if name == "chunk_axes"
                else ""
            )
            + f". Fix: drop {name}, or pass bitwise=True (or bitwise=unsplit.Bitwise({name}="
            f"{value!r}))."
        )
    return Bitwise(**keywords) if bitwise else None


def _check_batch_loss(batch_loss: Any, weighted: bool) -> None:
    if not callable(batch_loss):
        raise TypeError(
            f"batch_loss must be a function batch_loss(params, features) -> scalar loss of the "
            f"global batch; got {type(batch_loss).__name__}. Fix: pass a function, or omit "
            "batch_loss for a loss that is a mean over independent examples."
        )
    if weighted:
        raise ValueError(
            "weighted=True does not apply with batch_loss: expected weighted=False, because "
            "batch_loss returns the loss of the whole global batch itself; got weighted=True. "
            "Fix: drop weighted=True; return each example's (loss_sum, weight) as features and "
            "compute jnp.sum(loss_sums) / jnp.sum(weights) inside batch_loss."
        )
