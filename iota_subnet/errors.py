"""The error that means "the user must fix something" (printed as one line, exit code 2).

Every package's own such error (``ConfigError``, ``DataError``, ``ChainError``, ``WalletError``,
``CheckpointError``, ``ExportError``, ``ModelFolderError``, ``CorruptStateError``,
``PortInUseError``) subclasses :class:`UserError`, so this module sits below all of them and
imports none: the entry points catch ``known_errors()``."""
from __future__ import annotations


class UserError(Exception):
    """Something the user must fix (a config value, a file, a wallet, a port, the chain endpoint);
    the message names it and the fix. Entry points print it as one line and exit with code 2."""


class ConfigError(UserError, ValueError):
    """A configuration value is wrong; the message names the value and the fix (raised by the config
    modules: :mod:`iota_subnet.config`, :mod:`iota_subnet.config_merge`, :mod:`iota_subnet.config_hf`)."""


def known_errors() -> tuple[type[BaseException], ...]:
    """The exception types an entry point reports as one line with exit code 2."""
    return (UserError,)
