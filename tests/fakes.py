"""Test stand-ins for the trainer's policy (:class:`~megatron_tepo.trainer.policy.Policy`): every
fake the trainer's tests hand to ``train()`` or to its phases derives from :class:`FakePolicy`, so
each implements the whole declared interface (``tests/trainer/test_policy.py`` checks them all).

:class:`FakePolicy` trains nothing: its losses are 0.5, its optimizer steps report a unit gradient
norm, it exports no weights, and its checkpoints are real ones in the store's layout (the
``complete`` marker last, the caller's files and JSON state) without tensors, so a run's resume is
tested for real.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from megatron_tepo.checkpoint.store import (COMPLETE_MARKER, EXTRA_STATE, FORMAT, list_complete_checkpoints,
                                             read_marker, write_file_atomic)


class FakePolicy:
    """A one-process policy that changes nothing (see the module docstring)."""

    dp_rank, dp_size = 0, 1
    offloaded: Tuple[str, ...] = ()
    routing_metrics: Dict[str, float] = {}  # (nothing replayed)

    def __init__(self):
        self._unpublished = []  # asynchronous saves not yet published

    # ---------------------------------------------------------------- a step's verbs
    def compute_log_probs(self, batch):
        zeros = torch.zeros(batch.response_mask.shape)
        return zeros, zeros.clone()

    def forward_backward(self, batch, loss) -> Dict[str, float]:
        return {"loss": 0.5}

    def optimizer_step(self) -> Dict[str, float]:
        return {"lr": 1e-4, "grad_norm": 1.0, "skipped_update": 0.0}

    def discard_gradients(self) -> None:
        pass

    def export_hf_state(self):
        return iter(())

    def offload(self, parts) -> int:
        self.offloaded = tuple(parts)
        return 0

    def onload(self) -> int:
        self.offloaded = ()
        return 0

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory, extra_state: Optional[dict] = None,
                        write_extra: Optional[Callable[[Path], None]] = None, asynchronous: bool = False,
                        on_publish: Optional[Callable[[Path], None]] = None):
        final = Path(directory)
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True)
        if write_extra is not None:
            write_extra(tmp)
        text = json.dumps(extra_state or {}, sort_keys=True)

        def publish():
            write_file_atomic(tmp / EXTRA_STATE, text)
            write_file_atomic(tmp / COMPLETE_MARKER, json.dumps({"format": FORMAT, "step": (extra_state or {}).get("step")}))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            if on_publish is not None:
                on_publish(final)

        if asynchronous:
            self._unpublished.append(publish)
        else:
            publish()
        return final

    def finalize_checkpoints(self, blocking: bool = False) -> int:
        while self._unpublished:
            self._unpublished.pop(0)()
        return 0

    def load_newest_checkpoint(self, root, report=None):
        done = list_complete_checkpoints(root)
        if not done:
            return None, None
        read_marker(done[-1])
        return done[-1], json.loads((done[-1] / EXTRA_STATE).read_text())

    def prefer_settings_over_checkpoint(self) -> None:
        pass

    def write_conversion_files(self, directory, source_model: str) -> None:
        pass

    def export_hf(self, directory, source_model: str):
        return None
