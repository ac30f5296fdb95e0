"""megatron-core's ``dist_checkpointing`` for the rest of the package: the save and load of a sharded
state dict, a model's sharded tensors, and the process state a training checkpoint carries besides
the tensors. The checkpoint's file format (folders, the ``complete`` marker, the sidecars) is not
here: the actor's save (:mod:`megatron_tepo.actor.checkpointing`) and the converters
(:mod:`megatron_tepo.checkpoint`) call these functions with plain arguments.

* :func:`save` / :func:`load` -- ``dist_checkpointing.save`` / ``load`` of a sharded state dict
  (torch_dist); ``save``'s keyword arguments go to megatron (a strategy, the asynchronous save's
  arguments: :mod:`.async_save`), and it returns megatron's request of an asynchronous save.
* :func:`load_checkpoint_into` -- a dist checkpoint loaded into a model, whatever layout it was
  saved at.
* :func:`sharded_tensors` -- a model's ``sharded_state_dict`` with its factories applied, and its
  ``ShardedTensor`` leaves (what the streaming writer and reader of the converters walk).
* :func:`get_rng_state` / :func:`set_rng_state` -- this process's RNG states, megatron's
  model-parallel RNG tracker included.
* :func:`ensure_torch_adam_state` / :func:`saved_adam_steps` / :func:`fix_torch_adam_steps` -- what
  the distributed optimizer on torch Adam (no apex/TE) needs around a checkpoint's load.

Left out: the streaming torch_dist save strategy (:mod:`.dist_writer`), the asynchronous saves'
writer (:mod:`.async_save`), the checkpoint's folders and marker (:mod:`megatron_tepo.checkpoint.store`).
"""
from __future__ import annotations

import random
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["save", "load", "load_checkpoint_into", "sharded_tensors", "get_rng_state", "set_rng_state",
           "ensure_torch_adam_state", "saved_adam_steps", "fix_torch_adam_steps"]


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------
def save(sharded_state_dict, directory, **kwargs):
    """Collective: ``dist_checkpointing.save(sharded_state_dict, directory, **kwargs)``; returns its
    result (the request of an asynchronous save, else None)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.save(sharded_state_dict, str(directory), **kwargs)


def load(sharded_state_dict, directory) -> dict:
    """Collective: ``dist_checkpointing.load(sharded_state_dict, directory)``, resharded to the
    layout ``sharded_state_dict`` describes."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_state_dict, str(directory))


def load_checkpoint_into(model: torch.nn.Module, megatron_dir) -> None:
    """Load a (converted) dist checkpoint into this rank's stage, whatever layout it was saved at."""
    state = load(model.sharded_state_dict(), megatron_dir)
    model.load_state_dict(state)


def sharded_tensors(model: torch.nn.Module) -> Tuple[dict, list]:
    """``model.sharded_state_dict()`` with its factories applied (megatron's ``apply_factories``: a
    Gated DeltaNet's split tensors become their sections), and every ``ShardedTensor`` in it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    return sharded, [v for v in nested_values(sharded) if isinstance(v, ShardedTensor)]


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------
def get_rng_state() -> Dict[str, Any]:
    """Python, numpy, torch CPU, CUDA (when available) and megatron's model-parallel RNG tracker
    states of this process (the tracker holds CPU generator states under the CPU patches)."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


# ---------------------------------------------------------------------------------------------
# the distributed optimizer's state on torch Adam
# ---------------------------------------------------------------------------------------------
def _sub_optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def ensure_torch_adam_state(optimizer) -> None:
    """A fresh distributed optimizer without apex/TE (torch Adam) cannot build its sharded state
    dict: ``DistributedOptimizer.state_dict`` reads the per-param ``step`` of a state that only
    exists after a first step. Give every param placeholder Adam state (zeros, step 0); the load
    overwrites all of it. No-op for optimizers that already stepped, or are not torch Adam/AdamW."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p not in inner.state or "step" not in inner.state[p]:
                    st = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)}
                    if group.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p)
                    inner.state[p] = st


def saved_adam_steps(optimizer, loaded_optimizer, error: type = RuntimeError) -> List[Optional[float]]:
    """Per sub-optimizer: the Adam step saved with a distributed optimizer's param groups (torch
    Adam, no apex/TE), else None. Read BEFORE ``load_state_dict`` (which may consume the dict).
    Steps that disagree within one sub-optimizer raise ``error``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = _sub_optimizers(optimizer)
    out: List[Optional[float]] = []
    for idx, opt in enumerate(subs):
        inner = getattr(opt, "optimizer", None)
        step = None
        if isinstance(opt, DistributedOptimizer) and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            sd = loaded_optimizer if len(subs) == 1 else loaded_optimizer[idx]
            steps = {g.get("step") for g in sd["optimizer"]["param_groups"]} - {None}
            if len(steps) > 1:
                raise error(f"inconsistent optimizer steps in the checkpoint: {sorted(steps)}")
            step = float(steps.pop()) if steps else None
        out.append(step)
    return out


def fix_torch_adam_steps(optimizer, saved_steps: List[Optional[float]]) -> None:
    """Two megatron-core 0.16 faults of the distributed optimizer on torch Adam (no apex/TE), both
    about Adam's per-param ``step``:

    * the ``dp_reshardable`` param state carries ``step`` as a non-persistent object, so the load
      copies the TEMPLATE's step (the fresh optimizer's) over the restored one;
    * ``DistributedOptimizer.load_state_dict`` puts ONE step tensor into every param's state, and
      torch Adam increments it in place once per param per step (wrong bias correction).

    The true step is the one saved with the param groups (common state, :func:`saved_adam_steps`):
    give every param its own tensor of that value. Other optimizers restore ``step`` correctly;
    their step tensors are only un-shared, as a guard."""
    for opt, step in zip(_sub_optimizers(optimizer), saved_steps):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for st in inner.state.values():
            old = st.get("step")
            if isinstance(old, torch.Tensor):
                st["step"] = (torch.tensor(step, dtype=old.dtype, device=old.device)
                              if step is not None else old.clone())
