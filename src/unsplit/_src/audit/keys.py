"""Where keys come from: the walk's rules for PRNG draws, key origins and devices.

How ``jax.random`` appears in a jaxpr (JAX 0.10): ``jax.random.key(s)`` is
``random_seed``; ``fold_in``/``split`` are ``random_fold_in``/``random_split``;
every draw (``bernoulli``, ``normal``, ...) bottoms out in ``random_bits`` on a
typed key (inside ``jit`` calls, which the walker inlines); ``key_data`` and
``wrap_key_data`` are ``random_unwrap``/``random_wrap``; the raw hash
``jax.extend.random.threefry_2x32`` is ``threefry2x32``, which is a *draw*
when its output is used as random bits and a *key derivation* when its
output becomes key material (``unsplit.example_keys`` hashes ids into keys).
Which one is only known downstream, so each ``threefry2x32`` marks its
outputs with a ``hash`` origin, and uses of that origin as a key are noted.

Device dependence enters through ``axis_index`` and through keys that a
``shard_map`` (or ``pmap``) splits over a mesh axis. One idiom is recognised
as device-independent: a global position ``axis_index(a) * n + iota(n)``
(what ``unsplit.value_and_grad`` computes for default ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from unsplit._src.audit.finding import Site
from unsplit._src.audit.graph import Rules, is_key_aval, union, used_as_key
from unsplit._src.audit.values import COLLECTIVES, Ctx, Info, Node, Origin

THREEFRY_DTYPE = "key<fry>"
# Primitives that keep an index value as it is (casts, reshapes, varying-axis casts).
_SAME_INDEX = frozenset(
    {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p"}
    | {"pvary", "pcast"}
)


class Draw(NamedTuple):
    """One random draw seen by the walk."""

    eqn: Any
    site: Site
    key_info: Info  # what the key operand(s) depend on
    key_shapes: tuple[tuple[int, ...], ...]
    key_dtype: str  # "key<fry>", "key<rbg>", ... or "uint32" for raw words
    shape: tuple[int, ...]  # the drawn shape, per key
    ctx: Ctx
    hash_tag: Any  # threefry2x32: the tag of its ``hash`` origin, else None


class Collective(NamedTuple):
    eqn: Any
    site: Site
    ctx: Ctx


class KeyRules(Rules):
    """Records draws and collectives; tracks seeds, device keys and hash uses."""

    def __init__(self) -> None:
        self.draws: list[Draw] = []
        self.collectives: list[Collective] = []
        self.key_material: set[Any] = set()  # hash tags whose output became a key
        self._seen: set[tuple] = set()

    def transfer(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        name = eqn.primitive.name
        if name == "random_seed":
            origin = Origin("seed", "jax.random.key (or PRNGKey)", ctx.site_of(eqn))
            _add(outs, origin)
        elif name == "axis_index":
            axis = eqn.params.get("axis_name")
            site = ctx.site_of(eqn)
            _add(outs, Origin("device", f"jax.lax.axis_index({axis!r})", site, tag=("axis", axis)))
            outs[0].facts["axis"] = (axis, 1)
        elif name == "threefry2x32":
            _add(outs, Origin("hash", "threefry2x32", ctx.site_of(eqn), tag=(ctx.path, id(eqn))))
        _index_idiom(name, eqn, ins, outs)

    def visit(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        name = eqn.primitive.name
        for i in used_as_key(eqn):
            self.key_material |= {o.tag for o in ins[i].info if o.kind == "hash"}
        if (ctx.path, id(eqn)) in self._seen:
            return
        self._seen.add((ctx.path, id(eqn)))
        if name in COLLECTIVES:
            self.collectives.append(Collective(eqn, ctx.site_of(eqn), ctx))
        if name == "random_bits":
            self._draw(eqn, ins[:1], tuple(eqn.params["shape"]), ctx, None)
        elif name == "threefry2x32":
            tag = (ctx.path, id(eqn))
            self._draw(eqn, ins[:2], tuple(outs[0].aval.shape), ctx, tag)
        elif name == "rng_bit_generator":
            self._draw(eqn, ins[:1], tuple(outs[-1].aval.shape), ctx, None)

    def after_call(self, eqn: Any, ins: Sequence[Node], outs: Sequence[Node], ctx: Ctx) -> None:
        """A jitted threefry (``jit[name=threefry2x32](k0, k1, x0, x1)``) counts as the primitive.

        Libraries write the cipher in plain ``jnp`` inside a ``jit`` (unsplit's
        own masks do, so XLA fuses its rounds): once inlined it is only adds
        and xors, so the call's name is what marks it as a hash.
        """
        name = str(eqn.params.get("name", ""))
        if "threefry" not in name or len(ins) != 4 or not outs:
            return
        tag = (ctx.path, id(eqn))
        _add(outs, Origin("hash", name, ctx.site_of(eqn), tag=tag))
        for node in ins[:2]:
            self.key_material |= {o.tag for o in node.info if o.kind == "hash"}
        if not ctx.silent and (ctx.path, id(eqn)) not in self._seen:
            self._seen.add((ctx.path, id(eqn)))
            self._draw(eqn, ins[:2], tuple(outs[0].aval.shape), ctx, tag)

    def _draw(self, eqn, keys: Sequence[Node], shape, ctx: Ctx, tag) -> None:
        aval = keys[0].aval
        dtype = str(aval.dtype)
        self.draws.append(
            Draw(
                eqn,
                ctx.site_of(eqn),
                union(k.info for k in keys),
                tuple(tuple(k.aval.shape) for k in keys),
                dtype,
                shape,
                ctx,
                tag,
            )
        )

    def enter_map(self, eqn: Any, ins: Sequence[Node], ctx: Ctx) -> list[Info]:
        """Keys that a ``shard_map``/``pmap`` splits over devices become device keys."""
        site = ctx.site_of(eqn)
        name = eqn.primitive.name
        if name == "shard_map":
            specs = eqn.params.get("in_specs", ())
            split = [any(a is not None for a in spec) for spec in specs]
        else:
            split = [a is not None for a in eqn.params.get("in_axes", ())]
        closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = getattr(getattr(closed, "jaxpr", closed), "invars", None)
        out = []
        for i, (node, is_split) in enumerate(
            zip(ins, split + [False] * (len(ins) - len(split)), strict=True)
        ):
            # Each device gets one key; a block of several is per-example keys, split fairly.
            block = inner[i].aval if inner is not None and name == "shard_map" else None
            if is_split and _keylike(node.aval) and (block is None or _key_count(block) == 1):
                label = "a key array split over devices by shard_map or pmap (one key per device)"
                out.append(frozenset({Origin("device", label, site, tag=("map", id(eqn)))}))
            else:
                out.append(frozenset())
        return out

    def draws_of(self, *, resolved: bool = True) -> list[Draw]:
        """The draws, without hashes whose output turned out to be key material."""
        if not resolved:
            return list(self.draws)
        return [d for d in self.draws if d.hash_tag is None or d.hash_tag not in self.key_material]


def default_impl_note() -> str:
    """`` (jax_default_prng_impl is 'rbg' ...)`` when JAX's default key is not threefry, else ''."""
    # A flag with a context manager: read as an attribute (jax.config.read refuses it).
    impl = str(getattr(jax.config, "jax_default_prng_impl"))  # noqa: B009
    if impl == "threefry2x32":
        return ""
    return (
        f" (jax.config's jax_default_prng_impl is {impl!r}, so jax.random.key(seed) and "
        "PRNGKey(seed) make such keys; set it back to 'threefry2x32')"
    )


