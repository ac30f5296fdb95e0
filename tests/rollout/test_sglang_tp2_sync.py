"""A REAL SGLang CPU server at TP=2 (two TP worker processes, each pinned to one core with
``SGLANG_CPU_OMP_THREADS_BIND="0|1"``) receives a TP=2 actor's weights (torchrun, 2 gloo
processes) in ``distributed`` mode, and then generates what those weights generate.

What it proves (issue #22 row 1): the sync asks the attached server its TP size
(``/server_info``), the update group has one rank per TP worker (world size 1 + 2, offset 1:
SGLang's workers take ranks 1 and 2), both workers receive every bucket (a worker left out of the
group, or given the other's rank, hangs the group's creation or the first broadcast), and each
loads its own shard of the new weights (the server's greedy tokens and log-probs become those of
the actor's weights, and were not before: the actor's weights are another seed's than the
server's initial ones).

The reference is Hugging Face's float32 forward of the actor's weights. The server runs in
float32 too (``dtype="float32"``), so the weights arrive and are used unrounded; its kernels
still differ from HF's (SGLang's torch-native attention, a TP=2 all-reduce that sums in another
order), by ~1e-6 in the logits. Greedy tokens are compared exactly, position by position, up to
the first step where the reference's two best logits are closer than ``TIE`` (1e-3, three orders
above those differences): there a different but equally right argmax is possible, and what
follows would diverge legitimately. The test demands that nearly every token be compared. Log-probs
of a fixed sequence must agree within 1e-3.

The server takes ~50 s to become healthy on an idle 2-core machine (more under load): generous
time-outs, no timing asserts.
"""
import json

import pytest
import torch

from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
from megatron_tepo.rollout.sglang.server import ServerConfig
from tests.rollout.helpers import hf_response_log_probs, save_tiny_qwen3, tiny_qwen3

pytestmark = pytest.mark.sglang
SCALE = 0.2  # large weights: clear argmax margins in greedy decoding
SEQ = [5, 17, 33, 40, 41, 42, 43, 44, 45, 46, 47, 48]
PROMPT_LEN = 3
PROMPTS = [[5, 17, 33], [9], [100, 101, 102, 103], [7, 7, 200]]
MAX_NEW = 12
TIE = 1e-3


def hf_greedy(model, prompt, n):
    """Greedy continuation and, per step, the gap between the two best logits."""
    ids, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            top = torch.topk(logits, 2)
            gaps.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], gaps


def compared_prefix(got, ref, gaps):
    """How many leading tokens must match: up to (not past) the first near-tie of the reference."""
    n = 0
    for g, r, gap in zip(got, ref, gaps):
        n += 1
        if gap < TIE:
            break
    return n


@pytest.fixture(scope="module")
def tp2_server(sglang_python, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_qwen3_tp2")
    save_tiny_qwen3(str(model_dir), seed=0, scale=SCALE)
    cfg = FleetConfig(num_servers=1, request_timeout=300, step_timeout=600, router="none",
                      server=ServerConfig(model_path=str(model_dir), tp=2, dtype="float32", python=sglang_python,
                                          env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}, threads_per_server=1,
                                          log_dir=str(tmp_path_factory.mktemp("sglang_tp2_logs")),
                                          startup_timeout=600))
    fleet = SGLangFleet(cfg)
    yield fleet
    fleet.close()


def test_tp2_actor_to_tp2_server_distributed(tp2_server, tmp_path):
    from safetensors.torch import save_file

    from tests.dist_utils import REPO, torchrun

    server = tp2_server.servers[0]
    info = server.server_info()
    assert info["tp_size"] == 2  # really a TP=2 server
    actor_model = tiny_qwen3(seed=31, scale=SCALE)
    actor_model.config.to_json_file(str(tmp_path / "config.json"))
    save_file({k: v.contiguous() for k, v in actor_model.state_dict().items()}, str(tmp_path / "actor.safetensors"))
    args = {"url": server.url, "key": server.api_key, "weights": str(tmp_path / "actor.safetensors"),
            "config_dir": str(tmp_path), "prompts": PROMPTS, "max_new_tokens": MAX_NEW, "seq": SEQ,
            "prompt_len": PROMPT_LEN, "bucket_bytes": 100_000}
    res = torchrun(REPO / "tests/rollout/tp2_sync_worker.py", 2, json.dumps(args), tmp_path=tmp_path,
                   timeout=900)[0]
    # the group: asked the server (attached by URL), one rank per TP worker
    assert res["tp_size"] == 2
    assert res["group"] == [{"rank_offset": 1, "world_size": 3}]
    assert res["tensors"] == len(actor_model.state_dict()) and res["buckets"] > 1

    ref_lp = hf_response_log_probs(actor_model, SEQ, PROMPT_LEN)
    after_lp, before_lp = torch.tensor(res["after"]["log_probs"]), torch.tensor(res["before"]["log_probs"])
    assert float((after_lp - ref_lp).abs().max()) < 1e-3, (after_lp, ref_lp)
    assert float((before_lp - ref_lp).abs().max()) > 0.1  # the server held other weights before

    compared = total = 0
    differed_before = 0
    for prompt, got, got_before in zip(PROMPTS, res["after"]["greedy"], res["before"]["greedy"]):
        ref, gaps = hf_greedy(actor_model, prompt, MAX_NEW)
        n = compared_prefix(got, ref, gaps)
        assert got[:n] == ref[:n], (prompt, got, ref, gaps)
        compared, total = compared + n, total + MAX_NEW
        differed_before += got_before != ref
    assert compared >= 0.75 * total, (compared, total)  # not a test of near-ties only
    assert differed_before >= 1  # the old weights generated something else
