"""torchrun worker: what building the actor from an HF directory reads, draws and produces.

argv[1]: JSON list of cases ``{"family", "tie", "tp", "pp", "ep", "actor", "ckpt_dtype"}``. Every
rank writes the same random HF model as safetensors (two files: the loader must follow the
index), then builds ``MegatronActor(dir, hf_weights=dir)`` while spying on

* the readers: ``safetensors`` whole-file loads (``load_file`` / ``load`` / ``safe_open``),
  ``torch.load``, and the byte ranges ``LazyHFCheckpoint`` reads (per HF tensor);
* megatron's random init: ``_initialize_affine_weight_cpu`` / ``_gpu`` and ``torch.nn.init``'s
  normal / uniform draws.

Per case and rank it reports the bytes read (total and per HF name), the bytes of this rank's
parameters, the whole-file loads seen, the init calls seen, whether every parameter is bit for
bit the shard that the state-dict path (``load_hf_weights_into``: full tensors, split with
``shard_tensor``) gives, and whether the log-probs of the directory-built actor are bit for bit
those of an actor built from the in-memory state dict. ``attrs`` cases compare megatron's
tensor-parallel attributes of a chunk built without init to one built with it.
"""
import atexit
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.dist_utils import write_result
from tests.megatron.helpers import hf_log_probs, hf_state, make_batch, make_hf_model, tiny_hf_config

ACTOR = dict(precision="fp32", attention="sdpa", pack_sequences=True)
ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


class Spy:
    """Counts calls of module functions (and the byte ranges LazyHFCheckpoint reads)."""

    def __init__(self):
        self.calls = defaultdict(int)
        self.read = defaultdict(int)
        self._undo = []
        self.active = False

    def wrap(self, owner, name, key=None):
        orig = getattr(owner, name, None)
        if orig is None:
            return
        key = key or f"{getattr(owner, '__name__', owner)}.{name}"

        def spy(*a, **k):
            if self.active:
                self.calls[key] += 1
            return orig(*a, **k)

        setattr(owner, name, spy)
        self._undo.append((owner, name, orig))

    def wrap_reader(self, cls):
        orig = getattr(cls, "_pread", None)
        if orig is None:  # a reader without it reads nothing through LazyHFCheckpoint
            return
        spy = self

        def pread(self_, name, start, end, out):
            if spy.active:
                spy.read[name] += end - start
            return orig(self_, name, start, end, out)

        cls._pread = pread
        self._undo.append((cls, "_pread", orig))

    def undo(self):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()


def install_spies():
    import safetensors
    import safetensors.torch
    from megatron.core.tensor_parallel import layers

    from megatron_tepo.checkpoint import hf_io

    spy = Spy()
    spy.wrap(safetensors.torch, "load_file")
    spy.wrap(safetensors.torch, "load")
    spy.wrap(safetensors, "safe_open")
    spy.wrap(torch, "load")
    for mod in list(sys.modules.values()):  # every module that imported megatron's init functions
        if getattr(mod, "__name__", "").startswith("megatron.core"):
            for fn in ("_initialize_affine_weight_cpu", "_initialize_affine_weight_gpu"):
                if getattr(mod, fn, None) is getattr(layers, fn):
                    spy.wrap(mod, fn, key=fn)
    for fn in ("normal_", "uniform_", "xavier_normal_", "xavier_uniform_", "kaiming_uniform_",
               "kaiming_normal_", "trunc_normal_"):
        spy.wrap(torch.nn.init, fn, key=f"init.{fn}")
    spy.wrap_reader(hf_io.LazyHFCheckpoint)
    return spy


def write_model_dir(state, hf_cfg, dtype):
    """config.json + two safetensors files + index (what save_pretrained writes for big models)."""
    from safetensors.torch import save_file

    path = tempfile.mkdtemp(prefix="mtepo_sharded_")
    atexit.register(shutil.rmtree, path, True)  # every rank writes its own copy; none may outlive the test
    hf_cfg.to_json_file(os.path.join(path, "config.json"))
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n].to(dtype).contiguous() for n in part}, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def expected_shards(actor, state, family_cfg):
    """This rank's parameters as the state-dict path computes them: full Megatron tensors from
    ``hf_to_megatron``, split by ``shard_tensor`` with the parameter's attributes."""
    import torch.distributed as dist

    from megatron_tepo.models import hf_to_megatron
    from megatron_tepo.megatron.sharding import (EMBEDDING, TIED_OUTPUT, global_named_parameters, group_for,
                                               parallel_groups, shard_tensor, tp_partition)

    full = dict(hf_to_megatron(state, family_cfg))
    groups = parallel_groups(None)
    out = {}
    for gname, param in global_named_parameters(actor.model[0]):
        key = EMBEDDING if (family_cfg.tie_word_embeddings and gname == TIED_OUTPUT) else gname
        t = full[key]
        part, group = tp_partition(param), group_for(param, groups)
        if part is not None and dist.get_world_size(group) > 1:
            t = shard_tensor(t, part[0], part[1], dist.get_rank(group), dist.get_world_size(group))
        out[gname] = (t.to(param.dtype), param)
    return out


