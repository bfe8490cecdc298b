"""The demo's embedded dataset: characters of the Python standard library's own source.

Every Python installation carries the source of its standard library, so the
demo needs no download. The text is a few modules' ``.py`` files (or, where an
installation ships only bytecode, their docstrings), mapped to a 96-symbol
character vocabulary and cut into records (:class:`Windows`): windows of
``length`` characters, each with its own length (the rest is padding with
mask 0), so examples carry different numbers of tokens and the token
weighting of the loss matters.

The records of training step ``s`` come from grain's shuffle
(:func:`unsplit.data.global_steps`): a function of ``(seed, epoch, s)`` and
the Python version's library text, whatever the devices or processes.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib

import numpy as np

# Modules whose source makes the corpus (present in every CPython 3.11+).
MODULES = (
    "argparse",
    "json.decoder",
    "json.encoder",
    "textwrap",
    "dataclasses",
    "functools",
    "string",
    "fractions",
)
#: Symbols: newline, then printable ASCII (space .. ~). Anything else becomes "?".
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = len(ALPHABET)  # 96, demo_config.VOCAB
PAD = 0
_MAX_CHARS = 400_000


def corpus_text() -> str:
    """The demo's text: the listed standard-library modules' source, concatenated.

    Falls back to the modules' docstrings for an installation without ``.py``
    files, so the demo runs everywhere.

    Example:
        >>> from unsplit.demo import data as demo_data
        >>> len(demo_data.corpus_text()) > 10_000
        True
    """
    parts = []
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None)
        path = pathlib.Path(origin) if origin else None
        if path is not None and path.suffix == ".py" and path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
        else:
            parts.append(importlib.import_module(name).__doc__ or "")
    text = "\n".join(parts)[:_MAX_CHARS]
    if len(text) < 10_000:
        raise RuntimeError(
            f"the standard library text for the demo is only {len(text)} characters long "
            f"(expected the source of {', '.join(MODULES)}). Fix: run with a standard CPython "
            "installation (python -OO strips docstrings, which the fallback needs)."
        )
    return text


def encode(text: str) -> np.ndarray:
    """Characters to token ids in ``[0, VOCAB)`` (tabs become 4 spaces, others "?").

    Example:
        >>> from unsplit.demo import data as demo_data
        >>> demo_data.encode("a\\n").tolist()
        [66, 0]
    """
    unknown = ALPHABET.index("?")
    table = np.full(128, unknown, np.int32)
    for i, ch in enumerate(ALPHABET):
        table[ord(ch)] = i
    codes = np.frombuffer(text.replace("\t", "    ").encode("utf-32-le"), np.uint32)
    return np.where(codes < 128, table[np.minimum(codes, 127)], unknown).astype(np.int32)


def decode(tokens: np.ndarray) -> str:
    """Token ids back to text."""
    return "".join(ALPHABET[int(t)] for t in np.asarray(tokens).reshape(-1))


class Dataset:
    """The demo's global batches: grain's data order over :class:`Windows` records.

    Step ``s`` reads the records ``unsplit.data.global_steps`` assigns to it:
    a function of ``(seed, epoch, s)`` only, each record once per epoch. With a
    ``mesh`` this process reads only its own rows of every step.

    Args:
        batch_size: examples per global batch.
        length: tokens per example (the model's context length).
        seed: the data order's seed.
        mesh: the step's mesh in a multi-process run (None: every row).

    Example:
        >>> from unsplit.demo import data as demo_data
        >>> data = demo_data.Dataset(batch_size=4, length=16, seed=0)
        >>> b = data.batch(3)
        >>> sorted(b), b["inputs"].shape, b["mask"].dtype.name, data.ids(3).dtype.name
        (['inputs', 'mask', 'targets'], (4, 16), 'float32', 'int64')
    """

    def __init__(self, batch_size: int, length: int, seed: int = 0, mesh=None):
        if batch_size < 1 or length < 4:
            raise ValueError(
                f"the demo data needs batch_size >= 1 and length >= 4; got "
                f"batch_size={batch_size}, length={length}. Fix: pass larger values."
            )
        from unsplit import data as unsplit_data  # imports jax and grain

        self.source = Windows(length)
        self.steps = unsplit_data.global_steps(
            self.source, global_batch=batch_size, seed=seed, mesh=mesh
        )
        self.batch_size, self.length, self.seed = int(batch_size), int(length), int(seed)

    def step(self, step: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``(rows, record ids)`` of global step ``step`` (this process's rows)."""
        rows, ids = self.steps[int(step)]
        return rows, ids

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The rows of ``step``: ``{"inputs", "targets": int32[B, L], "mask": float32[B, L]}``."""
        return self.step(step)[0]

    def ids(self, step: int) -> np.ndarray:
        """The record ids of the rows of ``step`` (``int64[B]``), the examples' global ids."""
        return self.step(step)[1]


class Windows:
    """The text as a random-access source of ragged records, for grain and ``global_steps``.

    Record ``r`` is the window of ``length + 1`` characters starting at
    ``r * length`` (the windows tile the text) with its own length ``n_r``,
    uniform in ``[length // 4, length]`` and fixed per record; the rest is
    padding with mask 0. It has ``__len__`` and ``__getitem__``, so
    ``unsplit.data.global_steps(Windows(32), ...)`` defines the records of every
    global step, and each process reads only its own.

    Example:
        >>> from unsplit.demo import data as demo_data
        >>> source = demo_data.Windows(length=16)
        >>> record = source[3]
        >>> len(source) > 1000, sorted(record), record["inputs"].shape
        (True, ['inputs', 'mask', 'targets'], (16,))
    """

    def __init__(self, length: int):
        if length < 4:
            raise ValueError(f"the demo data needs length >= 4; got length={length}.")
        self.tokens = encode(corpus_text())
        self.length = int(length)

    def __len__(self) -> int:
        return (self.tokens.size - 1) // self.length

    def __getitem__(self, record: int) -> dict[str, np.ndarray]:
        record = int(record)
        if not 0 <= record < len(self):
            raise IndexError(f"record {record} is not in [0, {len(self)}).")
        n = self.length
        length = np.random.default_rng((_LENGTH_SEED, record)).integers(n // 4, n + 1)
        one = examples(self.tokens, np.array([record * n]), np.array([length]), n)
        return {k: v[0] for k, v in one.items()}


_LENGTH_SEED = 1


def examples(tokens, starts, lengths, n: int) -> dict[str, np.ndarray]:
    """Windows at ``starts`` keeping their first ``lengths`` tokens: inputs, targets, mask."""
    windows = tokens[starts[:, None] + np.arange(n + 1)[None, :]]
    mask = np.arange(n)[None, :] < lengths[:, None]
    inputs = np.where(mask, windows[:, :-1], PAD).astype(np.int32)
    targets = np.where(mask, windows[:, 1:], PAD).astype(np.int32)
    return {"inputs": inputs, "targets": targets, "mask": mask.astype(np.float32)}
