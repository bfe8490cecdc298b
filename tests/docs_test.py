"""The README's quickstart and the docs' code blocks run as written."""

import importlib
import importlib.util
import os
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


@pytest.mark.parametrize("page", ["models.md", "coupled.md"])
def test_every_code_block_of_the_page_runs(page):
    path = ROOT / "docs" / page
    namespace = run_blocks(path, python_blocks(path))
    assert "loss" in namespace


@pytest.mark.multiprocess
def test_the_testing_docs_example_runs(tmp_path, monkeypatch):
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page.split("## A test of your own step on 2 processes", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "multiprocess_doc_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)  # the workers import it by name too
    example = importlib.import_module("multiprocess_doc_example")
    example.test_two_processes_compute_the_one_device_step()


def test_every_public_name_is_listed_on_its_api_page():
    """docs/api/*.md list each facade's __all__ (.ci/api_pages.py; ./dev docs checks the site)."""
    spec = importlib.util.spec_from_file_location("api_pages", ROOT / ".ci" / "api_pages.py")
    api_pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_pages)
    assert api_pages.check_markdown() == []
    assert "bitwise_cost" in api_pages.public_names(ROOT / "src/unsplit/testing/__init__.py")


def test_the_api_page_check_finds_a_missing_name(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("api_pages", ROOT / ".ci" / "api_pages.py")
    api_pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_pages)
    page = tmp_path / "linen.md"
    page.write_text((ROOT / "docs/api/linen.md").read_text().replace("        - Dropout\n", ""))
    source = ROOT / "src/unsplit/linen.py"
    monkeypatch.setattr(api_pages, "FACADES", {"unsplit.linen": (source, page)})
    assert api_pages.check_markdown() == [
        f"{page}: unsplit.linen.Dropout is in __all__, not listed"
    ]