def run_case(case):
    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.sharding import global_named_parameters

    torch.manual_seed(0)
    hf_cfg = tiny_hf_config(case["family"], tie=case["tie"])
    model = make_hf_model(hf_cfg)
    state = hf_state(model)
    ckpt_dtype = getattr(torch, case.get("ckpt_dtype", "float32"))
    path = write_model_dir(state, hf_cfg, ckpt_dtype)
    state = {n: t.to(ckpt_dtype) for n, t in state.items()}  # what the files hold
    layout = ParallelLayout(tp=case["tp"], pp=case["pp"], ep=case.get("ep", 1))
    settings = dict(ACTOR, max_tokens_per_micro_batch=64, **case.get("actor", {}))

    spy = install_spies()
    spy.active = True
    try:
        actor = MegatronActor(path, hf_weights=path, layout=layout, optim=OptimConfig(lr=1e-3), **settings)
    finally:
        spy.active = False
        spy.undo()
    params = list(global_named_parameters(actor.model[0]))
    exp = expected_shards(actor, state, actor.family_cfg)
    mismatched = [n for n, (t, p) in exp.items() if not torch.equal(t, p.detach())]
    out = {"case": case, "read": dict(spy.read), "read_total": sum(spy.read.values()),
           "param_bytes": sum(p.numel() * ckpt_dtype.itemsize for _, p in params),
           "ckpt_bytes": sum(t.numel() * t.element_size() for t in state.values()),
           "calls": dict(spy.calls), "mismatched": mismatched, "n_params": len(params)}

    # the same weights from the in-memory state dict: bit for bit the same log-probs
    batch = make_batch(seed=1, train=False)
    lp_dir, ent_dir = actor.compute_log_probs(batch)
    del actor
    twin = MegatronActor(hf_cfg, hf_weights=state, layout=layout, optim=OptimConfig(lr=1e-3), **settings)
    lp_mem, ent_mem = twin.compute_log_probs(batch)
    out["logprob_bitwise_equal"] = bool(torch.equal(lp_dir, lp_mem) and torch.equal(ent_dir, ent_mem))
    with torch.no_grad():
        for p in model.parameters():  # the weights the files hold (buffers such as RoPE's stay fp32)
            p.copy_(p.to(ckpt_dtype))
        ref_lp, _ = hf_log_probs(model, batch)
    out["logprob_abs_err"] = float((lp_dir - ref_lp).abs().max())
    return out


def attrs_case(case):
    """Megatron's TP attributes of every parameter: a chunk built without init vs with it."""
    from megatron.core import parallel_state as ps

    from megatron_tepo.actor.actor import actor_transformer_config, plan_actor
    from megatron_tepo.layout import ParallelLayout
    from megatron_tepo.megatron.parallel import initialize_parallel
    from megatron_tepo.megatron.gpt import build_chunk

    hf_cfg = tiny_hf_config(case["family"], tie=case["tie"])
    layout = ParallelLayout(tp=case["tp"], pp=case["pp"], ep=case.get("ep", 1))
    settings, family_cfg = plan_actor(hf_cfg, layout, None, **ACTOR)
    initialize_parallel(layout, family_cfg, seed=1234)
    got = {}
    for init in (True, False):
        cfg = actor_transformer_config(family_cfg, layout, settings)
        cfg.perform_initialization = init
        chunk = build_chunk(cfg, family_cfg, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                            actor=settings)
        got[init] = {n: [getattr(p, a, None) for a in ATTRS] for n, p in chunk.named_parameters()}
    diff = {n: {"init": got[True][n], "no_init": got[False].get(n)} for n in got[True]
            if got[True][n] != got[False].get(n)}
    split = sorted(n for n, a in got[True].items() if a[0])
    return {"case": case, "attr_diff": diff, "n_params": len(got[True]), "tp_split": split}


def error_case(case):
    """A checkpoint with one tensor missing (``drop``) or one tensor of the wrong shape
    (``reshape``): the build must fail with a ValueError; its message is reported."""
    from megatron_tepo.actor.actor import MegatronActor, OptimConfig
    from megatron_tepo.layout import ParallelLayout

    hf_cfg = tiny_hf_config(case["family"], tie=case["tie"])
    state = hf_state(make_hf_model(hf_cfg))
    if case.get("drop"):
        del state[case["drop"]]
    if case.get("reshape"):
        name = case["reshape"]
        state[name] = state[name][:-2].clone()
    path = write_model_dir(state, hf_cfg, torch.float32)
    layout = ParallelLayout(tp=case["tp"], pp=case["pp"])
    try:
        MegatronActor(path, hf_weights=path, layout=layout, optim=OptimConfig(lr=1e-3), **ACTOR)
    except ValueError as e:
        return {"case": case, "error": str(e)}
    return {"case": case, "error": None}


def main():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cases = json.loads(sys.argv[1])
    results = [attrs_case(c) if c.get("attrs") else error_case(c) if c.get("error") else run_case(c)
               for c in cases]
    write_result({"cases": results})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
