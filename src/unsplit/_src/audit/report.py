"""``unsplit audit MODULE:FACTORY``: load a factory, audit what it returns, print the findings.

The factory is a function of no arguments. What it returns decides the check:

* ``(fn, args)``: an ordinary batched step, ``unsplit.audit_step(fn, *args)``;
  when ``fn`` is an ``unsplit`` step (``unsplit.value_and_grad(...)``), its
  per-example loss is audited instead, as the step calls it
  (``unsplit.audit(fn.loss_fn, params, batch, key, weighted=fn.weighted)``):
  the rest of the step is unsplit's own (and a bitwise step cannot be traced);
* ``(loss_fn, args, options)`` with ``options`` a dict: a per-example loss,
  ``unsplit.audit(loss_fn, *args, **options)`` (``options`` such as
  ``{"weighted": True}``; ``{}`` for none).

``MODULE`` is a module name importable from the current directory
(``mypkg.train``) or a path to a file (``train.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import linecache
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from unsplit._src.audit.api import audit, audit_step
from unsplit._src.audit.finding import Finding


class FactoryError(Exception):
    """The factory could not be loaded, called, or its result audited (the message says why)."""


def load_factory(spec: str) -> Callable[[], Any]:
    """The function named by ``MODULE:FACTORY`` (a module name or a ``.py`` path)."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise FactoryError(
            f"expected MODULE:FACTORY (e.g. mypkg.train:make_step or train.py:make_step); got "
            f"{spec!r}. Fix: name the module and the factory function, separated by ':'."
        )
    module = _import(module_name)
    if not hasattr(module, name):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise FactoryError(
            f"module {module_name!r} has no attribute {name!r}; its public functions are: "
            f"{', '.join(names) or 'none'}. Fix: name a factory function defined in it."
        )
    factory = getattr(module, name)
    if not callable(factory):
        raise FactoryError(
            f"{spec} is a {type(factory).__name__}, not a function. Fix: point at a function "
            "of no arguments that returns (fn, args)."
        )
    return factory


def _import(module_name: str) -> Any:
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise FactoryError(f"no such file {path!r}. Fix: check the path before ':'.")
        spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path
        )
        if spec is None or spec.loader is None:
            raise FactoryError(f"cannot load {path!r} as a Python module. Fix: name a .py file.")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise FactoryError(
                f"importing {path} raised {type(e).__name__}: {e}. Fix: the file must import "
                f"without errors (try python {path})."
            ) from e
        finally:
            sys.path.remove(os.path.dirname(path))
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise FactoryError(
            f"could not import module {module_name!r} ({e}). Fix: run from the directory that "
            "contains it, install it, or pass a file path (path/to/train.py:factory)."
        ) from e
    except Exception as e:
        raise FactoryError(
            f"importing {module_name!r} raised {type(e).__name__}: {e}. Fix: the module must "
            f"import without errors (try python -c 'import {module_name}')."
        ) from e


def audit_factory(
    factory: Callable[[], Any],
    name: str = "the factory",
    *,
    batch_argnums: Sequence[int] | None = None,
) -> list[Finding]:
    """Calls ``factory()`` and audits what it returns (see the module docs).

    ``batch_argnums`` (``--batch-args``) names the batch among a ``(fn, args)``
    step's arguments; it is refused for a per-example loss, whose batch is fixed.
    """
    try:
        result = factory()
    except Exception as e:
        raise FactoryError(
            f"calling {name}() raised {type(e).__name__}: {e}. Fix: the factory must run "
            "without arguments and return the function and its example inputs."
        ) from e
    fn, args, options = _unpack(result, name)
    per_example = options is not None or callable(getattr(fn, "loss_fn", None))
    if batch_argnums is not None and per_example:
        raise FactoryError(
            f"--batch-args {','.join(map(str, batch_argnums))} names the batch of an ordinary "
            f"step, but {name}() returned a per-example loss (or an unsplit step), whose batch "
            "is always its second argument. Fix: drop --batch-args."
        )
    if batch_argnums is not None and any(not 0 <= i < len(args) for i in batch_argnums):
        raise FactoryError(
            f"--batch-args {','.join(map(str, batch_argnums))} names arguments that {name}() "
            f"did not return: fn takes {len(args)} (positions 0 to {len(args) - 1}). Fix: "
            "name the positions of the batch among fn's arguments."
        )
    try:
        if options is not None:
            return audit(fn, *args, **options)
        if callable(getattr(fn, "loss_fn", None)):  # a step of unsplit.value_and_grad
            per_example = {"weighted": getattr(fn, "weighted", False)}
            if getattr(fn, "has_aux", False):
                per_example["has_aux"] = True
            return audit(fn.loss_fn, *args[:3], **per_example)
        return audit_step(fn, *args, batch_argnums=batch_argnums)
    except TypeError as e:
        if "unexpected keyword argument" in str(e) and options:
            raise FactoryError(
                f"{name}() returned options {sorted(options)}; unsplit.audit accepts weighted "
                "and has_aux. Fix: return one of those, or {} for none."
            ) from e
        raise FactoryError(_audit_failed(name, e)) from e
    except Exception as e:
        raise FactoryError(_audit_failed(name, e)) from e


