"""What the fit check says (:class:`FitReport`): the per-GPU breakdown printed by
``tools/fit_check.py`` and the nemo-run launcher (a colocated layout: each phase's peak at the
offload level in use, and why the lesser levels do not fit), the CPU variant (no GPU arithmetic),
and the one-line errors naming the settings to change. The text is compared by tests (tests/launch/,
docs/LAUNCH.md quotes it); the numbers come from :mod:`megatron_tepo.launch.memory`. Left out:
the decision and the layout rules (:mod:`megatron_tepo.launch.fit`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_tepo.config import RunConfig
from megatron_tepo.config.validation import episode_turns
from megatron_tepo.launch.memory import OFFLOAD_ORDER, GiB, ActorMemory, ColocatedMemory, ServerMemory, total_params
from megatron_tepo.launch.schema import LaunchLayout
from megatron_tepo.launch.shape import ModelShape
from megatron_tepo.time_limits import MIN_REQUEST_S, PREFILL_S, needed_request_s, request_limit_s, round_limit_s, waves

__all__ = ["FitReport"]


def _state(s: ServerMemory) -> str:
    """A hybrid server's recurrent state beside its KV cache ("" without Gated DeltaNet layers)."""
    return (f" + recurrent state {_gib(s.state)} ({s.state_requests:,} requests x {s.state_bytes_per_request:,} B)"
            if s.state_requests else "")


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


