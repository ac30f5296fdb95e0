"""What the fit check says (:class:`FitReport`): the per-GPU breakdown printed by
``tools/fit_check.py`` and the nemo-run launcher, the CPU variant (no GPU arithmetic), and the
one-line errors naming the settings to change. The text is compared by tests (tests/launch/,
docs/LAUNCH.md quotes it); the numbers come from :mod:`megatron_tepo.launch.memory`. Left out:
the decision and the layout rules (:mod:`megatron_tepo.launch.fit`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_tepo.config import RunConfig
from megatron_tepo.launch.memory import GiB, ActorMemory, ServerMemory, total_params
from megatron_tepo.launch.schema import LaunchLayout
from megatron_tepo.launch.shape import ModelShape

__all__ = ["FitReport"]


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


@dataclass
class FitReport:
    shape: ModelShape
    actor: Optional[ActorMemory]  # None on CPU (launch.device: cpu): no GPU arithmetic
    server: Optional[ServerMemory]
    launch: LaunchLayout
    cfg: RunConfig

    @property
    def actor_fits(self) -> bool:
        return self.actor is None or self.actor.total <= self.launch.gpu_mem_gib * GiB

    @property
    def server_fits(self) -> bool:
        return self.server is None or self.server.total <= self.server.budget

    def actor_error(self) -> str:
        a, cfg = self.actor, self.cfg
        hints = []
        if not cfg.optim.use_distributed_optimizer and a.dp > 1:
            hints.append("set optim.use_distributed_optimizer: true")
        hints.append("raise parallel.tp or parallel.pp" + (" or parallel.ep" if self.shape.is_moe else ""))
        if cfg.actor.recompute != "full":
            hints.append("set actor.recompute: full")
        if cfg.actor.precision == "fp32":
            hints.append("set actor.precision: bf16")
        if a.activations + a.logits > 0.25 * a.total:
            hints.append("lower actor.max_tokens_per_micro_batch")
        if not cfg.actor.sequence_parallel and cfg.parallel.tp > 1:
            hints.append("set actor.sequence_parallel: true")
        if cfg.optim.use_distributed_optimizer:
            hints.append("raise launch.actor_nodes (more data-parallel optimizer shards)")
        return (f"actor does not fit: {a.total / GiB:.1f} GiB > {self.launch.gpu_mem_gib:g} GiB per GPU "
                f"({self.breakdown_actor()}); " + ", or ".join(hints))

    def server_error(self) -> str:
        s, k = self.server, self.launch.rollout.key
        return (f"rollout servers do not fit: {s.total / GiB:.1f} GiB > {s.budget / GiB:.1f} GiB per GPU "
                f"({k}.mem_fraction_static {self.launch.rollout.server.mem_fraction_static:g} x "
                f"{self.launch.gpu_mem_gib:g} GiB; weights {_gib(s.weights)} + KV cache {_gib(s.kv_cache)}); "
                f"raise {k}.tp, or lower {k}.max_running_requests, "
                f"or lower rollout.max_new_tokens / rollout.max_prompt_len")

    def breakdown_actor(self) -> str:
        a = self.actor
        parts = [f"weights {_gib(a.weights)}", f"grads {_gib(a.grads)}", f"optimizer {_gib(a.optimizer)}"]
        if a.reference:
            parts.append(f"reference {_gib(a.reference)}")
        parts += [f"activations {_gib(a.activations)}", f"logits {_gib(a.logits)}", f"reserve {_gib(a.reserve)}"]
        return ", ".join(parts)

    def render(self) -> str:
        if self.actor is None:
            return self.render_cpu()
        m, a, s, L, cfg = self.shape, self.actor, self.server, self.launch, self.cfg
        par, server = cfg.parallel, self.launch.rollout.server
        lines = [
            self.model_line(),
            f"actor: {L.actor_nodes} node(s) x {L.gpus_per_node} GPUs = {L.actor_gpus}; tp={par.tp} pp={par.pp} "
            f"ep={par.ep} dp={a.dp}" + (f" edp={a.edp}" if m.is_moe else "")
            + f" sp={cfg.actor.sequence_parallel} distributed_optimizer={cfg.optim.use_distributed_optimizer} "
            f"precision={cfg.actor.precision} attention={cfg.actor.attention} recompute={cfg.actor.recompute} "
            f"packed={cfg.actor.pack_sequences} micro-batch tokens={a.tokens}",
            f"  per GPU ({a.stage} stage): params {a.dense_params + a.expert_params:,}; {self.breakdown_actor()}",
            f"  total {_gib(a.total)} of {L.gpu_mem_gib:g} GiB: {'fits' if self.actor_fits else 'DOES NOT FIT'}",
            f"rollout: {L.rollout_nodes} node(s), {s.servers} SGLang server(s) x tp={server.tp}, "
            f"{server.max_running_requests} running requests each ({s.servers * server.max_running_requests} "
            f"concurrent; a step has {cfg.rollout.prompts_per_step * cfg.rollout.n_samples} sequences)",
            f"  per GPU: weights {_gib(s.weights)} + KV cache {_gib(s.kv_cache)} "
            f"({s.kv_tokens:,} tokens x {s.kv_bytes_per_token:,} B) = {_gib(s.total)} of {_gib(s.budget)} "
            f"(mem_fraction_static {server.mem_fraction_static:g}): {'fits' if self.server_fits else 'DOES NOT FIT'}",
        ]
        return "\n".join(lines)

    def model_line(self) -> str:
        m = self.shape
        return (f"model: {m.family}, {total_params(m):,} parameters "
                f"(L={m.num_hidden_layers}, h={m.hidden_size}, F={m.intermediate_size}, nh={m.num_attention_heads}, ng={m.num_key_value_heads}, d={m.head_dim}, "
                f"V={m.vocab_size}, tied={m.tie_word_embeddings}" + (f", E={m.num_experts}, k={m.num_experts_per_tok}, Fm={m.moe_intermediate_size}" if m.is_moe else "")
                + ")")

    def render_cpu(self) -> str:
        L, cfg = self.launch, self.cfg
        par = cfg.parallel
        where = "on the actor node(s) (colocated)" if L.colocated else f"on {L.rollout_nodes} node(s)"
        return "\n".join([
            self.model_line(),
            f"actor (cpu): {L.actor_nodes} node(s) x {L.gpus_per_node} processes = {L.actor_gpus}; "
            f"tp={par.tp} pp={par.pp} ep={par.ep} dp={par.dp(L.actor_gpus)}",
            f"rollout (cpu): {L.servers} SGLang server(s) {where}, tp={L.rollout.server.tp}, "
            f"{L.rollout.server.threads_per_server} thread(s) each",
            "memory: not checked (launch.device: cpu; the GPU arithmetic does not apply)",
        ])
