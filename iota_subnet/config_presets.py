"""Where a ``--config`` path points: the repository's preset configs (``configs/``) from any folder.

The commands' default, ``configs/tiny.yaml``, is relative to the repository root; run from another
folder it named nothing. :func:`config_path` keeps every path that exists (or is absolute, or is a
model name such as ``tiny``) as given, and maps only a missing relative ``configs/<file>`` onto the
preset of that name beside the package (:data:`PRESETS_DIR`, a source checkout or editable install).
Imports nothing heavy: the command lines use it as their ``--config`` argument type.
"""
from __future__ import annotations

from pathlib import Path

#: the preset configs of the source tree the package was imported from (``<repo>/configs``)
PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"


def config_path(value: str | Path) -> str:
    """``value`` unchanged when it is absolute, exists relative to the current folder, is not a
    ``.yaml``/``.yml`` path (a model name) or does not start with ``configs/``; else the preset
    ``PRESETS_DIR/<rest>`` when that file exists (else ``value`` unchanged, so the error names what was
    given). Never raises for a string; ``load_config`` reports a missing file."""
    p = Path(value)
    if p.is_absolute() or p.suffix not in (".yaml", ".yml") or p.exists() or len(p.parts) < 2 \
            or p.parts[0] != "configs":
        return str(value)
    preset = PRESETS_DIR.joinpath(*p.parts[1:])
    return str(preset) if preset.is_file() else str(value)
