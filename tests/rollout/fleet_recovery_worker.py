"""A real training run (``train()``: the Megatron actor, one process) on a launched fleet of two
real SGLang CPU servers, with two faults injected from outside the fleet's code:

* step 2: server 0 is SIGKILLed as its first generation request of the step goes out;
* step 3: server 1 is SIGSTOPped the same way (frozen: its port still accepts connections).

With ``"colocated": true`` the run is colocated (``rollout.colocated``, the ``ipc`` sync) and the
second fault is the colocated one: server 1 is SIGKILLed in step 3 as soon as it has released its
memory (the actor's turn), so its restart meets a fleet whose memory is released. Every server
logs its requests (``TEPO_SGLANG_LOG_REQUESTS``), and the actor's reference is taken right after
each sync (before the actor offloads its weights).

After each step's weight sync (``on_step``) every serving server is asked for greedy
completions, and the actor's weights (its HF export) compute the same greedily in float32: the
two must agree. Every request each server gets is recorded with its incarnation. Writes what
happened as JSON (tests/dist_utils.write_result) for test_fleet_recovery.py to judge.

With ``"phase": "resume"`` it is a resumed run instead: no fault, the servers start from other
weights (``"server_model"``, a perturbed copy), the run continues from the checkpoints in
``out``, and at its first generation the servers are asked for greedy completions before
anything else: they must already hold the resumed actor's weights.

    python tests/rollout/fleet_recovery_worker.py '{"tiny": ..., "out": ..., "python": ..., "router": "none",
                                                    "phase": "faults" | "resume", "steps": 4,
                                                    "colocated": false}'
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.dist_utils import write_result  # noqa: E402

GREEDY_TOKENS = 4


def greedy(model, prompt, n=GREEDY_TOKENS):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    return ids[0, len(prompt):].tolist()


def main(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tepo.actor import MegatronActor
    from megatron_tepo.config import load_config
    from megatron_tepo.megatron.parallel import single_process_env
    from megatron_tepo.metrics import MetricsLogger
    from megatron_tepo.rollout.engine import gathered_tensors
    from megatron_tepo.rollout.sglang.fleet import FleetConfig, SGLangFleet
    from megatron_tepo.rollout.sglang.server import ServerConfig
    from megatron_tepo.rollout.sglang.weight_sync import make_weight_sync
    from megatron_tepo.trainer.loop import train
    from megatron_tepo.actor import actor_args
    from megatron_tepo.trainer.main import build_task

    tiny, out = Path(args["tiny"]), Path(args["out"])
    model_dir = str(tiny / "model")
    faulty, colocated = args["phase"] == "faults", bool(args.get("colocated"))
    cfg = load_config([str(REPO / "examples/tiny_tepo/sizes.yaml")], [
        f"model.path={model_dir}", f"data.train_files=[{tiny / 'train.jsonl'}]", "reward.kind=exact_match",
        "rollout.prompts_per_step=8", "rollout.n_samples=4", "train.mini_batch_prompts=8",
        "rollout.max_sampling_rounds=1", f"train.output_dir={out}", f"train.steps={args['steps']}",
        "train.save_every=1",
        *(["rollout.engine=sglang", "rollout.router=none", "rollout.colocated=true", "rollout.sync_mode=ipc",
           "rollout.sync_dtype=float32"] if colocated else [])])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task, _ = build_task(cfg, tokenizer, None)
    single_process_env()
    actor = MegatronActor(model_dir, hf_weights=model_dir, **actor_args(cfg))
    # probe_timeout 30 s: while the killed server restarts (SGLang's start-up takes the CPU), the
    # other one once missed two 10 s probes on a loaded 2-core CI machine and was declared dead;
    # the frozen server is still found within 2 x (2 + 30) s, long before the 300 s request time-out
    fcfg = FleetConfig(num_servers=2, router=args["router"], request_timeout=300, step_timeout=900,
                       probe_interval=2.0, probe_timeout=30.0, restart_backoff=1.0, server_restarts=2,
                       server=ServerConfig(model_path=args.get("server_model") or model_dir, python=args["python"],
                                           dtype="float32", startup_timeout=400, log_dir=str(out / "sglang_logs"),
                                           env={"TEPO_SGLANG_LOG_REQUESTS": "1"} if colocated else {}))
    fleet = SGLangFleet(fcfg)
    if colocated:
        fleet.weight_sync = make_weight_sync("ipc", fleet, wire_dtype=torch.float32)
    step_now = [1]
    faults = {}
    requests_seen = []  # (time, server index, incarnation, path)

    def instrument(s, idx):
        real = s.post

        def post(path, payload=None, timeout=60.0):
            requests_seen.append((time.monotonic(), idx, s.incarnation, path))
            if not faulty:
                return real(path, payload, timeout)
            if path == "/generate" and idx == 0 and step_now[0] == 2 and "kill" not in faults:
                faults["kill"] = {"time": time.monotonic(), "pid": s.pid}
                threading.Timer(0.05, os.kill, (s.pid, signal.SIGKILL)).start()  # as its request runs
            if colocated and path == "/release_memory_occupation" and idx == 1 and step_now[0] == 3 \
                    and "kill_released" not in faults:  # the actor's turn: dies with its memory released
                answer = real(path, payload, timeout)
                faults["kill_released"] = {"time": time.monotonic(), "pid": s.pid}
                os.kill(s.pid, signal.SIGKILL)
                return answer
            if not colocated and path == "/generate" and idx == 1 and step_now[0] == 3 and "stop" not in faults:
                faults["stop"] = {"time": time.monotonic(), "pid": s.pid}
                os.kill(s.pid, signal.SIGSTOP)
            return real(path, payload, timeout)
        s.post = post

    for i, s in enumerate(fleet.servers):
        instrument(s, i)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)  # float32, as saved
    prompts = task.train_prompts[:3]
    checks = []

    want_now = []

    def reference():
        """The actor's greedy completions (its HF export, float32)."""
        export = dict(gathered_tensors(actor.export_hf_state()))
        missing, unexpected = hf.load_state_dict(export, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
        want_now[:] = [greedy(hf, p) for p in prompts]

    if colocated:  # the reference right after each sync: by on_step the actor's weights are offloaded
        sync = fleet.update_weights

        def update_weights(named_tensors):
            sync(named_tensors)
            reference()
        fleet.update_weights = update_weights

    def check(step):
        """Every serving server's greedy completions and the actor's."""
        if not colocated:
            reference()
        want = list(want_now)
        for i, s in enumerate(fleet.servers):
            row = {"step": step, "server": i, "state": s.state.value, "incarnation": s.incarnation}
            if s.health.serving:
                got = []
                for p in prompts:
                    import requests
                    r = requests.post(s.url + "/generate", headers=s.headers(), timeout=120, json={
                        "input_ids": p, "sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0.0,
                                                            "ignore_eos": True}})
                    got.append(r.json()["output_ids"])
                row.update(got=got, want=want)
            checks.append(row)

    def on_step(step, metrics):  # after the step's weight sync
        check(step)
        step_now[0] = step + 1

    real_generate = fleet.generate

    def generate(*a, **kw):  # a resumed run: what the servers hold before its first generation
        if not checks:
            check(0)
        return real_generate(*a, **kw)

    if args["phase"] == "resume":
        fleet.generate = generate

    logger = MetricsLogger(out / "metrics.jsonl")
    try:
        train(cfg, actor, fleet, task, logger=logger, on_step=on_step, checkpoint_root=out / "checkpoints",
              report=lambda line: print(f"[train] {line}", flush=True))
        servers = [{"history": [(t.time, t.old.value, t.event.value, t.new.value, t.why) for t in s.health.history],
                    "log_path": s.log_path, "restarts": s.health.restarts, "incarnation": s.incarnation}
                   for s in fleet.servers]
    finally:
        logger.close()
        fleet.close()
    write_result({"prompts": prompts, "faults": faults, "checks": checks, "servers": servers, "requests": requests_seen,
                  "probe_bound_s": 2 * (fcfg.probe_interval + fcfg.probe_timeout),
                  "request_timeout": fcfg.request_timeout})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
