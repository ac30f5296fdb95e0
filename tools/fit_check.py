#!/usr/bin/env python
"""``mtepo-fit-check`` from a checkout: see megatron_tepo/commands/fit_check.py (``python tools/fit_check.py --help``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_tepo.commands.fit_check import main  # noqa: E402

from megatron_tepo.commands.fit_check import cli  # noqa: E402,F401 (tests import it from here)

if __name__ == "__main__":
    sys.exit(main())