def _key_count(aval: Any) -> int:
    """How many keys an array of keys holds (raw ``uint32[..., 2]`` words: two a key)."""
    shape = tuple(getattr(aval, "shape", ()))
    return int(np.prod(shape if is_key_aval(aval) else shape[:-1]))


def _keylike(aval: Any) -> bool:
    """A typed key array, or raw ``uint32[..., 2]`` key words."""
    if is_key_aval(aval):
        return True
    shape = getattr(aval, "shape", ())
    return str(getattr(aval, "dtype", "")) == "uint32" and len(shape) >= 2 and shape[-1] == 2


def _add(outs: Sequence[Node], origin: Origin) -> None:
    for node in outs:
        node.info = node.info | {origin}


def _index_idiom(name: str, eqn: Any, ins: Sequence[Node], outs: Sequence[Node]) -> None:
    """Tracks ``axis_index * n`` and ``iota(n)`` to recognise a global position."""
    if name in _SAME_INDEX and len(ins) == len(outs):
        for a, out in zip(ins, outs, strict=True):
            out.facts.update({k: v for k, v in a.facts.items() if k in ("axis", "iota")})
            factor = _scalar(a)
            if factor is not None:
                out.facts["int"] = factor
    elif name == "iota":
        shape = tuple(eqn.params["shape"])
        if len(shape) == 1:
            outs[0].facts["iota"] = shape[0]
    elif name == "mul" and len(ins) == 2:
        for a, b in (ins, ins[::-1]):
            factor = _scalar(b)
            if "axis" in a.facts and factor is not None:
                axis, coef = a.facts["axis"]
                outs[0].facts["axis"] = (axis, coef * factor)
    elif name == "add" and len(ins) == 2:
        for a, b in (ins, ins[::-1]):
            if "axis" in a.facts and a.facts["axis"][1] == b.facts.get("iota"):
                axis = a.facts["axis"][0]
                # axis_index * n + arange(n): a global position, the same on any device count.
                gone = {o for o in outs[0].info if o.tag == ("axis", axis)}
                outs[0].info = outs[0].info - gone


def _scalar(node: Node) -> int | None:
    if "int" in node.facts:
        return node.facts["int"]
    if node.value is None:
        return None
    try:
        value = np.asarray(node.value)
    except Exception:  # e.g. a tracer of an enclosing trace
        return None
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        return None
    return int(value.reshape(()))
