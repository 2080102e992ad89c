"""Validator entry point: ``python neurons/validator.py --help``. The logic lives in iota_subnet.entry.validator and iota_subnet.validator."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iota_subnet.entry.validator import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
