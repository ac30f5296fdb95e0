"""Run with the SGLang venv's python (``SGLANG_USE_CPU_ENGINE=1``): the receive-buffer patch of
``megatron_tepo/rollout/sglang_cpu/mtepo_sglang_cpu.py`` on a real gloo group of two processes.

Rank 0 broadcasts flattened buckets as the weight sync does; rank 1 receives them with SGLang's
own (patched) ``WeightUpdater._receive_bucketed_weights_from_distributed`` and loads them with its
``load_weights_from_distributed`` into a small model, twice with a well-behaved loader (copies),
then with one that keeps the received tensor as its parameter. Prints one JSON line (rank 1)."""
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


def main():
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", world_size=2, rank=rank)
    group = dist.new_group([0, 1], backend="gloo")
    if rank == 0:
        for bucket in buckets():
            dist.broadcast(flat(bucket), src=0, group=group)
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


if __name__ == "__main__":
    main()
