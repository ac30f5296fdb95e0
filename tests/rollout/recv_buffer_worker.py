"""Run with the SGLang venv's python (``SGLANG_USE_CPU_ENGINE=1``): the receive-buffer patch of
``megatron_tepo/rollout/sglang_cpu/mtepo_sglang_cpu.py`` on a real gloo group of two processes.

Rank 0 broadcasts flattened buckets as the weight sync does; rank 1 receives them with SGLang's
own (patched) ``WeightUpdater._receive_bucketed_weights_from_distributed`` and loads them with its
``load_weights_from_distributed`` into a small model, twice with a well-behaved loader (copies),
then with one that keeps the received tensor as its parameter. Prints one JSON line (rank 1).

argv[3] == "direct": patch 3 instead (received straight into the parameters): a model with a fused
``qkv`` parameter loaded by narrow + copy, a plain one, and a loader that scales (never eligible);
the same layout pushed again goes into the parameters, another runner (a draft) still loads from
the received views, a layout in another order stays on the normal path, a replaced parameter
sends its layout back to be traced again, a new bucket size moves the parameters again, and a
parameter another tensor views is never moved -- every load bit for bit."""
import json
import sys

import torch
import torch.distributed as dist


def buckets():
    g = torch.Generator().manual_seed(0)
    a = [("w", torch.randn(64, 32, generator=g).bfloat16()), ("b", torch.randn(32, generator=g))]
    b = [("w", torch.randn(64, 32, generator=g).bfloat16()), ("b", torch.randn(32, generator=g))]
    c = [("w", torch.randn(64, 32, generator=g).bfloat16())]
    return [a, b, c, a]


def flat(bucket):
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(32), requires_grad=False)
        self.keep = False

    def load_weights(self, named):
        for name, t in named:
            if self.keep and name == "w":  # a loader that keeps the received tensor itself
                self.w = torch.nn.Parameter(t, requires_grad=False)
            else:
                getattr(self, name).data.copy_(t)


class Runner:  # the fields of SGLang's WeightUpdater the two patched methods use
    device = "cpu"

    def __init__(self, group, model):
        self._model_update_group = {"g": group}
        self.model = model

    def get_model(self):
        return self.model

    def _assert_weight_cache_inactive(self, op):
        pass


