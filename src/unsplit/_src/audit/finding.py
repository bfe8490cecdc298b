"""What the audit reports: :class:`Finding`, the catalogue of kinds, and source lines.

A finding names the user's source line that causes it. JAX records a Python
traceback on every equation of a jaxpr (``eqn.source_info.traceback``); the
audit reports its innermost *user* frame: the first frame that is not inside
JAX, Flax, Optax, Equinox, NumPy, the Python standard library, or unsplit's
own library modules (its test model, demo and audit corpus count as user
code). This is the rule of ``jax.extend.source_info_util.summarize``, widened
to the libraries a training step is built from.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sysconfig
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple


class Kind(NamedTuple):
    """One kind of finding: what it is, why it breaks invariance, and the usual fix."""

    what: str
    why: str
    fix: str


#: Every kind the audit reports. ``audit`` (per-example) reports the first five and
#: ``device_key``; ``audit_step`` (batched) ``unsafe_key`` and the next three.
KINDS: dict[str, Kind] = {
    "foreign_key": Kind(
        "a random draw whose key does not come from the example's key",
        "every example (and every schedule) gets the same noise from that key, instead of "
        "noise that is a function of the example's global id",
        "derive every key from the loss's `key` argument (jax.random.fold_in(key, i), "
        "rngs={'dropout': key}, nnx.Rngs(dropout=key))",
    ),
    "cross_example": Kind(
        "an operation that reads other examples (a named-axis collective) in a per-example loss",
        "its result depends on which examples share the device or the vmapped batch, so it "
        "changes with the number of devices and microbatches",
        "compute the loss of one example from that example alone; a loss that needs the other "
        "examples (in-batch negatives, batch statistics, a load-balancing term) belongs in "
        "unsplit.value_and_grad(features_fn, batch_loss=batch_loss_fn): per-example features, "
        "then one loss over the whole global batch's features (the Losses that couple examples guide, https://unsplit.readthedocs.io/en/latest/coupled/)",
    ),
    "dropped_state": Kind(
        "state updated inside the loss and then discarded (BatchNorm statistics, mutable "
        "collections, NNX Variables)",
        "the update is lost, and statistics computed inside a per-example loss see one "
        "example, never the batch",
        "use use_running_average=True (or a norm without batch statistics, e.g. LayerNorm) "
        "inside the loss; update statistics outside the step",
    ),
    "unsafe_key": Kind(
        "a draw from an rbg or unsafe_rbg key",
        "under jax.vmap these keys draw the whole batch from the first key, so an example's "
        "noise depends on the batch it is in",
        "make keys with jax.random.key(seed) (the default threefry2x32 implementation)",
    ),
    "padding_unstable": Kind(
        "a draw whose bits change when the example is padded to another length",
        "an example's noise depends on the padded length of its batch, which depends on "
        "the schedule (bucketing, microbatch, packing)",
        "draw with prefix-stable shapes (length on the leading axis) or per-coordinate keys, "
        "e.g. unsplit.linen.dot_product_attention as attention_fn=",
    ),
    "device_key": Kind(
        "a key that depends on the device (axis_index, or a key split over a mesh axis)",
        "each device draws from its own key, so the noise of an example depends on the "
        "number of devices and on which device holds it",
        "unsplit.value_and_grad(loss_fn, mesh=mesh): one step key, per-example keys "
        "from global ids",
    ),
    "batch_draw": Kind(
        "one key drawing an array whose shape includes the batch axis",
        "an example's noise depends on its position in the (micro)batch and on the batch "
        "size; a key reused by every microbatch gives them identical noise",
        "unsplit.value_and_grad(loss_fn) with a one-example loss (or jax.vmap over "
        "unsplit.example_keys(key, ids))",
    ),
    "mean_of_means": Kind(
        "a loss or gradient normalized per microbatch and then accumulated",
        "a mean of microbatch means weights tokens of short microbatches more; the result "
        "depends on how the batch is cut",
        "unsplit.value_and_grad(loss_fn, weighted=True, microbatches=k): sums over the "
        "global batch, divided once",
    ),
    "audit_error": Kind(
        "the audit itself failed on this function",
        "some checks did not run, so a problem may be missing from the report",
        "report the message at unsplit's issue tracker; the rest of the report still holds",
    ),
}

PER_EXAMPLE_KINDS = frozenset(
    {"foreign_key", "cross_example", "dropped_state", "unsafe_key", "padding_unstable"}
    | {"device_key"}
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One reason a training step depends on its schedule, at the user's source line.

    Attributes:
        kind: one of :data:`KINDS` (``foreign_key``, ``cross_example``,
            ``dropped_state``, ``unsafe_key``, ``padding_unstable``,
            ``batch_draw``, ``device_key``, ``mean_of_means``; ``audit_error``
            when the audit itself failed).
        message: what is wrong there, and why it breaks schedule invariance.
        fix: a one-line suggestion (for batched steps, the ``unsplit`` equivalent).
        file: the user's source file, or ``None`` when no user frame is known.
        line: the line in ``file``, or ``None``.

    ``where`` is ``file:line``; ``to_dict()`` gives the JSON form that
    ``unsplit audit --json`` prints.

    Example:
        >>> import unsplit
        >>> f = unsplit.Finding("foreign_key", "a closure key", "use `key`", "loss.py", 3)
        >>> str(f)
        'loss.py:3: foreign_key: a closure key'
        >>> f.to_dict()["line"]
        3
    """

    kind: str
    message: str
    fix: str
    file: str | None
    line: int | None

    def __str__(self) -> str:
        return f"{self.where}: {self.kind}: {self.message}"

    @property
    def where(self) -> str:
        """``file:line``, or ``<unknown>`` without a user frame."""
        if self.file is None:
            return "<unknown>"
        return self.file if self.line is None else f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