@dataclass
class FitReport:
    shape: ModelShape
    actor: Optional[ActorMemory]  # None on CPU (launch.device: cpu): no GPU arithmetic
    server: Optional[ServerMemory]
    launch: LaunchLayout
    cfg: RunConfig
    colocated: Optional[ColocatedMemory] = None  # launch.rollout.placement: colocated (cuda)
    # actor.lora: the same layout full-parameter (the fit check prices both; the report shows both)
    full_actor: Optional[ActorMemory] = None
    full_colocated: Optional[ColocatedMemory] = None

    @property
    def colocated_fits(self) -> bool:
        return self.colocated is None or self.colocated.phases.fits

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
        if a.activations + a.logits + a.cp_attention > 0.25 * a.total:
            longest = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens
            if cfg.actor.max_tokens_per_micro_batch > longest:  # (never below the longest sequence)
                hints.append("lower actor.max_tokens_per_micro_batch")
            hints.append(("" if cfg.actor.pack_sequences else "set actor.pack_sequences: true and ")
                         + f"raise parallel.cp (now {cfg.parallel.cp}: each of cp ranks holds 1/cp of a "
                         f"micro-batch's tokens, its activations and LM head)")
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

    def colocated_error(self) -> str:
        c, L, k = self.colocated, self.launch, self.launch.rollout.key
        p = c.phases
        over = [f"{name} phase {getattr(p, name) / GiB:.1f} GiB" for name in ("rollout", "training", "sync")
                if getattr(p, name) > c.gpu]
        over = [", ".join(over) + f" > {L.gpu_mem_gib:g} GiB per GPU"] if over else []
        if not p.fits_host:
            over.append(f"pinned host memory {p.host_per_node / GiB:.0f} GiB > {c.host.bytes / GiB:.0f} GiB per node "
                        f"({c.host.source})")
        what = (f"actor.offload: {c.level} does not fit (the least that fits: {c.least})" if c.least
                else f"no actor.offload level fits, not even all (at {c.level})")
        hints = []
        if p.training > c.gpu:
            hints.append("raise parallel.tp or parallel.pp, or set actor.recompute: full, or lower "
                         "actor.max_tokens_per_micro_batch (the whole actor trains beside the released servers)")
        if p.rollout > c.gpu or p.sync > c.gpu:
            hints.append(f"lower {k}.max_running_requests (room for {c.capacity(c.least or 'all')} per server at "
                         f"offload {c.least or 'all'}), or raise {k}.tp")
        if not p.fits_host:
            hints.append("offload less, or raise launch.actor_nodes (more ranks share the optimizer)")
        if c.least and c.level != c.least:
            hints.insert(0, f"set actor.offload: {c.least} (or auto)")
        return f"colocated layout does not fit: {what}: {'; '.join(over)}; " + "; or ".join(hints)

    def breakdown_actor(self) -> str:
        a = self.actor
        parts = [f"weights {_gib(a.weights)}", f"grads {_gib(a.grads)}", f"optimizer {_gib(a.optimizer)}"]
        if a.reference:
            parts.append(f"reference {_gib(a.reference)}")
        parts += [f"activations {_gib(a.activations)}", f"logits {_gib(a.logits)}"]
        if a.cp > 1:
            parts.append(f"CP attention {_gib(a.cp_attention)}")
        parts.append(f"reserve {_gib(a.reserve)}")
        if a.routing:
            parts.append(f"routing replay {a.routing / 2 ** 20:.0f} MiB (and {_gib(a.routing_host)} of host memory a "
                         f"rank per step: the step's routed experts)")
        if a.writer_context:
            parts.append(f"checkpoint writer {_gib(a.writer_context)} (NVRx's writer opens the asynchronous save's "
                         f"tensors by CUDA IPC: PYTORCH_CUDA_ALLOC_CONF has no expandable segments)")
        if a.staging_host:
            parts.append(f"and {_gib(a.staging_host)} of host memory a GPU staging each asynchronous save "
                         f"({_gib(a.staging_host * self.launch.gpus_per_node)} a node)")
        return ", ".join(parts)

    def render(self) -> str:
        if self.actor is None:
            return self.render_cpu()
        if self.colocated is not None:
            return self.render_colocated()
        a, s, L, cfg = self.actor, self.server, self.launch, self.cfg
        server = self.launch.rollout.server
        lines = [
            self.model_line(),
            self.actor_line(),
            f"  per GPU ({a.stage} stage): params {a.dense_params + a.expert_params:,}; {self.breakdown_actor()}",
            f"  total {_gib(a.total)} of {L.gpu_mem_gib:g} GiB: {'fits' if self.actor_fits else 'DOES NOT FIT'}",
            *self.lora_lines(),
            f"rollout: {L.rollout_nodes} node(s), {s.servers} SGLang server(s) x tp={server.tp}, "
            f"{server.max_running_requests} running requests each ({s.servers * server.max_running_requests} "
            f"concurrent; a step has {cfg.rollout.prompts_per_step * cfg.rollout.n_samples} sequences)",
            f"  per GPU: weights {_gib(s.weights)} + KV cache {_gib(s.kv_cache)} "
            f"({s.kv_tokens:,} tokens x {s.kv_bytes_per_token:,} B){_state(s)} = {_gib(s.total)} of {_gib(s.budget)} "
            f"(mem_fraction_static {server.mem_fraction_static:g}): {'fits' if self.server_fits else 'DOES NOT FIT'}",
            self.limits_line(),
        ]
        return "\n".join(lines)

    def lora_lines(self) -> list:
        """With ``actor.lora``: the adapters on one GPU, and the same layout's full-parameter run
        beside it (its whole actor per GPU; colocated: its peak at its own least offload level)."""
        a, lora = self.actor, self.cfg.actor.lora
        if lora is None or self.full_actor is None:
            return []
        f = self.full_actor
        base = a.dense_params + a.expert_params - a.lora_params
        lines = [f"  LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.target_modules)}: "
                 f"{a.lora_params:,} adapter parameters on this GPU ({100 * a.lora_params / base:.2f}% of its "
                 f"{base:,} frozen base parameters: weights only); gradients {_gib(a.grads)} and optimizer "
                 f"{_gib(a.optimizer)} are the adapters'",
                 f"  the same layout full-parameter: weights {_gib(f.weights)}, grads {_gib(f.grads)}, optimizer "
                 f"{_gib(f.optimizer)}; total {_gib(f.total)} per GPU (LoRA: {_gib(a.total)})"]
        c = self.full_colocated
        if c is not None:
            lines[-1] += (f"; colocated, its peak {_gib(c.levels[c.least or 'all'].peak)} at offload "
                          f"{c.least or 'all'} ({'fits' if c.least else 'no level fits'}), moving "
                          f"{_gib(c.levels[c.least or 'all'].moved)} per GPU each way a step")
        return lines

    def limits_line(self) -> str:
        """The rollout's time limits (time_limits.py) against the watchdog's generation phase."""
        r, L = self.cfg.rollout, self.launch
        slots = L.servers * L.rollout.server.max_running_requests
        samples = r.prompts_per_step * r.n_samples
        request, rounds = request_limit_s(r), waves(samples, slots)
        turns, tool_s = episode_turns(self.cfg)
        need = needed_request_s(r.max_new_tokens, r.decode_floor_tokens_per_s)
        how = ("rollout.request_timeout_s" if r.request_timeout_s is not None else
               f"{r.max_new_tokens} tokens at rollout.decode_floor_tokens_per_s {r.decode_floor_tokens_per_s:g} "
               f"+ {PREFILL_S:g} s" + (f" = {need:.0f} s, at least {MIN_REQUEST_S:g} s" if need < MIN_REQUEST_S else ""))
        w = self.cfg.fault.watchdog_generate_s
        per = f"{rounds * request:.0f} s" if turns == 1 else \
            f"x {turns} turns x ({request:.0f} s + {tool_s:g} s a tool call) = {round_limit_s(r, samples, slots, turns, tool_s):.0f} s"
        return (f"time limits: a request {request:.0f} s ({how}); a sampling round {rounds} wave(s) of {samples} "
                f"sequences on {slots} slots {'= ' if turns == 1 else ''}{per}; fault.watchdog_generate_s "
                + (f"{w:g} s" if w else "off"))

    def actor_line(self) -> str:
        m, a, L, cfg, par = self.shape, self.actor, self.launch, self.cfg, self.cfg.parallel
        return (f"actor: {L.actor_nodes} node(s) x {L.gpus_per_node} GPUs = {L.actor_gpus}; tp={par.tp} pp={par.pp} "
                f"ep={par.ep} dp={a.dp} cp={par.cp}" + (f" edp={a.edp}" if m.is_moe else "")
                + f" sp={cfg.actor.sequence_parallel} distributed_optimizer={cfg.optim.use_distributed_optimizer} "
                f"precision={cfg.actor.precision} attention={cfg.actor.attention} recompute={cfg.actor.recompute} "
                f"packed={cfg.actor.pack_sequences} micro-batch tokens={a.tokens}"
                + (f" ({a.rank_tokens} a CP rank: each sequence in 2 x cp={par.cp} chunks, two a rank"
                   + (f"; the optimizer sharded over dp x cp = {a.dp * par.cp}"
                      if cfg.optim.use_distributed_optimizer else "") + ")" if par.cp > 1 else ""))

    def render_colocated(self) -> str:
        """A colocated layout: the servers on the actor's GPUs; each phase's peak per GPU at the
        offload level in use, the other levels in one line each, the pinned host memory."""
        a, s, c, L, cfg = self.actor, self.server, self.colocated, self.launch, self.cfg
        server, p = L.rollout.server, self.colocated.phases
        verdict = "fits" if p.fits else "DOES NOT FIT"
        lines = [
            self.model_line(),
            self.actor_line() + " (colocated: the servers on the same GPUs, taking turns)",
            f"  whole actor per GPU ({a.stage} stage): params {a.dense_params + a.expert_params:,}; "
            f"{self.breakdown_actor()}; total {_gib(a.total)}",
            *self.lora_lines(),
            f"servers: {s.servers} SGLang server(s) x tp={server.tp} on the actor nodes ({L.servers_per_node} a node, "
            f"server i on GPUs [i*{server.tp}, (i+1)*{server.tp})), memory saver, {server.max_running_requests} running "
            f"requests each ({s.servers * server.max_running_requests} concurrent; a step has "
            f"{cfg.rollout.prompts_per_step * cfg.rollout.n_samples} sequences)",
            f"  per GPU: weights {_gib(s.weights)} + KV cache {_gib(s.kv_cache)} ({s.kv_tokens:,} tokens x "
            f"{s.kv_bytes_per_token:,} B){_state(s)} + kept when released {_gib(c.server_released)} -> mem_fraction_static "
            f"{c.fraction:.2f} (derived: {_gib(c.pool)}); graphs and activations {_gib(c.server_reserve)}",
            f"offload: {c.level}" + (" (the least that fits)" if c.level == c.least else
                                     f" (actor.offload; the least that fits: {c.least})" if c.least else
                                     " (no level fits)")
            + f": {_gib(p.moved)} per GPU to host and back each step; pinned host memory {_gib(p.host_per_node)} "
            f"per node" + (f" (with the async save's staging, {_gib(p.staging)} per GPU)" if p.staging else "")
            + (f" of {_gib(c.host.bytes)} ({c.host.source})" if c.host.bytes else f" ({c.host.source})"),
            f"  rollout phase peak {_gib(p.rollout)}: the actor keeps {_gib(p.kept)} + its reserve {_gib(a.reserve)} "
            f"+ the server's pool {_gib(c.pool)} + its graphs and activations {_gib(c.server_reserve)} (room for "
            f"{c.capacity(c.level)} sequences per server)",
            f"  training phase peak {_gib(p.training)}: the whole actor {_gib(a.total)} + the released server "
            f"{_gib(c.server_released)}",
            f"  sync phase peak {_gib(p.sync)}: the actor keeps {_gib(p.at_sync)} + its reserve {_gib(a.reserve)} "
            f"+ buckets {_gib(c.buckets)} + the server's weights {_gib(s.weights)} + what it keeps "
            f"{_gib(c.server_released)}",
            f"  peak {_gib(p.peak)} of {L.gpu_mem_gib:g} GiB per GPU: {verdict}",
        ]
        for level in OFFLOAD_ORDER:
            q = c.levels[level]
            if level != c.level:
                lines.append(f"  offload {level}: rollout {_gib(q.rollout)}, training {_gib(q.training)}, sync "
                             f"{_gib(q.sync)}, host {_gib(q.host_per_node)} per node: "
                             + ("fits" if q.fits else "does not fit"))
        lines.append(self.limits_line())
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
        where = ("on the actor node(s) (colocated: taking turns with the actor)" if L.colocated else
                 "on the actor node(s) (colocated)" if L.shares_actor_nodes else f"on {L.rollout_nodes} node(s)")
        return "\n".join([
            self.model_line(),
            f"actor (cpu): {L.actor_nodes} node(s) x {L.gpus_per_node} processes = {L.actor_gpus}; "
            f"tp={par.tp} pp={par.pp} ep={par.ep} dp={par.dp(L.actor_gpus)} cp={par.cp}",
            f"rollout (cpu): {L.servers} SGLang server(s) {where}, tp={L.rollout.server.tp}, "
            f"{L.rollout.server.threads_per_server} thread(s) each",
            "memory: not checked (launch.device: cpu; the GPU arithmetic does not apply)",
        ])
