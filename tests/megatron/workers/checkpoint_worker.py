"""torchrun worker: save / resume of the Megatron actor continues bit-exactly.

argv[1]: a scratch root (shared by the ranks); argv[2]: JSON list of cases
``{"tp", "pp", "dist_opt", "reshard_to_tp1", "partial_checks", "precision", "async", "writer"}`` (precision:
fp32 by default; bf16 also compares the optimizer's fp32 main parameters after step 3; async: the
save is asynchronous, A trains step 3 while it is written and publishes it after; writer: its writer,
``mcore`` by default or ``nvrx``). Per case: actor A (HF weights)
trains steps 1-2, saves ``step_2`` (extra_state), draws ``torch.rand``, trains step 3. Then A is
dropped, the RNGs are scrambled, a FRESH actor B (different init seed, no HF weights) loads the
newest complete checkpoint, draws ``torch.rand`` and trains step 3. Every rank reports whether
B's step 3 equals A's (params ``torch.equal``, loss, grad norm, lr) and the random draws match.
"""
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from megatron_tepo.algorithms import PolicyLoss
from tests.dist_utils import write_result
from tests.megatron.helpers import hf_state, make_batch, make_hf_model, tiny_hf_config

OPT = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1, clip_grad=0.5,
           lr_warmup_steps=1, lr_warmup_init=1e-4, lr_decay_style="cosine", min_lr=1e-5)
LOSS = PolicyLoss.of("grpo")


def _batches(n=3):
    out = []
    for i in range(n):
        b = make_batch(seed=100 + i)
        g = torch.Generator().manual_seed(200 + i)
        b.old_log_probs = (-2.0 - torch.rand(b.response_mask.shape, generator=g)) * b.response_mask
        out.append(b)
    return out


def _params(actor):
    return {n: p.detach().clone() for n, p in actor.model[0].module.named_parameters()}


def _main_params(actor):
    """The optimizer's own copies of the parameters (fp32 main params with bf16; the shards with the
    distributed optimizer), in order."""
    subs = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    return [p.detach().clone() for opt in subs for g in opt.optimizer.param_groups for p in g["params"]]


def _tracker_states():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}


