"""Docstrings and comments under ``iota_subnet/`` state rules, shapes, units, errors and sources, not
history: none names an issue number (``issue 10``), an ISO date (``2026-12-02``) or a commit hash
(a 7-40 character hex word with both digits and letters). Dated incident narratives belong in git
history and ``docs/BENCHMARKS.md``.

Docstrings are every bare string statement (module, class, function and attribute docstrings, found
with :mod:`ast`); comments are the ``#`` tokens (:mod:`tokenize`). String literals that are code
(hashes in data, test vectors, ``0x...``) are not looked at."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "iota_subnet"

#: removed after the relay/sim/devnet moves
EXCLUDED = {
    "miner/adversary.py",
    "miner/emulated.py",
    "network/chaos.py",
}

ISSUE = re.compile(r"\bissue\s+\d+", re.IGNORECASE)
ISO_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")


def _hash_like(text: str) -> list[str]:
    """Hex words of 7-40 characters with at least one digit and one letter (``4fbca7f``; not
    ``1234567`` nor ``defaced``)."""
    return [w for w in HEX_WORD.findall(text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]


def _problems(text: str) -> list[str]:
    out = [f"issue number {m.group(0)!r}" for m in ISSUE.finditer(text)]
    out += [f"date {m.group(0)!r}" for m in ISO_DATE.finditer(text)]
    out += [f"commit-hash-like {w!r}" for w in _hash_like(text)]
    return out


def _docstrings(tree: ast.AST):
    """(first line, text) of every bare string statement."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            yield node.lineno, node.value.value


def _comments(source: str):
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def _findings(path: Path) -> list[str]:
    rel = path.relative_to(PACKAGE.parent)
    source = path.read_text(encoding="utf-8")
    found = []
    for line, text in _docstrings(ast.parse(source, filename=str(path))):
        for i, part in enumerate(text.splitlines()):
            found += [f"{rel}:{line + i}: docstring: {p}" for p in _problems(part)]
    for line, text in _comments(source):
        found += [f"{rel}:{line}: comment: {p}" for p in _problems(text)]
    return found


def test_checker_catches_issue_numbers_dates_and_hashes():
    assert _problems("(issue 10, item 4)") and _problems("churn run of 2026-12-03")
    assert _problems("the chaos run at 4fbca7f")
    assert not _problems("1234567 bytes, a defaced tensor, 0x1f2e3d4c5b, bf16, sha256, 2e-2")


def test_no_issue_numbers_dates_or_commit_hashes_in_docstrings_and_comments():
    files = sorted(p for p in PACKAGE.rglob("*.py")
                   if p.relative_to(PACKAGE).as_posix() not in EXCLUDED)
    assert files
    found = [f for p in files for f in _findings(p)]
    assert not found, "history in docstrings/comments (say the rule and its reason instead):\n" + "\n".join(found)
