#!/usr/bin/env python
"""``mtepo-train`` from a checkout: see megatron_tepo/commands/train.py (``python tools/train.py --help``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_tepo.commands.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
