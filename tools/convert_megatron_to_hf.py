#!/usr/bin/env python
"""``mtepo-convert-megatron-to-hf`` from a checkout: see megatron_tepo/commands/convert_megatron_to_hf.py (``python tools/convert_megatron_to_hf.py --help``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_tepo.commands.convert_megatron_to_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
