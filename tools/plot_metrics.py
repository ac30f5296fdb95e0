#!/usr/bin/env python
"""``mtepo-plot-metrics`` from a checkout: see megatron_tepo/commands/plot_metrics.py (``python tools/plot_metrics.py --help``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_tepo.commands.plot_metrics import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
