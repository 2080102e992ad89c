"""Kinds of model a run config may name besides the shapes of :data:`iota_subnet.config.MODEL_CONFIGS`.

:mod:`iota_subnet.config` reads a ``model`` section that is a mapping holding a registered key with that
kind's :class:`ModelKind` (``hf``: a ``transformers`` model and a ``datasets`` dataset,
:mod:`iota_subnet.config_hf`, registered when the package is imported). Kept apart from the config module
so that a kind may build on the config's types while the config module knows none of them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Optional


class ModelKind(ABC):
    """A kind of model a run config may name instead of a shape of :data:`~iota_subnet.config.MODEL_CONFIGS`:
    its ``model`` (and ``data``) section is a mapping holding :attr:`key`. Registered in :data:`MODEL_KINDS` by the
    module implementing it (``hf``: a transformers model and a datasets dataset, :mod:`iota_subnet.config_hf`,
    imported with the package). ``base``: the config file's folder (relative paths)."""

    key = ""

    @abstractmethod
    def model(self, raw: dict, base: Optional[Path]) -> Any:
        """The ``model`` section as a :class:`~iota_subnet.config.ModelConfig` subclass. Raises ConfigError."""
        raise NotImplementedError

    @abstractmethod
    def data(self, raw: dict, base: Optional[Path]) -> tuple[dict, type]:
        """(the ``data`` section resolved, the DataConfig subclass to read it). Raises ConfigError."""
        raise NotImplementedError

    def resolve(self, cfg: Any) -> Any:
        """What loading derives (e.g. the layer split). Raises ConfigError."""
        return cfg

    def check(self, cfg: Any, *, files: bool) -> None:
        """Refuse what cannot run (``files``: also read the files the config names). Raises ConfigError."""

    @abstractmethod
    def to_dict(self, cfg: Any) -> dict:
        """:meth:`~iota_subnet.config.RunConfig.to_dict`, as a config file gives it (what
        :func:`~iota_subnet.config.config_from_dict` reads back)."""
        raise NotImplementedError


MODEL_KINDS: dict[str, ModelKind] = {}


def kind_of(cfg) -> Optional[ModelKind]:
    """The registered kind of a RunConfig's model or data (None: a shape of MODEL_CONFIGS, text from --data)."""
    return next((k for key, k in MODEL_KINDS.items()
                 if getattr(cfg.model, key, None) is not None or getattr(cfg.data, key, None) is not None), None)
