"""The table, the JSON view and the PNG, from a small hand-made result."""

import json

from rich.console import Console

from unsplit.demo import report as demo_report


def _row(name, diff, *, bitwise=False, against="reference", same=None):
    return {
        "name": name,
        "devices": 8,
        "processes": 1,
        "microbatches": 1,
        "bitwise": bitwise,
        "final_loss": 2.5,
        "max_abs_param_diff": diff,
        "max_abs_param_diff_all": diff,
        "bit_identical": diff == 0.0 if same is None else same,
        "step_time_s": 0.01,
        "wall_s": 1.0,
        "compared_with": against,
        "losses": [3.0, 2.8, 2.5],
        "divergence": [[1, diff / 4], [2, diff / 2], [3, diff]],
    }


def _result():
    return {
        "config": {
            "steps": 3, "batch_size": 16, "length": 16, "width": 32, "layers": 1,
            "heads": 2, "dropout": 0.1, "learning_rate": 3e-3, "seed": 0, "points": 3,
        },
        "schedules": [
            _row("reference", 0.0),
            _row("8 devices", 2e-6),
            _row("reference, bitwise", 0.0, bitwise=True, against="reference, bitwise"),
            _row("8 devices, bitwise", 0.0, bitwise=True, against="reference, bitwise"),
        ],
        "contrast": [{**_row("per-device keys", 5e-2, against="flax baseline"), "scheme": "x"}],
        "baselines": [{"name": "flax baseline", "final_loss": 2.6, "step_time_s": 0.01,
                       "losses": [3.0, 2.9, 2.6]}],
        "skipped": [],
        "inert_params": ["['Block_0']['MultiHeadDotProductAttention_0']['key']['bias']"],
        "elapsed_s": 1.0,
    }  # fmt: skip


def test_table_shows_exact_zeros_and_the_contrast():
    console = Console(record=True, width=140)
    demo_report.print_report(_result(), console)
    text = console.export_text()
    assert "0 (exact)" in text and "5.0e-02" in text and "2.0e-06" in text
    assert "every schedule ends with bit-identical parameters" in text
    assert "key.bias" in text


def test_summary_flags_a_bitwise_row_that_is_not_identical():
    result = _result()
    result["schedules"][3] = _row(
        "8 devices, bitwise", 1e-7, bitwise=True, against="reference, bitwise"
    )
    assert any("NOT bit-identical" in line for line in demo_report.summary(result))


def test_json_puts_the_issue_keys_first(tmp_path):
    path = tmp_path / "out.json"
    demo_report.write_json(_result(), str(path))
    doc = json.loads(path.read_text())
    assert list(doc["schedules"][0])[:8] == list(demo_report._KEYS)
    assert doc["contrast"][0]["max_abs_param_diff"] == 5e-2


def test_plot_writes_a_png_with_zeros_on_the_floor(tmp_path):
    path = tmp_path / "demo.png"
    demo_report.plot(_result(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_diff():
    assert demo_report.format_diff(0.0) == "0 (exact)"
    assert demo_report.format_diff(1.234e-5) == "1.2e-05"