def _scramble_rngs(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def run_case(case, root: Path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.checkpoint.store import CheckpointError, find_latest_checkpoint
    from megatron_tepo.layout import ParallelLayout

    hf_cfg = tiny_hf_config("qwen3", tie=False)
    weights = hf_state(make_hf_model(hf_cfg, seed=0))
    optim = OptimConfig(**OPT, use_distributed_optimizer=case.get("dist_opt", False))
    layout = ParallelLayout(tp=case.get("tp", 1), pp=case.get("pp", 1), cp=case.get("cp", 1))
    precision = case.get("precision", "fp32")
    batches = _batches()

    def local(actor, b):
        return b.split_for_data_parallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())

    out = {"case": case}
    # ---- uninterrupted run A
    a = MegatronActor(hf_cfg, hf_weights=weights, layout=layout, optim=optim, precision=precision,
                      max_tokens_per_micro_batch=64, total_steps=10)
    for b in batches[:2]:
        a.train_step(local(a, b), LOSS)
    asynchronous = case.get("async", False)
    if asynchronous:  # the writer of the asynchronous saves: "mcore" (megatron-core's) or "nvrx"
        os.environ["MTEPO_ASYNC_WRITER"] = case.get("writer", "mcore")
    path = a.save_checkpoint(root / "step_2", extra_state={"step": 2, "data_position": 16}, asynchronous=asynchronous)
    out["saved_path"] = str(path)
    out["published_at_return"] = (root / "step_2" / "complete").exists()
    out["writer"] = a._async_saves.writer.name if asynchronous else None
    full_at_save = {n: t.clone() for n, t in a.export_hf_state()} if case.get("reshard_to_tp1") else None
    tracker_a = _tracker_states()
    rand_a = torch.rand(6)
    py_a, np_a = random.random(), float(np.random.rand())
    m3a = a.train_step(local(a, batches[2]), LOSS)  # (with an asynchronous save: while it is written)
    if asynchronous:
        out["in_flight_after_step3"] = a.finalize_checkpoints() + 0  # (0 if written by now)
        a.finalize_checkpoints(blocking=True)
    out["listing"] = sorted(p.name for p in root.iterdir())
    params_a, main_a = _params(a), _main_params(a)
    out["dtypes"] = sorted({str(p.dtype) for p in params_a.values()})
    out["main_dtypes"] = sorted({str(p.dtype) for p in main_a})
    del a

    # ---- fresh actor B, resumed
    _scramble_rngs(999)
    b_actor = MegatronActor(hf_cfg, hf_weights=None, layout=layout, optim=optim, precision=precision,
                            max_tokens_per_micro_batch=64, total_steps=10, seed=4321)
    before = _params(b_actor)
    out["differs_before_load"] = any(not torch.equal(before[n], params_a[n]) for n in before)
    if case.get("partial_checks"):
        (root / "step_7").mkdir()  # no marker: a save that died before the marker
        (root / "step_7" / "metadata.json").write_text("{}")
        tmp = root / "step_9.tmp-1234-deadbeef"  # a temporary dir, even with a marker inside
        tmp.mkdir()
        (tmp / "complete").write_text("{}")
        refused = {}
        for d in (root / "step_7", tmp):
            try:
                b_actor.load_checkpoint(d)
                refused[d.name] = None
            except CheckpointError as e:
                refused[d.name] = str(e)
        out["refused"] = refused
    latest = find_latest_checkpoint(root)
    out["latest"] = str(latest)
    extra = b_actor.load_checkpoint(latest)
    out["extra_state"] = extra
    tracker_b = _tracker_states()
    out["tracker_equal"] = (sorted(tracker_a) == sorted(tracker_b)
                            and all(torch.equal(tracker_a[k], tracker_b[k]) for k in tracker_a))
    out["tracker_names"] = sorted(tracker_b)
    rand_b = torch.rand(6)
    out["rand_equal"] = bool(torch.equal(rand_a, rand_b))
    out["python_numpy_equal"] = (random.random() == py_a and float(np.random.rand()) == np_a)
    m3b = b_actor.train_step(local(b_actor, batches[2]), LOSS)
    params_b = _params(b_actor)
    out["param_names"] = len(params_a)
    out["params_equal"] = sorted(params_a) == sorted(params_b) and all(
        torch.equal(params_a[n], params_b[n]) for n in params_a)
    out["max_param_diff"] = max(float((params_a[n] - params_b[n]).abs().max()) for n in params_a)
    main_b = _main_params(b_actor)
    out["main_params_equal"] = len(main_a) == len(main_b) and all(torch.equal(x, y) for x, y in zip(main_a, main_b))
    out["step3_a"] = {k: m3a[k] for k in ("loss", "grad_norm", "lr")}
    out["step3_b"] = {k: m3b[k] for k in ("loss", "grad_norm", "lr")}
    out["dp"] = ps.get_data_parallel_world_size()
    del b_actor

    # ---- the model part at TP=1 (all ranks DP)
    if case.get("reshard_to_tp1"):
        c = MegatronActor(hf_cfg, hf_weights=None, layout=ParallelLayout(tp=1, pp=1), optim=OptimConfig(**OPT),
                          precision=precision, max_tokens_per_micro_batch=64, seed=777)
        try:
            c.load_checkpoint(root / "step_2")
            out["full_load_other_layout"] = None
        except CheckpointError as e:
            out["full_load_other_layout"] = str(e)
        extra_c = c.load_checkpoint(root / "step_2", model_only=True)
        full_c = dict(c.export_hf_state())
        out["reshard_extra_state"] = extra_c
        out["reshard_equal"] = sorted(full_c) == sorted(full_at_save) and all(
            torch.equal(full_c[n], full_at_save[n]) for n in full_c)
        out["reshard_tp"] = ps.get_tensor_model_parallel_world_size()
        del c
    dist.barrier()
    return out


def main():
    root = Path(sys.argv[1])
    cases = json.loads(sys.argv[2])
    results = []
    for k, case in enumerate(cases):
        case_root = root / f"case{k}"
        case_root.mkdir(parents=True, exist_ok=True)
        results.append(run_case(case, case_root))
    write_result({"cases": results})


if __name__ == "__main__":  # (dist_checkpointing.save starts a spawn-context manager)
    main()