class AuditWarning(UserWarning):
    """A check the audit had to skip (the report may miss a problem); the message says why."""


class AuditError(ValueError):
    """Raised at trace time for findings that make a step depend on its schedule."""


#: Kinds that matter only when the same example is padded to other lengths. unsplit's steps
#: never pad (every schedule computes each example at the length it is given), so for them
#: these warn instead of refusing: inputs of one fixed length (packed) are unaffected.
PADDING_KINDS = frozenset({"padding_unstable"})


class PaddingWarning(UserWarning):
    """A finding that changes an example's noise only across padded lengths (the step still runs)."""


def raise_for(
    findings: Sequence[Finding],
    kinds: Iterable[str] = ("foreign_key", "dropped_state"),
    caller: str = "unsplit.value_and_grad",
) -> None:
    """Raises :class:`AuditError` naming every finding of ``kinds``; returns if there is none.

    Findings of :data:`PADDING_KINDS` among ``kinds`` do not make the result
    depend on the schedule, only on how long an example is padded: they are
    reported as one :class:`PaddingWarning` (shown once per message, at the
    finding's line) with the same text, and do not raise.

    Example:
        >>> import warnings
        >>> from unsplit._src.audit.finding import Finding
        >>> from unsplit._src.audit.finding import raise_for
        >>> raise_for([Finding("padding_unstable", "m", "f", "a.py", 1)], kinds=())  # not asked
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     raise_for([Finding("padding_unstable", "m", "f", "a.py", 1)], {"padding_unstable"})
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        unsplit.value_and_grad: loss_fn's noise would change if an example were padded ...
          a.py:1: padding_unstable: m
            fix: f
        ...
        >>> raise_for([Finding("foreign_key", "a closure key", "use key", "a.py", 3)])
        Traceback (most recent call last):
        ...
        unsplit._src.audit.finding.AuditError: unsplit.value_and_grad: loss_fn's result would depend on the schedule:
          a.py:3: foreign_key: a closure key
            fix: use key
        Fix: change the lines above (unsplit.audit(loss_fn, params, batch, key) reports them too).
    """
    kinds = frozenset(kinds)
    asked = [f for f in findings if f.kind in kinds]
    errors = [f for f in asked if f.kind not in PADDING_KINDS]
    padding = [f for f in asked if f.kind in PADDING_KINDS]
    if padding:
        _warn_padding(padding, caller)
    if not errors:
        return
    raise AuditError(
        f"{caller}: loss_fn's result would depend on the schedule:\n"
        + _listed(errors)
        + "\nFix: change the lines above (unsplit.audit(loss_fn, params, batch, key) reports "
        "them too)."
    )


def _listed(findings: Sequence[Finding]) -> str:
    return "\n".join(f"  {f}\n    fix: {f.fix}" for f in findings)


_WARNED: dict = {}  # the registry of PaddingWarnings shown (Python's "default" action: once)


def _warn_padding(findings: Sequence[Finding], caller: str) -> None:
    message = (
        f"{caller}: loss_fn's noise would change if an example were padded to another length:\n"
        + _listed(findings)
        + "\nThe step's result does not depend on its schedule (unsplit never pads): inputs of "
        "one fixed length (packed, or padded to one length) are unaffected. Fix: change the "
        "lines above if the padded length varies between steps or runs (bucketing, padding "
        "each batch to its longest example)."
    )
    first = findings[0]
    warnings.warn_explicit(
        message,
        PaddingWarning,
        first.file or "<unknown>",
        first.line or 0,
        module="unsplit",
        registry=_WARNED,
    )


