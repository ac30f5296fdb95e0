#!/usr/bin/env python
"""``mtepo-convert-hf-to-megatron`` from a checkout: see megatron_tepo/commands/convert_hf_to_megatron.py (``python tools/convert_hf_to_megatron.py --help``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_tepo.commands.convert_hf_to_megatron import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
