"""The error types that mean "the user must fix something" (printed as one line, exit code 2)."""
from __future__ import annotations


def known_errors() -> tuple[type[BaseException], ...]:
    from iota_subnet.chain import ChainError
    from iota_subnet.config import ConfigError
    from iota_subnet.data import DataError
    from iota_subnet.hf import ExportError, ModelFolderError
    from iota_subnet.train.checkpoint import CheckpointError
    from iota_subnet.transport import PortInUseError
    from iota_subnet.utils.sqlite_file import CorruptStateError
    from iota_subnet.wallets import WalletError
    return (ConfigError, DataError, CheckpointError, ChainError, WalletError, ExportError, ModelFolderError,
            CorruptStateError, PortInUseError)
