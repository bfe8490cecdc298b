"""The demo's settings, importable without jax (the CLI reads them before jax starts)."""

from __future__ import annotations

import dataclasses

VOCAB = 96  # demo_data.ALPHABET: newline and printable ASCII

#: ``--quick``: a small model and few steps (options given explicitly win).
QUICK = {"steps": 16, "batch_size": 16, "length": 16, "width": 32, "layers": 1, "heads": 2}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo trains: model size, data, optimizer, and how often it measures.

    ``batch_size`` must be a multiple of 8 (the schedules cut it into 8 shares).
    """

    steps: int = 200
    batch_size: int = 16
    length: int = 32
    width: int = 64
    layers: int = 2
    heads: int = 4
    dropout: float = 0.1
    learning_rate: float = 3e-3
    seed: int = 0
    points: int = 25  # how many times the parameter divergence is measured

    def model(self):
        """The demo's :class:`~unsplit._src.models.transformer.Transformer` (imports jax)."""
        from unsplit._src.models import transformer as tf

        return tf.Transformer(
            tf.TransformerConfig(
                vocab=VOCAB,
                length=self.length,
                width=self.width,
                heads=self.heads,
                layers=self.layers,
                dropout=self.dropout,
                attention_dropout=self.dropout,
            )
        )

    def snapshot_steps(self) -> list[int]:
        """Steps after which the parameters are compared (always includes the last)."""
        every = max(1, self.steps // max(1, self.points))
        return sorted({*range(every, self.steps + 1, every), self.steps})

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


def make(quick: bool = False, **given) -> DemoConfig:
    """The settings: the defaults (or ``QUICK``) overridden by the ``given`` non-None values."""
    values = dict(QUICK) if quick else {}
    values.update({k: v for k, v in given.items() if v is not None})
    return DemoConfig(**values)
