"""The README's quickstart runs as written."""

import pathlib
import re

import jax

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_quickstart_runs():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python block"
    namespace = {}
    with jax.numpy_dtype_promotion("standard"):  # user code, not the tests' strict mode
        exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert float(namespace["loss"]) > 0