class Fused(torch.nn.Module):
    """q/k/v go into one ``qkv`` parameter (SGLang's QKVParallelLinear does narrow + copy_)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(24, 8, dtype=torch.bfloat16), requires_grad=False)
        self.n = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        self.s = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16), requires_grad=False)
        self.c = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16), requires_grad=False)
        self.c_t = self.c.data.t()  # a derived view kept by the module: c must never move

    def load_weights(self, named):
        for name, t in named:
            if name in "qkv":
                self.qkv.data.narrow(0, "qkv".index(name) * 8, 8).copy_(t)
            elif name == "c":
                self.c.data.copy_(t)
            elif name == "s":
                self.s.data.copy_(t * 2)  # not a plain copy: its layout is never received directly
            else:
                self.n.data.copy_(t)

    def expected(self, name):
        return self.qkv[8 * "qkv".index(name):][:8] if name in "qkv" else getattr(self, name)


def direct_buckets():
    g = torch.Generator().manual_seed(1)

    def layout(names):
        return [(n, torch.randn(*{"n": (8,), "s": (4, 8)}.get(n, (8, 8)), generator=g)
                 .to(torch.float32 if n == "n" else torch.bfloat16)) for n in names]

    # L1 x3 (traced + moved, then direct twice), L2 x2 (scaled: never), L3 (q/k/v order swapped:
    # qkv is not one run of it), L1 after a parameter was replaced x2 (traced again, then direct),
    # L4 x2 (a new bucket size: qkv moves again, L1's plan goes; then direct), L5 x2 (its parameter
    # has a view kept elsewhere: never moved), L6 x2 (n, left behind in L1's tensor: moves too)
    return [layout("qkvn"), layout("qkvn"), layout("qkvn"), layout("s"), layout("s"),
            layout("kqv"), layout("qkvn"), layout("qkvn"), layout("qkv"), layout("qkv"), layout("c"),
            layout("c"), layout("n"), layout("n")]


def direct_main(group):
    from mtepo_sglang_cpu import _plans, _recv_buffers
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    model, draft = Fused(), Fused()
    runner, draft_runner = Runner(group, model), Runner(group, draft)
    out = {"patched": bool(getattr(WeightUpdater, "_mtepo_direct_receive", False)), "steps": []}
    for i, bucket in enumerate(direct_buckets()):
        if i == 6:  # a parameter replaced (as a reload would): L1's plan no longer holds
            model.n = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        got = WeightUpdater._receive_bucketed_weights_from_distributed(
            runner, names=[n for n, _ in bucket], dtypes=[str(t.dtype).split(".")[1] for _, t in bucket],
            shapes=[list(t.shape) for _, t in bucket], group_name="g")
        qkv = model.qkv.data_ptr(), model.qkv.data_ptr() + model.qkv.nbytes
        ok, _ = WeightUpdater.load_weights_from_distributed(runner, got)
        ok_draft, _ = WeightUpdater.load_weights_from_distributed(draft_runner, got)
        scale = 2 if bucket[0][0] == "s" else 1
        out["steps"].append({
            "names": "".join(n for n, _ in bucket), "direct": bool(getattr(got, "direct", False)),
            "in_params": all(qkv[0] <= t.data_ptr() < qkv[1] for n, t in got if n in "qkv")
            and model.qkv.data_ptr() == qkv[0],
            "loaded": ok and all(torch.equal(model.expected(n), t * scale) for n, t in bucket),
            "view_current": torch.equal(model.c_t, model.c.t()) and model.c_t.data_ptr() == model.c.data_ptr(),
            "draft_loaded": ok_draft and all(torch.equal(draft.expected(n), t * scale) for n, t in bucket),
            "plans": sum(p is not None for p in _plans.get(model, {}).values()),
            "buffer_held": _recv_buffers.get("cpu") is not None})
    print(json.dumps(out))


def run():
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", world_size=2, rank=rank)
    group = dist.new_group([0, 1], backend="gloo")
    scenario = sys.argv[3] if len(sys.argv) > 3 else "buffer"
    if rank == 0:
        for bucket in (direct_buckets() if scenario == "direct" else buckets()):
            dist.broadcast(flat(bucket), src=0, group=group)
        dist.barrier()
        return
    if scenario == "direct":
        direct_main(group)
        dist.barrier()
        return
    from mtepo_sglang_cpu import _recv_buffers
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    out = {"patched": bool(getattr(WeightUpdater, "_mtepo_recv_buffer", False)), "steps": []}
    model = Model()
    runner = Runner(group, model)
    kept = None
    for i, bucket in enumerate(buckets()):
        model.keep = i == 2
        got = WeightUpdater._receive_bucketed_weights_from_distributed(
            runner, names=[n for n, _ in bucket], dtypes=[str(t.dtype).split(".")[1] for _, t in bucket],
            shapes=[list(t.shape) for _, t in bucket], group_name="g")
        buf = _recv_buffers.get("cpu")
        if kept is not None:  # the tensor the loader kept was not overwritten by this receive
            out["kept_intact"] = torch.equal(kept[0], kept[1])
        step = {"exact": all(torch.equal(g, t) for (_, g), (_, t) in zip(got, bucket)),
                "names": [n for n, _ in got], "buffer_ptr": buf.data_ptr() if buf is not None else None}
        ok, msg = WeightUpdater.load_weights_from_distributed(runner, got)
        step["loaded"] = ok and all(torch.equal(getattr(model, n), t) for n, t in bucket)
        step["buffer_after_load"] = _recv_buffers.get("cpu") is not None
        if i == 2:
            kept = (model.w, bucket[0][1].clone())
        out["steps"].append(step)
    dist.barrier()
    print(json.dumps(out))


def main():
    try:
        run()
    finally:
        # An explicit teardown: a process that exits with its gloo group still up can abort in
        # the group's destructor ("terminate called without an active exception"), which a busy
        # machine made happen now and then.
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
