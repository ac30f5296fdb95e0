"""The policy the trainer trains: :class:`Policy`, the verbs the RL loop calls, and the backends by
name (:func:`build_policy`).

The trainer knows the policy only through this protocol (it imports nothing of ``actor/``;
``tests/test_layers.py`` holds it): the Megatron actor
(:class:`~megatron_tepo.actor.MegatronActor`) implements it, and so does every test fake. It is the
plug-in point for another training backend, LoRA (a policy whose ``export_hf_state`` streams the
merged weights) or a separate reference policy.

The verbs, in a step's order: score a batch (:meth:`Policy.compute_log_probs`, then
:attr:`Policy.routing_metrics`), train on it (:meth:`Policy.forward_backward`,
:meth:`Policy.optimizer_step`, or :meth:`Policy.discard_gradients` when the loss is not finite),
export the weights to the engines (:meth:`Policy.export_hf_state`), take turns with the engine for
the GPUs' memory (:meth:`Policy.offload`, :meth:`Policy.onload`, :attr:`Policy.offloaded`), and
save and load (:meth:`Policy.save_checkpoint`, :meth:`Policy.finalize_checkpoints`,
:meth:`Policy.load_newest_checkpoint`, :meth:`Policy.prefer_settings_over_checkpoint`), plus what a
checkpoint needs to be exported and the export at the end of a run
(:meth:`Policy.write_conversion_files`, :meth:`Policy.export_hf`). Its data-parallel coordinates
(:attr:`Policy.dp_rank`, :attr:`Policy.dp_size`) say which rows of a batch this process trains.

Left out: how a backend computes any of it (``megatron_tepo/actor/``), and the rollout engines'
side (:mod:`megatron_tepo.rollout.engine`).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from megatron_tepo.batch import RolloutBatch

__all__ = ["Policy", "build_policy", "POLICY_BACKENDS"]


@runtime_checkable
class Policy(Protocol):
    """What the RL loop calls on the model it trains (see the module docstring). Every method is
    collective over the policy's ranks: each rank calls it at the same point."""

    #: this process's data-parallel rank and the data-parallel size: rows ``i % dp_size == dp_rank``
    #: of every mini-batch are this rank's
    dp_rank: int
    dp_size: int

    @property
    def routing_metrics(self) -> Dict[str, float]:
        """The MoE routing gates of the last replayed pass (empty when nothing was replayed)."""

    @property
    def offloaded(self) -> Tuple[str, ...]:
        """The parts now in host memory (:meth:`offload`)."""

    def compute_log_probs(self, batch: RolloutBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy ``[B, R]`` of the batch's response slots (0 outside its mask)."""

    def forward_backward(self, batch: RolloutBatch, loss) -> Dict[str, float]:
        """The loss (a :class:`~megatron_tepo.algorithms.PolicyLoss`) and its gradients on a
        mini-batch; returns its metrics (``loss`` first among them)."""

    def optimizer_step(self) -> Dict[str, float]:
        """One optimizer step on the gradients of :meth:`forward_backward` (``lr``, ``grad_norm``;
        ``skipped_update`` 1.0 when a gradient is not finite: nothing changed)."""

    def discard_gradients(self) -> None:
        """Forget the gradients of :meth:`forward_backward` (its loss was not finite)."""

    def export_hf_state(self) -> Iterable[Tuple[str, torch.Tensor]]:
        """The weights as Hugging Face ``(name, full tensor)``: what the weight sync sends."""

    def offload(self, parts: Sequence[str]) -> int:
        """``parts`` (``optimizer``, ``grads``, ``params``) to host memory; returns the bytes moved."""

    def onload(self) -> int:
        """What :meth:`offload` moved, back; returns the bytes moved."""

    def save_checkpoint(self, directory, extra_state: Optional[dict] = None,
                        write_extra: Optional[Callable[[Path], None]] = None, asynchronous: bool = False,
                        on_publish: Optional[Callable[[Path], None]] = None):
        """The policy's whole training state and ``extra_state`` (JSON) into ``directory``,
        atomically; ``write_extra(tmp)`` adds files (driver), ``on_publish(path)`` runs once it is
        complete (driver); ``asynchronous``: published by a later :meth:`finalize_checkpoints`."""

    def finalize_checkpoints(self, blocking: bool = False) -> int:
        """Publish the asynchronous saves that are written (``blocking``: all); returns how many
        are still in flight."""

    def load_newest_checkpoint(self, root, report: Optional[Callable[[str], None]] = None
                               ) -> Tuple[Optional[Path], Optional[dict]]:
        """The newest complete checkpoint under ``root`` that loads (a damaged one reported and
        skipped), loaded: ``(its path, its extra_state)``; ``(None, None)`` when there is none."""

    def prefer_settings_over_checkpoint(self) -> None:
        """A later load keeps this policy's optimizer settings (``train.allow_config_change``)."""

    def write_conversion_files(self, directory: Path, source_model: str) -> None:
        """What makes a checkpoint in ``directory`` convertible back to the HF model it was
        loaded from (``source_model``: its folder); the driver calls it while writing one."""

    def export_hf(self, directory: Path, source_model: str) -> Optional[Path]:
        """The policy as a Hugging Face model folder in ``directory`` (the config, tokenizer and
        untrained weights of ``source_model`` carried); returns it (None on other ranks)."""


#: ``actor.backend`` -> the module whose ``build_policy(cfg, model_dir)`` builds it (imported when
#: asked for: the trainer imports no backend)
POLICY_BACKENDS: Dict[str, str] = {"megatron": "megatron_tepo.actor"}


def build_policy(backend: str, cfg, model_dir: str) -> Policy:
    """The policy of ``backend`` for the run config ``cfg``, loaded from the HF checkpoint
    ``model_dir`` (every rank)."""
    if backend not in POLICY_BACKENDS:
        raise ValueError(f"policy backend {backend!r}: expected one of {sorted(POLICY_BACKENDS)}")
    return importlib.import_module(POLICY_BACKENDS[backend]).build_policy(cfg, model_dir)
