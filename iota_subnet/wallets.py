"""Wallet helpers around ``bittensor.Wallet`` (coldkey + hotkey files under ``path``)."""
from __future__ import annotations

from pathlib import Path

import bittensor as bt
from iota_subnet.errors import UserError


class WalletError(UserError, RuntimeError):
    """A wallet cannot be loaded; the message says how to create one."""


def load_wallet(name: str, hotkey: str, path: str | Path) -> bt.Wallet:
    """Load an existing wallet. Raises WalletError when its hotkey file is missing."""
    w = bt.Wallet(name=name, hotkey=hotkey, path=str(Path(path).expanduser()))
    hk = Path(path).expanduser() / name / "hotkeys" / hotkey
    if not hk.exists():
        raise WalletError(f"no hotkey file {hk}; create it with `btcli wallet new_hotkey --wallet {name} "
                          f"--wallet-hotkey {hotkey}` or pass --wallet-path")
    try:
        _ = w.hotkey
    except Exception as e:  # noqa: BLE001 - bittensor raises several types for unreadable keys
        raise WalletError(f"cannot read hotkey {hk}: {e}") from e
    return w


def create_wallet(name: str, hotkey: str, path: str | Path) -> bt.Wallet:
    """Create (or reuse) an unencrypted throwaway wallet: for local networks and tests only."""
    path = Path(path).expanduser()
    w = bt.Wallet(name=name, hotkey=hotkey, path=str(path))
    if not (path / name / "coldkey").exists():
        w.create_new_coldkey(use_password=False, overwrite=True, suppress=True)
    if not (path / name / "hotkeys" / hotkey).exists():
        w.create_new_hotkey(use_password=False, overwrite=True, suppress=True)
    return w
