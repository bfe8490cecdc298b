"""The values the audit's walk carries: where a value comes from, and where the walk is.

A :class:`Node` is one value of the traced function; its ``info`` is the set
of :class:`Origin` s it depends on. :class:`Ctx` is where the walker is (call
path, enclosing loops and device maps). The walk itself is
:mod:`unsplit._src.audit.graph`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from unsplit._src.audit.finding import UNKNOWN, Site, eqn_site, traced_sites

CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint"}
    | {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}
)
COLLECTIVES = frozenset(
    {"psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_to_all"}
    | {"ragged_all_to_all", "reduce_scatter", "psum_invariant", "all_gather_invariant"}
    | {"axis_index", "psend", "precv", "pgather"}
)
DRAWS = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


class Origin(NamedTuple):
    """Something a value may depend on.

    ``kind`` is one of ``example_key``, ``param``, ``data``, ``key_arg``,
    ``const``, ``seed``, ``device`` (roots) or a rule's marker (``loop``,
    ``carry``, ``hash``, ``batch_stat``, ``batch_mean``). ``label`` describes it
    for a message; ``tag`` tells markers of different loops apart.
    """

    kind: str
    label: str
    site: Site | None = None
    tag: Any = None


Info = frozenset  # of Origin
EMPTY: Info = frozenset()
MARKERS = frozenset({"loop", "carry", "hash", "batch_stat", "batch_mean"})


class Node:
    """One value: its aval, what it depends on, its constant value if known, its producer."""

    __slots__ = ("aval", "facts", "info", "producer", "value")

    def __init__(self, aval: Any, info: Info, value: Any = None, producer: Any = None):
        self.aval = aval
        self.info = info
        self.value = value  # a literal's or a closed-over constant's value, else None
        self.producer = producer  # the FlatEqn making it (top scope only), else None
        self.facts: dict[str, Any] = {}  # index facts for idiom recognition


class FlatEqn(NamedTuple):
    """An equation of the flat program (the top scope, calls inlined), and its user site."""

    eqn: Any
    ins: tuple[Node, ...]
    outs: tuple[Node, ...]
    site: Site


class Loop(NamedTuple):
    """An enclosing ``scan`` or ``while``: its equation and its marker origin."""

    eqn: Any
    marker: Origin


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Where the walker is: call path, enclosing loops and device maps, silence."""

    path: tuple[int, ...] = ()
    loops: tuple[Loop, ...] = ()
    device_maps: tuple[Any, ...] = ()
    top: bool = True  # in the flat program (no enclosing loop, branch or device map)
    silent: bool = False  # a fixpoint iteration: rules must not report
    site: Site = UNKNOWN  # the user site of the innermost enclosing equation that has one
    callers: tuple[Site, ...] = ()  # that equation's user frames, innermost first

    def enter(self, eqn: Any, **changes: Any) -> Ctx:
        callers = traced_sites(eqn) or self.callers
        return dataclasses.replace(
            self, path=(*self.path, id(eqn)), site=self.site_of(eqn), callers=callers, **changes
        )

    def site_of(self, eqn: Any) -> Site:
        """``eqn``'s innermost user frame, else the enclosing call's.

        JAX cuts the traceback of an equation inside a ``jit`` at the jit's
        boundary, so an equation of a library's jitted function (the
        ``random_bits`` inside ``jax.random.normal``) has no user frame: its
        user site is the call's.
        """
        site = eqn_site(eqn)
        return self.site if site.file is None else site
