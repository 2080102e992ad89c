"""Miner entry point: ``python neurons/miner.py --help``. The logic lives in iota_subnet.entry.miner and iota_subnet.miner."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from iota_subnet.entry.miner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