def _audit_failed(name: str, error: BaseException) -> str:
    return (
        f"auditing what {name}() returned failed: {type(error).__name__}: {error}. Fix: the "
        "function must trace with those inputs (try jax.make_jaxpr(fn)(*args) or "
        "jax.eval_shape(fn, *args))."
    )


def _unpack(result: Any, name: str) -> tuple[Callable, Sequence[Any], dict | None]:
    expected = "(fn, args) or (loss_fn, args, options)"
    if not isinstance(result, tuple | list) or len(result) not in (2, 3):
        got = (
            f"a {len(result)}-tuple" if isinstance(result, tuple | list) else type(result).__name__
        )
        raise FactoryError(
            f"{name}() must return {expected}; got {got}. Fix: return the function and a "
            "tuple of its example inputs, e.g. return step, (params, batch, key)."
        )
    fn, args, *rest = result
    options = rest[0] if rest else None
    if not callable(fn):
        raise FactoryError(
            f"{name}() returned fn={fn!r}, which is not callable. Fix: return {expected}."
        )
    if not isinstance(args, tuple | list):
        raise FactoryError(
            f"{name}() returned args of type {type(args).__name__}; expected a tuple of fn's "
            "positional inputs. Fix: return fn, (params, batch, key) (note the tuple)."
        )
    if rest and not isinstance(options, dict):
        raise FactoryError(
            f"{name}() returned a third item of type {type(options).__name__}; expected a dict "
            'of unsplit.audit options, e.g. {"weighted": True}. Fix: return (loss_fn, args, {}).'
        )
    return fn, tuple(args), options


def to_json(findings: Sequence[Finding]) -> str:
    """The findings as a JSON list of ``{kind, message, fix, file, line}`` objects."""
    return json.dumps([f.to_dict() for f in findings], indent=2)


def _shown(path: str) -> str:
    """``path`` relative to the current directory when it is inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def render(findings: Sequence[Finding], target: str, file: Any = None) -> None:
    """One rich panel per finding (kind, message, fix, file:line and its source), then a summary."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    console = Console(file=file or sys.stdout, highlight=False, soft_wrap=False)
    for f in findings:
        body = Text()
        body.append(f.message + "\n\n")
        body.append("fix: ", style="bold green")
        body.append(f.fix + "\n")
        body.append(f"at {_shown(f.file)}:{f.line}" if f.file else "at <unknown>", style="cyan")
        source = linecache.getline(f.file, f.line).rstrip() if f.file and f.line else ""
        if source:
            body.append(f"\n  {f.line} | {source.strip()}", style="dim")
        console.print(Panel(body, title=f"[bold red]{f.kind}[/]", title_align="left"))
    if findings:
        kinds = ", ".join(sorted({f.kind for f in findings}))
        console.print(f"{len(findings)} finding(s) in {target}: {kinds}.")
    else:
        console.print(
            f"no findings in {target}. (The audit traces the function; the audit guide (https://unsplit.readthedocs.io/en/latest/audit/) lists "
            "what it cannot see.)"
        )
