"""Canonical dots: a chunk program's bits do not depend on the process's CPU thread count."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unsplit._src import test_util as testing
from unsplit._src.bitwise import canonical_dots

# The bits across model-parallel degrees at XLA's default level, as users compile them.
pytestmark = pytest.mark.usefixtures("users_chunk_level")

# XLA's CPU compiler with no YNNPACK fusion: dots on Eigen, the path the guard must catch.
_YNN_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}


def _params():
    k = jax.random.split(jax.random.key(3), 3)
    return {
        "w1": jax.random.normal(k[0], (32, 48)) * 0.1,
        "w2": jax.random.normal(k[1], (48, 48)) * 0.1,
        "w3": jax.random.normal(k[2], (48, 4)) * 0.1,
    }


@jax.custom_vjp
def _scaled(x):
    return x @ x.T @ x


_scaled.defvjp(lambda x: (_scaled(x), x), lambda x, g: (g @ x.T @ x,))


def _loss(p, x):
    """Dots inside remat, scan, cond, custom_jvp (relu), custom_vjp; einsums, matvecs."""
    h = jax.checkpoint(lambda h: jnp.tanh(h @ p["w1"]))(x)
    h = jax.nn.relu(h)
    h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ p["w2"]), None), h, None, length=2)
    h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h @ p["w2"], lambda h: -h, h)
    h = h + 0.01 * _scaled(h)
    out = jnp.einsum("bh,ho->bo", h, p["w3"])
    a, b = h.reshape(-1, 6, 8), h.reshape(-1, 8, 6)
    matvec = jnp.sum(jnp.sin(h @ p["w3"][:, 0])) + jnp.sum(jnp.einsum("bi,bj->bij", h, x) ** 2)
    return jnp.sum(out**2) + jnp.sum(jnp.einsum("bij,bjk->bik", a, b) ** 2) + matvec


def test_rewrite_keeps_values_and_leaves_no_eigen_dot():
    f = jax.value_and_grad(_loss)
    x = jax.random.normal(jax.random.key(4), (16, 32))
    reference = jax.jit(f)(_params(), x)
    lowered = jax.jit(canonical_dots.canonicalize(f)).lower(_params(), x)
    compiled = lowered.compile(compiler_options=canonical_dots.cpu_options())
    # Rounding only: the elementwise ops run in XLA's loops, not YNNPACK's (as by default).
    assert testing.rel_l2(compiled(_params(), x), reference) < 1e-5
    assert not any(canonical_dots.plain_ops(compiled.as_text()).values())
    canonical_dots.check_cpu_program(compiled)  # no error, no warning
    # Without the YNNPACK dot fusions the program runs its weight-gradient dots on Eigen
    # (XLA's default before JAX 0.12.1; since then XLA's default takes YNNPACK for them too).
    plain = jax.jit(f).lower(_params(), x).compile(compiler_options=_YNN_OFF)
    assert canonical_dots.plain_ops(plain.as_text())["dot"]


def test_guard_names_the_eigen_dots_and_the_fix():
    f = jax.grad(lambda w, x: jnp.sum((x @ w) ** 2))
    lowered = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((256, 64)))
    compiled = lowered.compile(compiler_options=_YNN_OFF)
    with pytest.warns(UserWarning, match=r"(?s)Eigen path.*Expected: every dot.*got:.*Fix:"):
        canonical_dots.check_cpu_program(compiled)


def test_integer_dots_pass_and_complex_dots_warn():
    def f(a, b):
        return (a.T @ b).astype(jnp.float32), jnp.real(
            a.astype(jnp.complex64).T @ b.astype(jnp.complex64)
        )

    a, b = jnp.ones((64, 32), jnp.int32), jnp.ones((64, 32), jnp.int32)
    compiled = (
        jax.jit(canonical_dots.canonicalize(f))
        .lower(a, b)
        .compile(compiler_options=canonical_dots.cpu_options())
    )
    found = canonical_dots.plain_ops(compiled.as_text())
    assert not found["dot"]
    if found["complex dot"]:
        with pytest.warns(UserWarning, match="complex dot"):
            canonical_dots.check_cpu_program(compiled)


def test_convolutions_warn():
    def conv(w, x):
        return jnp.sum(jax.lax.conv(x, w, (1, 1), "SAME") ** 2)

    w, x = jnp.ones((4, 3, 3, 3)), jnp.ones((2, 3, 8, 8))
    compiled = (
        jax.jit(canonical_dots.canonicalize(jax.grad(conv)))
        .lower(w, x)
        .compile(compiler_options=canonical_dots.cpu_options())
    )
    if not canonical_dots.plain_ops(compiled.as_text())["convolution"]:
        pytest.skip("this XLA runs no convolution on Eigen")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        canonical_dots.check_cpu_program(compiled)
    assert any("thread count" in str(w.message) for w in caught)


# One bitwise step on a one-device mesh, in a process pinned to one CPU with `devices`
# simulated devices: the CPU client's thread pool then has max(1, devices) threads.
_SCRIPT = textwrap.dedent(
    """
    import os, sys, json
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    # No YNNPACK fusion unless a compile asks for it (the canonical programs do): the plain
    # program's dots then run on Eigen, as XLA's default did for them before JAX 0.12.1.
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=" + sys.argv[1]
                               + " --xla_cpu_experimental_ynn_fusion_type=")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    import unsplit
    from unsplit._src.bitwise import programs

    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (64, 64)) * 0.05,
              "w2": jax.random.normal(k[1], (64, 64)) * 0.05,
              "w3": jax.random.normal(k[2], (64, 16)) * 0.05}
    batch = {"x": jax.random.normal(k[3], (512, 64)), "y": jnp.zeros((512, 16))}

    def loss(p, ex, key):
        h = jnp.tanh(ex["x"] @ p["w1"])
        h = jnp.tanh(h @ p["w2"])
        return jnp.sum((h @ p["w3"] - ex["y"]) ** 2)

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    out = {}
    for canonical in (True, False):
        programs.CANONICAL_DOTS = canonical
        step = unsplit.value_and_grad(loss, mesh=mesh, bitwise=True, chunk_size=512)
        _, grads = step(params, batch, jax.random.key(1))[:2]
        out[str(canonical)] = {n: np.asarray(g).view(np.uint32).tolist() for n, g in grads.items()}
    print(json.dumps(out))
    """
)


def _bits(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(devices)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh processes
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_same_bits_whatever_the_thread_count():
    one, many = _bits(1), _bits(16)  # thread pools of 1 and 16 threads
    assert one["True"] == many["True"]
    # Negative control: without canonical dots the weight gradients differ -- measured up to
    # JAX 0.12.0; on JAX 0.12.1 XLA's CPU dots gave the same bits at 1 and 16 threads here,
    # on Eigen too (this test runs in the full suite, on the oldest JAX).
    if jax.__version_info__ < (0, 12, 1):
        assert one["False"] != many["False"]


def _tanh_loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def test_canonical_chunk_programs_compute_weight_gradients_without_a_transpose():
    # The bitwise chunk program fences every dot, so XLA cannot fold the transpose JAX
    # writes after a weight gradient's dot: it was copied element by element (118 ms
    # for a 1024 x 4096 weight on 8 simulated devices). Folded, only the activations'
    # small (8-row) operands are laid out by a transpose; the weight-sized output is not.
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(64, 128)) / 8, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
    fn = jax.jit(canonical_dots.canonicalize(jax.grad(_tanh_loss)))
    text = fn.lower(w, x).compile(canonical_dots.cpu_options()).as_text()
    moved = re.findall(r"f32\[(\d+),(\d+)\]\{[\d,]+\} transpose\(", text)
    assert moved, "expected the activations' operand transposes"
    assert all(8 in (int(m), int(n)) for m, n in moved), moved
    np.testing.assert_allclose(fn(w, x), jax.grad(_tanh_loss)(w, x), rtol=1e-5, atol=1e-5)


_FMA_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from unsplit._src.bitwise import canonical_dots

    rng = np.random.default_rng(0)
    x, y, z = (rng.normal(size=20000).astype(np.float32) for _ in range(3))
    two = (x * y).astype(np.float32) + z  # each operation rounded
    one = (x.astype(np.float64) * y + z).astype(np.float32)  # a fused multiply-add
    pick = two != one
    args = (x[pick], y[pick], z[pick])
    fn = lambda x, y, z: x * y + z
    out = {}
    ways = {
        "xla": (fn, None),
        "chunk": (canonical_dots.canonicalize(fn), canonical_dots.cpu_options()),
        "level 0": (fn, canonical_dots.exact_elementwise()),
    }
    for name, (f, options) in ways.items():
        got = np.asarray(jax.jit(f, compiler_options=options)(*args))
        out[name] = [float(np.mean(got == two[pick])), float(np.mean(got == one[pick]))]
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # a fresh process at XLA's default level (the suite compiles at level 0)
def test_bitwise_cpu_programs_round_every_multiply_and_add():
    # At XLA's default CPU level a multiply feeding an add is one fused multiply-add, so
    # the bits follow XLA's fusion choices (other programs at other degrees: other bits).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", _FMA_SCRIPT], capture_output=True, text=True, timeout=120,
        env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["chunk"] == [1.0, 0.0]  # every element rounded after the multiply
    assert out["level 0"] == [1.0, 0.0]
    assert out["xla"] == [0.0, 1.0]  # negative control: XLA's default level fuses them


_LEVEL_3 = {"xla_backend_optimization_level": "3"}


def test_a_product_gives_the_same_bits_fused_or_not():
    # The same `x * w + b` in a program that also returns `x * w` (the product materialized,
    # rounded) and in one that does not (XLA:CPU fuses it into the add): the chunk programs
    # round every product on its own, so both give the same bits, at XLA's default level.
    rng = np.random.default_rng(0)
    x, w, b = (rng.normal(size=4096).astype(np.float32) for _ in range(3))

    def both(x, w, b):
        y = x * w
        return y + b, y

    def fused(x, w, b):
        return x * w + b

    def run(fn, options):
        return np.asarray(jax.jit(fn, compiler_options=options)(x, w, b)[0])

    chunk = canonical_dots.cpu_options()
    ours = [run(canonical_dots.canonicalize(f), chunk) for f in (both, lambda *a: (fused(*a),))]
    np.testing.assert_array_equal(ours[0].view(np.uint32), ours[1].view(np.uint32))
    np.testing.assert_array_equal(ours[1], (x * w).astype(np.float32) + b)
    # Negative control: XLA's own at its default level fuses one and not the other.
    plain = [run(f, _LEVEL_3) for f in (both, lambda *a: (fused(*a),))]
    assert np.sum(plain[0] != plain[1]) > 100


def test_rounded_keeps_every_bit():
    specials = np.array([0.0, -0.0, 1.5, -3e-39, np.inf, -np.inf, np.nan, 3.4e38], np.float32)
    bits = np.concatenate([specials.view(np.uint32), np.arange(0, 2**32, 9973, dtype=np.uint32)])
    got = np.asarray(jax.jit(canonical_dots.rounded)(bits.view(np.float32)))
    np.testing.assert_array_equal(got.view(np.uint32), bits)
    half = jnp.array([1.5, -2.0], jnp.bfloat16)
    assert canonical_dots.rounded(half).dtype == jnp.bfloat16
    assert canonical_dots.rounded(jnp.arange(3)).dtype == jnp.arange(3).dtype  # ints: as they are


def _put_back(a, b):
    """Two [16, 16] blocks of rows back in place, as the canonical-block rewrite puts them
    (a stack, a transpose, a reshape): XLA fuses them with the op that reads the result."""
    stacked = jnp.stack([a.reshape(4, 4, 16), b.reshape(4, 4, 16)])
    return jnp.moveaxis(stacked, 0, 1).reshape(4, 8, 16)


_SIGNED = (np.random.default_rng(0).normal(size=512) * 3).astype(np.float32)


def _three_ways(fn, x, options):
    """``fn`` of the same elements: alone (512 of them), one at a time, and fused with the
    blocks' put-back; each as computed under ``options``."""
    alone = jax.jit(fn, compiler_options=options)
    one = np.array([np.asarray(alone(x[i : i + 1]))[0] for i in range(0, x.size, 4)])
    a, b = x[:256].reshape(16, 16), x[256:].reshape(16, 16)
    fused = jax.jit(lambda a, b: fn(_put_back(a, b)), compiler_options=options)(a, b)
    put = jax.jit(_put_back)(alone(a), alone(b))
    return np.asarray(alone(x)), one, np.asarray(fused), np.asarray(put)


