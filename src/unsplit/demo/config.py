"""The demo's settings, importable without jax (the CLI reads them before jax starts).

Three presets: the default run (a one-layer model for 30 steps, about two
minutes on 2 CPU cores, most of it compiling), ``--long`` (a bigger model for
200 steps, compiled with XLA's optimizations on: several minutes) and
``--quick`` (16 steps, for a check of the installation). Options given
explicitly override the preset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

VOCAB = 96  # data.ALPHABET: newline and printable ASCII

#: ``--long``: a bigger model, trained longer (options given explicitly win).
LONG = {"steps": 200, "length": 32, "width": 64, "layers": 2, "heads": 4, "fast_compile": False}
#: ``--quick``: the default model for fewer steps, for a check of the installation.
QUICK = {"steps": 16, "length": 16, "width": 32, "layers": 1, "heads": 2}
PRESETS = {"default": {}, "long": LONG, "quick": QUICK}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo trains: model size, data, optimizer, and how often it measures.

    ``batch_size`` must be a multiple of 8 (the schedules cut it into 8 shares).
    ``fast_compile`` turns XLA's backend optimizations off in every process
    (``--xla_backend_optimization_level=0``): a program compiles several
    times faster, and at this size runs about as fast.
    """

    steps: int = 30
    batch_size: int = 16
    length: int = 16
    width: int = 32
    layers: int = 1
    heads: int = 2
    dropout: float = 0.1
    learning_rate: float = 3e-3
    seed: int = 0
    points: int = 25  # how many times the parameter divergence is measured
    fast_compile: bool = True

    def model(self):
        """The demo's :class:`unsplit.models.Transformer` (imports jax and flax)."""
        return transformer(self)

    def snapshot_steps(self) -> list[int]:
        """Steps after which the parameters are compared (always includes the last)."""
        every = max(1, self.steps // max(1, self.points))
        return sorted({*range(every, self.steps + 1, every), self.steps})

    def chunk_size(self) -> int:
        """Bitwise mode's chunk: the smallest share of the batch, the same for every row."""
        return self.batch_size // 8

    def check(self) -> None:
        """Raises ValueError with the fix for settings the schedules cannot run."""
        problems = []
        if self.steps < 2:
            problems.append(f"steps must be >= 2; got {self.steps}")
        if self.batch_size < 8 or self.batch_size % 8:
            problems.append(
                f"batch_size must be a positive multiple of 8 (8 devices, 8 microbatches, "
                f"2 x 4 and 4 x 2 all cut it into 8 shares); got {self.batch_size}"
            )
        if self.width < 1 or self.heads < 1 or self.width % self.heads:
            problems.append(f"width ({self.width}) must be a multiple of heads ({self.heads})")
        if self.layers < 1:
            problems.append(f"layers must be >= 1; got {self.layers}")
        if self.length < 4:
            problems.append(f"length must be >= 4; got {self.length}")
        if not 0.0 < self.dropout < 1.0:
            problems.append(
                f"dropout must be in (0, 1) (the demo is about dropout noise); got {self.dropout}"
            )
        if self.learning_rate <= 0:
            problems.append(f"learning_rate must be > 0; got {self.learning_rate}")
        if problems:
            raise ValueError("invalid demo settings: " + "; ".join(problems) + ".")


def make(preset: str = "default", **given) -> DemoConfig:
    """The settings of ``preset`` overridden by the ``given`` non-None values.

    Example:
        >>> from unsplit.demo import config
        >>> config.make().steps, config.make("long").steps, config.make("long", steps=300).steps
        (30, 200, 300)
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}.")
    values = dict(PRESETS[preset])
    values.update({k: v for k, v in given.items() if v is not None})
    return DemoConfig(**values)


def transformer(sizes: Any):
    """The demo's :class:`unsplit.models.Transformer` of ``sizes``' length, width, heads,
    layers and dropout (attention's too), over the demo's characters; imports jax and flax.
    """
    from unsplit import models

    return models.Transformer(
        models.TransformerConfig(
            vocab=VOCAB,
            length=sizes.length,
            width=sizes.width,
            heads=sizes.heads,
            layers=sizes.layers,
            dropout=sizes.dropout,
            attention_dropout=sizes.dropout,
        )
    )
