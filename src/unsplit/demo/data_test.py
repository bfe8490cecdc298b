"""The embedded dataset: deterministic, ragged, inside the vocabulary."""

import numpy as np

from unsplit.demo import config as demo_config
from unsplit.demo import data as demo_data


def test_vocabulary_matches_the_config():
    assert demo_data.VOCAB == demo_config.VOCAB == len(demo_data.ALPHABET)


def test_encode_decode_round_trip():
    text = "def f(x):\n    return x + 1  # ok\n"
    assert demo_data.decode(demo_data.encode(text)) == text
    assert demo_data.decode(demo_data.encode("\tä")) == "    ?"


def test_batches_are_a_function_of_seed_and_step():
    a = demo_data.Dataset(batch_size=8, length=16, seed=0)
    b = demo_data.Dataset(batch_size=8, length=16, seed=0)
    for key in ("inputs", "targets", "mask"):
        np.testing.assert_array_equal(a.batch(5)[key], b.batch(5)[key])
    assert not np.array_equal(a.batch(5)["inputs"], a.batch(6)["inputs"])
    other = demo_data.Dataset(batch_size=8, length=16, seed=1)
    assert not np.array_equal(a.batch(5)["inputs"], other.batch(5)["inputs"])


def test_examples_are_ragged_and_padded():
    data = demo_data.Dataset(batch_size=64, length=32, seed=0)
    b = data.batch(0)
    assert b["inputs"].dtype == np.int32 and b["mask"].dtype == np.float32
    lengths = b["mask"].sum(axis=1)
    assert lengths.min() >= 8 and lengths.max() <= 32
    assert len(set(lengths.tolist())) > 5  # many different token counts
    # A prefix mask, padding after it, targets are the inputs shifted by one.
    assert np.all(np.diff(b["mask"], axis=1) <= 0)
    assert np.all(b["inputs"][b["mask"] == 0] == demo_data.PAD)
    full = b["mask"][:, 1:] * b["mask"][:, :-1] > 0
    np.testing.assert_array_equal(b["targets"][:, :-1][full], b["inputs"][:, 1:][full])
    assert b["inputs"].max() < demo_data.VOCAB


def test_corpus_is_python_source():
    text = demo_data.corpus_text()
    assert "def " in text and "class " in text


def test_windows_are_ragged_records_of_the_text():
    source = demo_data.Windows(length=16)
    assert len(source) == (source.tokens.size - 1) // 16
    a, b = source[5], source[5]
    for key in ("inputs", "targets", "mask"):
        np.testing.assert_array_equal(a[key], b[key])
    n = int(a["mask"].sum())
    assert 4 <= n <= 16 and np.all(a["mask"][:n] == 1) and np.all(a["inputs"][n:] == 0)
    np.testing.assert_array_equal(a["inputs"][:n], source.tokens[80 : 80 + n])
    np.testing.assert_array_equal(a["targets"][: n - 1], a["inputs"][1:n])
    lengths = {int(source[r]["mask"].sum()) for r in range(50)}
    assert len(lengths) > 5
