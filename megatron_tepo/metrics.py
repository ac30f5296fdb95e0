"""Run metrics: one JSONL line per step (the source of truth), plus TensorBoard and Weights &
Biases when configured. The plot tool (``tools/plot_metrics.py``) reads the JSONL.

Each line is ``{"step": int, "time": float, <metric>: float, ...}``; non-finite values are written
as ``null`` (JSON has no NaN) so a bad step is visible without breaking readers. Lines are flushed
and fsync'ed per step: a killed run loses at most the line being written, and :func:`read_metrics`
ignores a torn last line. On resume, :meth:`MetricsLogger.truncate_after` drops the lines of steps
after the checkpoint, so the log continues exactly.

Left out: aggregation across ranks (the trainer logs from one rank) and console formatting.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

__all__ = ["MetricsLogger", "read_metrics"]


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Append step metrics to ``path`` (JSONL); mirror to TensorBoard / W&B when asked."""

    def __init__(self, path: Union[str, Path], tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, run_name: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError(f"tensorboard_dir={tensorboard_dir!r} needs the tensorboard package "
                                   f"(pip install tensorboard): {exc}") from None
            self._tb = SummaryWriter(tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError(f"wandb_project={wandb_project!r} needs the wandb package: {exc}") from None
            self._wandb = wandb.init(project=wandb_project, name=run_name, config=dict(config or {}))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record: Dict[str, Any] = {"step": int(step), "time": time.time()}
        record.update({k: _clean(v) for k, v in metrics.items()})
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def truncate_after(self, step: int) -> int:
        """Drop every line with ``step > step`` (resume from a checkpoint); returns lines kept."""
        self._fh.close()
        kept = [r for r in read_metrics(self.path) if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        tmp.replace(self.path)
        self._fh = self.path.open("a", encoding="utf-8")
        return len(kept)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Union[str, Path]) -> List[Dict[str, Any]]:
    """Every complete line of a metrics log; a torn last line (a killed writer) is ignored, a
    malformed line elsewhere is an error naming the line."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                break
            raise ValueError(f"{path}:{i}: not a JSON line") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise ValueError(f"{path}:{i}: a metrics line needs an object with 'step'")
        records.append(rec)
    return records
