"""A bitwise step on GPUs without deterministic ops warns once, naming the flags."""

import types
import warnings

import pytest

from unsplit._src.bitwise import accelerators


def gpus(n=2):
    return [types.SimpleNamespace(platform="gpu") for _ in range(n)]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(accelerators, "_warned", set())


def test_gpu_without_deterministic_ops_warns_once_with_the_fix(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    with pytest.warns(UserWarning, match=r"xla_gpu_deterministic_ops=true.*Fix: start every"):
        accelerators.warn_once_without_gpu_flags(gpus())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerators.warn_once_without_gpu_flags(gpus())  # once per process


@pytest.mark.parametrize(
    ("platform", "flags"),
    [("gpu", "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"), ("cpu", ""),
     ("tpu", "")],
)  # fmt: skip
def test_no_warning_with_the_flags_or_off_gpu(monkeypatch, platform, flags):
    monkeypatch.setenv("XLA_FLAGS", flags)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerators.warn_once_without_gpu_flags([types.SimpleNamespace(platform=platform)])