def test_a_chunk_programs_tanh_has_one_code_path():
    # XLA:CPU computed tanh in more than one way at level 0, chosen by the fusion: tanh at 8
    # sequence devices (one canonical block each, alone in its fusion) gave other gradients
    # than at 4 (fused with the blocks' put-back). The chunk programs' tanh is expm1's.
    alone, one, fused, put = _three_ways(
        canonical_dots.canonicalize(jnp.tanh), _SIGNED, canonical_dots.cpu_options()
    )
    np.testing.assert_array_equal(one, alone[::4])
    np.testing.assert_array_equal(fused, put)
    # Negative control: XLA's own tanh, at level 0 too.
    level_0 = {"xla_backend_optimization_level": "0"}
    alone, one, fused, put = _three_ways(jnp.tanh, _SIGNED, level_0)
    assert np.any(fused != put) or np.any(one != alone[::4])


def _lengths_that_differ(fn, options) -> list[int]:
    """The lengths 1-19 at which ``fn`` of a slice gives other bits than of the whole array."""
    x = (np.random.default_rng(0).normal(size=4099) * 3).astype(np.float32)
    compiled = jax.jit(fn, compiler_options=options)
    whole = np.asarray(compiled(x)).view(np.uint32)
    return [
        n
        for n in range(1, 20)
        if any(
            np.any(np.asarray(compiled(x[s : s + n])).view(np.uint32) != whole[s : s + n])
            for s in range(0, 200, 11)
        )
    ]


