#!/usr/bin/env python
"""The nemo-run launcher from a checkout (and the two steps it runs on the nodes): see
megatron_tepo/launch/nemo_run.py and docs/LAUNCH.md (``python tools/launch_nemo_run.py --help``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_tepo.launch.nemo_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
