"""``unsplit audit MODULE:FACTORY``: output, --strict, --json, and factory errors."""

import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

import unsplit
from unsplit import cli
from unsplit.audit_corpus import batched, per_example

PROBLEM = "unsplit.audit_corpus.batched:same_key_microbatches"
CLEAN = "unsplit.audit_corpus.clean:vmapped_example_keys"


def _run(capsys, argv):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_explains_the_audit_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "audit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for words in ("MODULE:FACTORY", "(fn, args)", "(loss_fn, args, options)", "--strict", "--json"):
        assert words in out
    assert "exit status" in out and "mean_of_means" in out


def test_default_output_is_one_panel_per_finding_with_the_source_line(capsys):
    code, out, _ = _run(capsys, ["audit", PROBLEM])
    assert code == 0
    assert out.count("╭─ batch_draw") == 1
    assert "fix:" in out and "unsplit.value_and_grad" in out
    lines = pathlib.Path(batched.__file__).read_text().splitlines()
    line = next(i + 1 for i, t in enumerate(lines) if t.endswith("# expect: same_key_microbatches"))
    assert f"audit_corpus/batched.py:{line}" in out
    assert "jax.random.bernoulli(sub, 0.9" in out  # the source line itself
    assert "1 finding(s) in" in out


@pytest.mark.parametrize(("target", "code"), [(PROBLEM, 1), (CLEAN, 0)])
def test_strict_exits_1_on_any_finding(capsys, target, code):
    got, out, _ = _run(capsys, ["audit", target, "--strict"])
    assert got == code
    assert ("no findings" in out) == (code == 0)


def test_json_lists_the_findings(capsys):
    code, out, _ = _run(capsys, ["audit", "unsplit.audit_corpus.per_example:rbg_key", "--json"])
    assert code == 0
    (finding,) = json.loads(out)
    assert set(finding) == {"kind", "message", "fix", "file", "line"}
    assert finding["kind"] == "unsafe_key" and finding["file"] == per_example.__file__
    assert isinstance(finding["line"], int)
    _, clean, _ = _run(capsys, ["audit", CLEAN, "--json"])
    assert json.loads(clean) == []


def test_a_file_path_factory(tmp_path, capsys):
    path = tmp_path / "mystep.py"
    path.write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp

            def make():
                def step(w, x, key):
                    keep = jax.random.bernoulli(key, 0.9, x.shape)
                    return jnp.sum(jnp.where(keep, x, 0.0) @ w)
                return step, (jnp.ones(3), jnp.ones((8, 3)), jax.random.key(0))
            """
        )
    )
    code, out, _ = _run(capsys, ["audit", f"{path}:make", "--json", "--strict"])
    assert code == 1
    (finding,) = json.loads(out)
    assert (finding["kind"], finding["file"], finding["line"]) == ("batch_draw", str(path), 6)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon_here", "expected MODULE:FACTORY"),
        ("no.such.module:make", "could not import module 'no.such.module'"),
        ("unsplit.audit_corpus.batched:nope", "has no attribute 'nope'"),
        ("unsplit.audit_corpus.batched:MICROBATCHES", "is a int, not a function"),
        ("unsplit.audit_corpus._data:key", "must return (fn, args) or (loss_fn, args, options)"),
        ("/no/such/file.py:make", "no such file"),
    ],
)
def test_factory_errors_exit_2_with_the_fix(capsys, target, message):
    code, out, err = _run(capsys, ["audit", target])
    assert code == 2 and out == ""
    assert message in err and err.startswith("unsplit audit: ") and "Fix:" in err


def test_factory_results_are_checked(capsys, monkeypatch):
    def raises():
        raise RuntimeError("no data today")

    def args_not_a_tuple():
        step, args = batched.batch_level_dropout()
        return step, {"w": args[0]}

    def options_not_a_dict():
        loss_fn, args, _ = per_example.closure_key()
        return loss_fn, args, ["weighted"]

    def wrong_option():
        loss_fn, args, _ = per_example.closure_key()
        return loss_fn, args, {"weigted": True}

    def does_not_trace():
        step, args = batched.batch_level_dropout()
        return step, args[:2]  # the key is missing

    def not_callable():
        return 42, ()

    cases = {
        "raises": "raised RuntimeError: no data today",
        "does_not_trace": "does_not_trace() returned failed: TypeError",
        "not_callable": "returned fn=42, which is not callable",
        "args_not_a_tuple": "expected a tuple of fn's positional inputs",
        "options_not_a_dict": "expected a dict of unsplit.audit options",
        "wrong_option": "accepts weighted and has_aux",
    }
    for name, message in cases.items():
        monkeypatch.setattr(batched, name, locals()[name], raising=False)
        code, _, err = _run(capsys, ["audit", f"unsplit.audit_corpus.batched:{name}"])
        assert code == 2 and message in err and "Fix:" in err, (name, err)


def test_a_module_that_fails_to_import(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("raise ImportError('missing dependency')\n")
    code, _, err = _run(capsys, ["audit", f"{path}:make"])
    assert code == 2 and "raised ImportError: missing dependency" in err and "Fix:" in err


def test_an_unsplit_step_is_audited_as_it_calls_its_loss(capsys, monkeypatch):
    def bitwise_step():  # a bitwise step cannot be traced; its per-example loss can
        loss_fn, args, _ = per_example.closure_key()
        return unsplit.value_and_grad(loss_fn, bitwise=True, chunk_size=4), args

    monkeypatch.setattr(batched, "bitwise_step", bitwise_step, raising=False)
    code, out, _ = _run(capsys, ["audit", "unsplit.audit_corpus.batched:bitwise_step", "--json"])
    assert code == 0
    assert [(f["kind"], f["file"]) for f in json.loads(out)] == [
        ("foreign_key", per_example.__file__)
    ]


def test_the_output_shown_in_the_docs_is_real(capsys, monkeypatch):
    root = pathlib.Path(__file__).resolve().parents[3]
    text = (root / "docs" / "audit.md").read_text()
    block = text.split("### Real output", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(root)
    runs = block.split("$ unsplit ")[1:]
    assert len(runs) >= 4
    for run in runs:
        command, _, shown = run.partition("\n")
        argv = command.split(";")[0].split()
        with jax.numpy_dtype_promotion("standard"):  # the corpus is user code (optax)
            code, out, err = _run(capsys, argv)
        assert not err, err
        expected = [line for line in shown.splitlines() if not line.startswith("exit status")]
        got = out.replace(str(root), "...").splitlines()
        assert [line.rstrip() for line in got] == [line.rstrip() for line in expected if line], argv
        if "exit status" in shown:
            assert f"exit status {code}" in shown, argv


def test_python_m_unsplit_audit_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "unsplit", "audit", PROBLEM, "--strict", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert [f["kind"] for f in json.loads(proc.stdout)] == ["batch_draw"]
