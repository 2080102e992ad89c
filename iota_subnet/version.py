"""The package version, and the weights version key derived from it.

Validators send ``weights_version_key()`` with their weights; the chain refuses keys older than
the subnet's ``weights_version`` hyperparameter, which the subnet owner raises when a release
must be adopted. ``MAJOR.MINOR.PATCH`` -> ``MAJOR * 10000 + MINOR * 100 + PATCH`` (0.1.0 -> 100).
"""
from __future__ import annotations

__version__ = "0.1.0"


def weights_version_key(version: str = __version__) -> int:
    """The weights version key of ``version`` (``"1.2.3"`` -> 10203). Raises ``ValueError`` for a
    version that is not ``MAJOR.MINOR.PATCH`` (a pre-release suffix after the patch is ignored)."""
    parts = version.split(".")
    if len(parts) < 3:
        raise ValueError(f"version {version!r} is not MAJOR.MINOR.PATCH")
    import re
    m = re.match(r"\d+", parts[2])
    patch = m.group(0) if m else "0"
    major, minor = int(parts[0]), int(parts[1])
    if not (0 <= int(patch) < 100 and 0 <= minor < 100):
        raise ValueError(f"version {version!r}: minor and patch must be below 100")
    return major * 10000 + minor * 100 + int(patch)