def test_a_chunk_programs_exp_has_one_code_path_at_every_length():
    assert (
        _lengths_that_differ(canonical_dots.canonicalize(jnp.exp), canonical_dots.cpu_options())
        == []
    )
    if canonical_dots._legacy_emitter():  # negative control: XLA's own exp on this XLA
        assert _lengths_that_differ(jnp.exp, _LEVEL_3) != []


def test_the_chunk_programs_exp_is_exp():
    if not canonical_dots._legacy_emitter():
        pytest.skip("XLA's own exp (one code path on this XLA)")
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            rng.uniform(-87, 88.7, 600000),
            rng.normal(size=300000) * 3,
            rng.normal(size=300000) * 1e-4,
        ]
    ).astype(np.float32)
    fn = jax.jit(canonical_dots.canonicalize(jnp.exp))
    got = np.asarray(fn(x), np.float64)
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(got - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    # Measured 3.9 (3.3 below 88); XLA's own exp: 1.0 below 88, 3.9 near overflow.
    assert ulps.max() <= 5, ulps.max()
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -150.0, 89.0], np.float32)
    np.testing.assert_array_equal(np.asarray(fn(special)), [1, 1, np.inf, 0, np.nan, 0, np.inf])
    half_x = jnp.asarray(x[600000:600100], jnp.bfloat16)
    half = fn(half_x)
    assert half.dtype == jnp.bfloat16
    want = np.exp(np.asarray(half_x, np.float64))
    np.testing.assert_allclose(np.asarray(half, np.float64), want, rtol=1e-2)
