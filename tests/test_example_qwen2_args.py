"""examples/train_qwen2.py refuses bad arguments before any work: one line naming the argument, exit code 2
(a missing --text, an --out that cannot be created, --steps < 1, a vocabulary too small for its tokenizer)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_qwen2.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_qwen2_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bad_arguments_are_one_line_errors_with_exit_code_2(tmp_path, capsys):
    ex = _example()
    text = tmp_path / "t.txt"
    text.write_text("a paragraph of text that is longer than forty characters in all\n" * 20)
    (tmp_path / "afile").write_text("")
    cases = [(["--text", str(tmp_path / "none.txt")], "--text"),
             (["--text", str(text), "--out", str(tmp_path / "afile" / "sub")], "cannot create"),
             (["--text", str(text), "--steps", "0"], "--steps")]
    for extra, words in cases:
        with pytest.raises(SystemExit) as e:
            ex.main(["--out", str(tmp_path / "out"), *extra])
        assert e.value.code == 2
        assert words in capsys.readouterr().err
    ex.sys.argv = ["train_qwen2.py", "--out", str(tmp_path / "out"), "--text", str(text), "--vocab", "10"]
    assert ex._cli() == 2
    err = capsys.readouterr().err
    assert err.startswith("error: vocab_size=10") and "Traceback" not in err
