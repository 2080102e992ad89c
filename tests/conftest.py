"""Shared fixtures. Real text comes from ../shared (WikiText-2); it is read in place, never copied."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from iota_subnet.config import load_config  # noqa: E402  (after the offline settings above)


@pytest.fixture(scope="session")
def cfg8b():
    """``configs/8b.yaml`` as a RunConfig (the emulation tests' large shape; meta device, no memory)."""
    return load_config(REPO / "configs" / "8b.yaml")


@pytest.fixture(scope="session")
def wikitext_path() -> Path:
    if not WIKITEXT.exists():
        pytest.fail(f"WikiText-2 not found at {WIKITEXT}; the repo expects ../shared beside it")
    return WIKITEXT


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache folder (tokenizers, packed tokens) for the whole test session."""
    return tmp_path_factory.mktemp("iota-cache")


@pytest.fixture()
def tmp_home(tmp_path, monkeypatch) -> Path:
    """Point HOME at a temporary folder: the bittensor SDK writes under ~/.bittensor."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home
