"""Progress of long operations: a tqdm bar with the time left on a terminal, plain lines with an ETA
in a log; the real hooks (tokenizing a large source, writing a large checkpoint) report through it."""
from __future__ import annotations

import io
import re
import time

import numpy as np

from iota_subnet.utils import atomic
from iota_subnet.utils.progress import Progress, format_seconds


def test_plain_lines_carry_rate_and_eta():
    lines: list[str] = []
    p = Progress(1000, "syncing", "chunk", tty=False, log=lines.append, log_every_s=0.0)
    time.sleep(0.05)
    p.update(250)
    assert re.fullmatch(r"syncing: 250/1,000 chunk \(25\.0%\), [\d,.]+ chunk/s, ETA \d+ s", lines[-1]), lines
    assert p.eta_s is not None and p.eta_s > 0
    p.update(750)
    p.close()
    assert lines[-1].startswith("syncing: done, 1,000 chunk in ")
    n = len(lines)
    p.close()                                       # idempotent
    assert len(lines) == n


def test_unknown_total_has_a_rate_but_no_eta_and_small_work_is_quiet():
    lines: list[str] = []
    p = Progress(None, "reading", "char", tty=False, log=lines.append, log_every_s=0.0)
    time.sleep(0.01)
    p.update(10)
    assert "ETA" not in lines[-1] and lines[-1].startswith("reading: 10 char, ")
    quiet: list[str] = []
    with Progress(100, "small", "B", tty=False, log=quiet.append, log_every_s=0.0, min_total=1000) as q:
        q.update(100)
    assert quiet == []


def test_a_terminal_gets_a_tqdm_bar_with_the_time_left():
    out = io.StringIO()
    with Progress(10, "merge", "shard", tty=True, stream=out) as p:
        for _ in range(4):
            time.sleep(0.01)
            p.update(1)
    text = out.getvalue()
    assert "merge" in text and "4/10" in text and re.search(r"\d\d:\d\d<\d\d:\d\d", text), text


def test_format_seconds():
    assert format_seconds(7) == "7 s" and format_seconds(73) == "1 min 13 s" and format_seconds(3720) == "1 h 02 min"
    assert format_seconds(None) == "?"


def test_large_checkpoint_writes_report_progress(tmp_path, monkeypatch):
    seen: list[str] = []
    from loguru import logger
    sink = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    monkeypatch.setattr(atomic, "PROGRESS_BYTES", 1 << 20)
    try:
        data = np.random.default_rng(0).bytes(3 << 20)
        atomic.atomic_write_bytes(tmp_path / "stage1.safetensors", data)
    finally:
        logger.remove(sink)
    assert (tmp_path / "stage1.safetensors").read_bytes() == data
    assert any(m.startswith("writing stage1.safetensors: done") for m in seen), seen


def test_tokenizing_a_large_source_reports_progress(tmp_path):
    from iota_subnet.data import TextTokenizer, train_bpe
    from iota_subnet.data.packing import tokenize_documents
    tok = TextTokenizer(train_bpe(["hello world, the quick brown fox"] * 50, 300), "t")
    seen: list[str] = []
    from loguru import logger
    sink = logger.add(lambda m: seen.append(m.record["message"]), level="INFO")
    try:
        docs = ["the quick brown fox jumps over the lazy dog " * 20] * 5000    # 4.4 M characters
        out = tokenize_documents(docs, tok, total_chars=sum(map(len, docs)))
    finally:
        logger.remove(sink)
    assert len(out) > 0
    assert any(m.startswith("tokenizing: done") for m in seen), seen
