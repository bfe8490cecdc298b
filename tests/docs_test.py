"""The README's quickstart and the docs' code blocks run as written."""

import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python_blocks(path: pathlib.Path) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert blocks, f"{path.name} has no python block"
    return blocks


def run_blocks(path: pathlib.Path, blocks: list[str]) -> dict:
    namespace: dict = {}
    with jax.numpy_dtype_promotion("standard"):  # user code, not the tests' strict mode
        for i, block in enumerate(blocks):
            exec(compile(block, f"{path.name} block {i + 1}", "exec"), namespace)
    return namespace


def test_readme_quickstart_runs():
    namespace = run_blocks(ROOT / "README.md", python_blocks(ROOT / "README.md")[:1])
    assert float(namespace["loss"]) > 0


@pytest.mark.parametrize("page", ["models.md"])
def test_every_code_block_of_the_page_runs(page):
    path = ROOT / "docs" / page
    namespace = run_blocks(path, python_blocks(path))
    assert "loss" in namespace