def audit_error(error: BaseException) -> Finding:
    return finding(
        "audit_error",
        f"the audit failed ({type(error).__name__}: {error}); some checks did not run.",
        UNKNOWN,
    )


def dedupe(findings: Iterable[Finding]) -> list[Finding]:
    """The findings without repeats of the same kind at the same line, in order."""
    seen: set[tuple] = set()
    out = []
    for f in findings:
        if (f.kind, f.file, f.line) not in seen:
            seen.add((f.kind, f.file, f.line))
            out.append(f)
    return out


class Site(NamedTuple):
    """A user source location: file, line and function (any may be ``None``)."""

    file: str | None
    line: int | None
    function: str | None = None

    def __str__(self) -> str:
        if self.file is None:
            return "<unknown>"
        return f"{os.path.basename(self.file)}:{self.line}"


UNKNOWN = Site(None, None, None)


def finding(kind: str, message: str, site: Site, fix: str | None = None) -> Finding:
    """A :class:`Finding` of ``kind`` at ``site``; ``fix`` defaults to the kind's fix."""
    return Finding(kind, message, fix or KINDS[kind].fix, site.file, site.line)


def eqn_site(eqn: Any) -> Site:
    """The innermost user frame of a jaxpr equation's traceback."""
    return next(iter(user_sites(eqn)), UNKNOWN)


def user_sites(eqn: Any) -> list[Site]:
    """Every user frame of ``eqn``'s traceback, innermost first."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    if traceback is None:
        return []
    return [
        Site(f.file_name, f.line_num, f.function_name)
        for f in traceback.frames
        if is_user_file(f.file_name)
    ]


def python_site(frames: Iterable[Any]) -> Site:
    """The innermost user frame of a Python traceback (``traceback.extract_tb`` order)."""
    user = [Site(f.filename, f.lineno, f.name) for f in frames if is_user_file(f.filename)]
    return user[-1] if user else UNKNOWN


@functools.cache
def traced_sites(eqn: Any) -> tuple[Site, ...]:
    """:func:`user_sites` up to the audit's own frame: the traced step's frames alone (the
    script that called ``unsplit.audit_step`` is no part of it)."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    sites = []
    for f in traceback.frames if traceback is not None else ():
        path = os.path.abspath(f.file_name)
        if path.startswith(_AUDIT_DIR) and not path.endswith("_test.py"):
            break
        if is_user_file(f.file_name):
            sites.append(Site(f.file_name, f.line_num, f.function_name))
    return tuple(sites)


def is_user_file(path: str) -> bool:
    """True unless ``path`` belongs to a library a training step is built from."""
    if path.startswith("<"):
        return True  # doctests, exec'd code
    path = os.path.abspath(path)
    packages, stdlib, site = _library_dirs()
    if path.startswith(packages):
        return False
    if path.startswith(stdlib) and not path.startswith(site):
        return False
    if path.startswith(_UNSPLIT_SRC):
        name = os.path.relpath(path, _UNSPLIT_SRC).replace(os.sep, "/")
        return name in _UNSPLIT_USER_FILES or name.endswith("_test.py")
    return not path.startswith(_UNSPLIT_TESTING)


_UNSPLIT_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_AUDIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_UNSPLIT_TESTING = os.path.join(os.path.dirname(_UNSPLIT_SRC.rstrip(os.sep)), "testing") + os.sep
# unsplit's own modules that are models rather than library machinery.
_UNSPLIT_USER_FILES = frozenset({"models/transformer.py", "models/specs.py", "test_util.py"})
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "equinox", "chex", "numpy", "orbax", "ml_dtypes")


@functools.cache
def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(library package dirs, standard library dirs, site-packages dirs)."""
    packages = []
    for name in _LIBRARIES:
        spec = importlib.util.find_spec(name)
        for location in (spec and spec.submodule_search_locations) or ():
            packages.append(os.path.abspath(location) + os.sep)
    stdlib = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib")}
    site = {sysconfig.get_path(k) for k in ("purelib", "platlib")}
    return (
        tuple(packages),
        tuple(os.path.abspath(p) + os.sep for p in stdlib if p),
        tuple(os.path.abspath(p) + os.sep for p in site if p),
    )
