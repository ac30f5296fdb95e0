"""The embedded rollout engine: a plain Hugging Face causal LM in this process.

The default on one machine (and in tests): no server, no sync traffic -- :meth:`update_weights`
copies the ``(HF name, tensor)`` stream straight into the model's parameters.

Sampling is exactly ``softmax(logits / temperature)`` restricted to the top-p nucleus (the smallest
set of most-probable tokens whose mass reaches ``top_p``, renormalised); the returned log-prob of
each sampled token is its log-probability under that distribution (with ``top_p == 1`` this is
``log_softmax(logits / T)`` of the token, the quantity the actor recomputes). Generation is batched
(all prompts x n samples, left-padded, up to ``max_batch_size`` rows at a time) with a KV cache,
and deterministic for a given seed. Registered as ``rollout.engine: embedded``: the driver loads
the run's HF checkpoint in float32.

Colocated mode (``rollout.colocated``): :meth:`EmbeddedEngine.release_memory` frees the weights'
memory (their content is gone until the next weight update; generating before it is an error) and
the KV cache, which lives only inside one :meth:`EmbeddedEngine.generate` call, is only marked.

MoE routing (``routing``: the routing contract's :class:`~megatron_tepo.routing.RoutingShape`, for
``actor.routing_replay: r3``; the trainer reads it from the model family's config): forward hooks on the
model's routers (the ``*TopKRouter`` modules of transformers' MoE families, whose output ends with
the top-k expert ids) record, in every forward of the generation (the prefill and each decode
step), the experts each position went to in each MoE layer; each :class:`Sample` then carries
``routed_experts`` ``[prompt + response - 1, moe_layers, topk]`` (the last token is never run) in
the shape's dtype; a submitted request's segment (:meth:`EmbeddedEngine.submit`: a multi-turn
episode's turn) carries the routing of its whole input (``prompt + token_ids``) and of the segment
but its last token, the same way. Off by default: no hook is registered. A model without such routers, or whose
routers are not the shape's (another count of MoE layers or of experts), refuses it. An MoE model's
weight update arrives with one tensor per expert (the checkpoint names); transformers >= 5 keeps
the experts fused in memory (``mlp.experts.gate_up_proj`` / ``down_proj``), and
:meth:`EmbeddedEngine.update_weights` writes each expert's slice there.

Compiles in other threads (:data:`COMPILE_SESSIONS`): torch (>= 2.13) holds
``torch.compiler.is_compiling()`` True for the whole of a ``torch.compile`` session, for every thread
of the process (one global flag), and transformers reads it to choose code paths (decoding with
grouped-query attention: ``repeat_kv`` instead of ``pack_gqa``, other SDPA shapes, log-probs that
differ in the last bits). The trainer's actor compiles (megatron-core's ``jit_fuser`` functions,
e.g. the MoE router's ``_apply_expert_bias``) while this engine generates the next step's rollout in
the driver's background thread (one step off), so which tokens fell inside a compile depended on
timing. Every forward of the engine therefore runs outside any other thread's compile session: the
session and the forward exclude each other (both hold dynamo's compile lock; a forward waits for a
compile to end, a compile for the forward running), and the engine's numbers are those of plain
eager execution whatever the other threads do.

Left out: serving several processes (it lives in the driver's), and sampling beyond temperature
and top-p.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch

from megatron_tepo.rollout.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, MEMORY_TAGS, Group, Request,
                                          RolloutEngine, Sample, SamplingParams, gathered_tensors, make_params,
                                          validate_prompts)
from megatron_tepo.rollout.registry import EngineSettings, register_engine
from megatron_tepo.routing import RoutingShape


def sampling_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs (float32) of the sampling distribution: ``log_softmax(logits / T)`` over the top-p
    nucleus, renormalised; tokens outside the nucleus get ``-inf``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
    probs = sorted_lp.exp()
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= top_p  # keep a token while the mass before it is < top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes and returns its KV cache: ``cache`` in
    the newer transformers (5.24: ``past_key_values`` is deprecated there, to be removed in 5.40),
    else ``past_key_values`` (4.x, and 5.19 of the SGLang venv). Read from the forward's signature
    (``inspect.signature`` follows transformers' ``deprecate_kwarg`` wrapper to the function)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class CompileSessions:
    """Mutual exclusion of the engine's forwards and ``torch.compile`` sessions (see the module
    docstring). :meth:`install` wraps torch's ``torch.compiler._compile_session_context`` (the
    context that holds the process-wide ``is_compiling`` flag; dynamo enters it around every frame
    it compiles, holding its own ``compile_lock``) so that a session holds :attr:`lock`, which is
    that ``compile_lock``; :meth:`forward` holds it around one forward. One lock taken in one order,
    and reentrant: a compile inside the engine's own forward (its model compiled in part) cannot
    deadlock against another thread's compile. Where torch has no such session context (the flag is
    then not global) nothing is wrapped and a forward only takes an uncontended lock."""

    def __init__(self):
        self.lock = threading.RLock()
        self.waiting = 0  # forwards waiting now for another thread's compile to end
        self._count = threading.Lock()

    def install(self) -> bool:
        """Wrap torch's session context once (idempotent); False where torch has none."""
        import torch.compiler as compiler

        with self._count:
            original = getattr(compiler, "_compile_session_context", None)
            if original is None:
                return False
            if getattr(original, "__mtepo_exclusive__", False):
                return True
            from torch._dynamo import convert_frame

            self.lock = getattr(convert_frame, "compile_lock", self.lock)
            lock = self.lock

            @contextlib.contextmanager
            def session():
                with lock, original():  # the flag is True only while the lock is held
                    yield

            session.__mtepo_exclusive__ = True
            session.__wrapped__ = original
            compiler._compile_session_context = session
            return True

    @contextlib.contextmanager
    def forward(self):
        """Held around one forward of the engine's model: no other thread compiles meanwhile."""
        lock = self.lock
        if not lock.acquire(blocking=False):  # another thread compiles: wait for it to end
            with self._count:
                self.waiting += 1
            try:
                lock.acquire()
            finally:
                with self._count:
                    self.waiting -= 1
        try:
            yield
        finally:
            lock.release()


#: the process's one :class:`CompileSessions` (installed by the first :class:`EmbeddedEngine`)
COMPILE_SESSIONS = CompileSessions()


class EmbeddedEngine(RolloutEngine):
    """In-process engine around a ``transformers`` causal LM (HF parameter names)."""

    def __init__(self, model: Union[torch.nn.Module, str], *, seed: int = 0,
                 dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu",
                 max_batch_size: int = 64, pad_token_id: int = 0,
                 routing: Optional[RoutingShape] = None):
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or torch.float32)
        elif dtype is not None:
            model = model.to(dtype)
        self.model = model.to(device).eval()
        COMPILE_SESSIONS.install()  # no forward of this engine inside another thread's compile
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._cache_arg = cache_argument(self.model)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._released: set = set()  # colocated mode: the memory tags released
        self._weights_stale = False  # weights taken back, not yet updated: nothing to generate with
        self._routing: Optional[List[List[torch.Tensor]]] = None  # per forward, per MoE layer: [b * t, k]
        self._hooks: list = []  # the routers' hooks (routing), removed by close()
        self.routing = routing
        if routing is not None:
            _record_routing(self.model, self, self._hooks, routing)
        # interruptible generation (submit / collect / interrupt): one worker thread, started at
        # the first submit, generates the queued requests batch after batch
        self._cv = threading.Condition()
        self._queue: List[Tuple[Request, SamplingParams]] = []
        self._running: List[Request] = []
        self._finished: List[Tuple[Request, Sample]] = []
        self._stop = threading.Event()
        self._worker: Optional[threading.Thread] = None
        self._closing = False

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: List[List[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 128,
                 stop_token_ids: Sequence[int] = ()) -> List[Group]:
        sp = make_params(n, temperature, top_p, max_new_tokens, stop_token_ids)
        validate_prompts(prompts, self.vocab_size)
        self._check_serving()
        rows = [list(p) for p in prompts for _ in range(sp.n)]
        samples: List[Sample] = []
        for start in range(0, len(rows), self.max_batch_size):
            samples.extend(self._generate_rows(rows[start:start + self.max_batch_size], sp))
        return [samples[i * sp.n:(i + 1) * sp.n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_rows(self, rows: List[List[int]], sp, budgets: Optional[List[int]] = None,
                       stop_event: Optional[threading.Event] = None) -> List[Sample]:
        """``budgets``: each row's token budget (default ``sp.max_new_tokens``); ``stop_event``: once
        set, the rows still generating end where they stand (``FINISH_ABORT``)."""
        b, width = len(rows), max(len(r) for r in rows)
        budget = torch.tensor(budgets if budgets is not None else [sp.max_new_tokens] * b, dtype=torch.long)
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token sits at the end
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        stop = torch.tensor(sorted(sp.stop_token_ids), dtype=torch.long, device=self.device)
        out_tok = torch.empty((b, 0), dtype=torch.long, device=self.device)
        out_lp = torch.empty((b, 0), dtype=torch.float32, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(b, dtype=torch.bool, device=self.device)
        budget = budget.to(self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)  # tokens each row generated
        cache, step_ids = None, ids
        self._routing = [] if self.routing is not None else None
        for step in range(int(budget.max())):
            if step and stop_event is not None and stop_event.is_set():  # (every row gets its first token)
                break
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            with COMPILE_SESSIONS.forward():
                out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                 **{self._cache_arg: cache})
            cache = getattr(out, self._cache_arg)
            logp = sampling_log_probs(out.logits[:, -1], sp.temperature, sp.top_p)
            tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(1)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(1)
            tok = tok.masked_fill(done, self.pad_token_id)
            out_tok = torch.cat([out_tok, tok[:, None]], 1)
            out_lp = torch.cat([out_lp, tok_lp[:, None]], 1)
            active = ~done
            lengths += active.long()
            if stop.numel():
                hit = torch.isin(tok, stop) & active
                stopped |= hit
                done |= hit
            done |= lengths >= budget
            step_ids = tok[:, None]
            mask = torch.cat([mask, active.long()[:, None]], 1)
            if bool(done.all()):
                break
        routing = self._take_routing(b)  # [b, width + forwards - 1, M, k] or None
        samples = []
        for i in range(b):
            k = int(lengths[i])
            toks, lps = out_tok[i, :k].tolist(), out_lp[i, :k].tolist()
            reason = FINISH_STOP if bool(stopped[i]) else FINISH_LENGTH if bool(done[i]) else FINISH_ABORT
            samples.append(Sample(toks, lps, reason))
            if routing is not None:  # the prompt's positions, then each response token but the last
                first = width - len(rows[i])
                samples[-1].routed_experts = routing[i, first:width + len(samples[-1].token_ids) - 1].clone()
        return samples

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    # ------------------------------------------------------------------ interruptible generation
    interruptible = True

    def submit(self, requests: Sequence[Request], params: SamplingParams) -> None:
        self._check_serving()
        validate_prompts([r.prompt for r in requests], self.vocab_size)
        for r in requests:
            if r.remaining < 1:
                raise ValueError(f"request {r.key!r}: no tokens left to generate ({len(r.token_ids)} of "
                                 f"max_new_tokens {r.max_new_tokens})")
        with self._cv:
            self._queue += [(r, params) for r in requests]
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="mtepo-embedded-generate", daemon=True)
                self._worker.start()
            self._cv.notify_all()

    def collect(self, timeout: float = 0.0) -> List[Tuple[Request, Sample]]:
        with self._cv:
            if not self._finished and timeout > 0:
                self._cv.wait_for(lambda: bool(self._finished), timeout=timeout)
            out, self._finished = self._finished, []
        return out

    def interrupt(self) -> List[Tuple[Request, Sample]]:
        with self._cv:  # (under the lock: the worker hands one batch to the next without a gap)
            self._stop.set()  # the running batch ends after its current token; no new batch starts
            self._cv.wait_for(lambda: not self._running)
            queued = [(r, Sample([], [], FINISH_ABORT)) for r, _ in self._queue]
            out, self._finished, self._queue = self._finished + queued, [], []
            self._stop.clear()
        return out

    def _work(self) -> None:
        """Batch after batch. A finished batch is published and the next one taken in one hold of
        the lock, and every row of a batch gets its first token before an interrupt stops it, so an
        interrupt with requests queued or running always cuts a batch after at least one token."""
        batch, samples = [], []
        while True:
            with self._cv:
                if batch:  # publish the last batch and take the next in one hold of the lock
                    self._finished += list(zip(batch, samples))
                    self._running = []
                    self._cv.notify_all()
                batch, sp = self._take_batch()
            if batch is None:
                return
            try:
                samples = self._generate_rows([r.prompt + r.token_ids for r in batch], sp,
                                              [r.remaining for r in batch], self._stop)
            except BaseException as exc:  # noqa: BLE001 -- every request of the batch comes back aborted
                samples = [Sample([], [], FINISH_ABORT, meta={"error": f"{type(exc).__name__}: {exc}"})
                           for _ in batch]

    def _take_batch(self):
        """(under the lock) Wait for work, then the next batch (the first queued request's sampling
        parameters, up to ``max_batch_size``), now running; (None, None) when closing."""
        self._cv.wait_for(lambda: self._closing or (self._queue and not self._stop.is_set()))
        if self._closing:
            return None, None
        sp = self._queue[0][1]
        batch = [r for r, p in self._queue if p == sp][:self.max_batch_size]
        taken = {id(r) for r in batch}
        self._queue = [(r, p) for r, p in self._queue if id(r) not in taken]
        self._running = batch
        return batch, sp

    def _check_serving(self) -> None:
        if self._released or self._weights_stale:
            what = f"its {', '.join(sorted(self._released))} released" if self._released else \
                "its weights taken back but not updated yet"
            raise RuntimeError(f"EmbeddedEngine.generate: {what} (colocated mode: resume the memory, then "
                               f"update the weights, before generating)")

    def _take_routing(self, b: int) -> Optional[torch.Tensor]:
        """The routing recorded by this generation's forwards as ``[b, columns, M, k]`` (column
        ``c`` is the token at column ``c`` of the left-padded prompt grid, then the decode steps')."""
        if self._routing is None:
            return None
        per_forward = [torch.stack([ids.reshape(b, -1, ids.shape[-1]) for ids in layers], dim=2)
                       for layers in self._routing]
        self._routing = None
        return torch.cat(per_forward, dim=1).to(device="cpu", dtype=self.routing.dtype)

    def _record(self, layer: int, indices: torch.Tensor) -> None:
        """A router hook's report: layer ``layer``'s top-k ids of the forward running now."""
        if self._routing is None:
            return
        if layer == 0:
            self._routing.append([])
        self._routing[-1].append(indices.detach())

    @torch.no_grad()
    def score(self, sequences: List[List[int]], prompt_lens: List[int],
              temperature: float = 1.0) -> List[List[float]]:
        result = []
        for seq, pl in zip(sequences, prompt_lens):
            ids = torch.tensor([seq], device=self.device)
            with COMPILE_SESSIONS.forward():
                logits = self.model(input_ids=ids).logits[0, pl - 1:-1]
            lp = torch.log_softmax(logits.float() / temperature, -1)
            result.append(lp.gather(-1, ids[0, pl:, None]).squeeze(-1).tolist())
        return result

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor into the model; the stream must cover every parameter (a partial
        update -- e.g. one pipeline stage only -- is an error naming what is missing). The
        actor's export is read gathered to global rank 0, where this engine lives."""
        with self._cv:
            if self._running or self._queue:
                raise RuntimeError(f"EmbeddedEngine.update_weights: {len(self._running) + len(self._queue)} submitted "
                                   f"requests are generating; interrupt() them first (no token is generated under "
                                   f"weights being written)")
        seen = set()
        slices: dict = {}  # fused expert tensor -> expert slices written
        for name, tensor in gathered_tensors(named_tensors):
            fused = _fused_expert_slice(name, self._params)
            if fused is not None:  # transformers >= 5 keeps an MoE's experts as one tensor in memory
                target, index, part = fused
                param = self._params[target]
                dest = param[index] if part is None else param[index].chunk(2, dim=0)[part]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(dest.shape)}")
                dest.copy_(tensor.to(device=param.device, dtype=param.dtype))
                slices.setdefault(target, set()).add((index, part))
                continue
            seen.add(name)
            param = self._params.get(name)
            if param is None:
                raise KeyError(f"EmbeddedEngine.update_weights: unknown parameter {name!r} "
                               f"(the model has {len(self._params)} named parameters)")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        for target, written in slices.items():  # a fused tensor counts once every expert's slice is in
            p = self._params[target]
            if len(written) == p.shape[0] * (2 if target.endswith("gate_up_proj") else 1):
                seen.add(target)
        covered = {self._params[n].data_ptr() for n in seen if n in self._params}  # tied weights share storage
        missing = sorted(n for n, p in self._params.items() if n not in seen and p.data_ptr() not in covered)
        if missing:
            raise ValueError(f"EmbeddedEngine.update_weights: {len(missing)} of {len(self._params)} parameters "
                             f"were not in the stream (the engine now mixes old and new weights), e.g. {missing[:4]}")
        self._weights_stale = False

    def flush_cache(self) -> None:
        pass  # the KV cache lives only inside one generate() call

    # ------------------------------------------------------------------ memory (colocated mode)
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """``weights``: every parameter's tensor dropped (its memory freed, memory-mapped or not;
        the content is gone; the buffers, which no weight update carries, are kept);
        ``kv_cache`` / ``cuda_graph``: nothing is held between calls of :meth:`generate`, only
        marked released."""
        _check_tags(tags)
        if "weights" in tags and "weights" not in self._released:
            self._shapes = {}
            for p in {id(p): p for p in self._params.values()}.values():  # a tied weight once
                self._shapes[id(p)] = (p, p.shape)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._released |= set(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take the memory of ``tags`` back; resumed weights hold garbage until :meth:`update_weights`."""
        _check_tags(tags)
        if "weights" in tags and "weights" in self._released:
            for p, shape in self._shapes.values():
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            self._shapes = {}
            self._weights_stale = True
        self._released -= set(tags)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._stop.set()
            self._cv.notify_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.model = None
        self._params = {}


def _fused_expert_slice(name: str, params: dict):
    """``(fused parameter, expert, part)`` where per-expert checkpoint name ``name``
    (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) lives in a fused ``...mlp.experts.gate_up_proj``
    ``[E, 2I, H]`` (part 0: gate, 1: up) or ``...down_proj`` ``[E, H, I]`` (part None); None when the
    model holds ``name`` itself or it is no expert weight."""
    if name in params or not name.endswith("_proj.weight") or ".experts." not in name:
        return None
    head, _, rest = name.rpartition(".experts.")
    index, _, proj = rest.partition(".")
    if not index.isdigit():
        return None
    if proj == "down_proj.weight" and f"{head}.experts.down_proj" in params:
        return f"{head}.experts.down_proj", int(index), None
    if proj in ("gate_proj.weight", "up_proj.weight") and f"{head}.experts.gate_up_proj" in params:
        return f"{head}.experts.gate_up_proj", int(index), 0 if proj == "gate_proj.weight" else 1
    return None


def _record_routing(model: torch.nn.Module, engine: "EmbeddedEngine", handles: list, shape: RoutingShape) -> None:
    """Hook every MoE router of ``model`` (modules named ``*TopKRouter``, in layer order: router
    ``j`` is the shape's MoE layer ``j``) to report its top-k ids to ``engine`` (the hooks' handles
    appended to ``handles``). Routers that are not the shape's: ValueError naming both."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        raise ValueError(f"return_routing: {type(model).__name__} has no MoE router (a *TopKRouter module) "
                         f"to record; routing replay needs an MoE model")
    experts = {getattr(r, "num_experts", None) for r in routers}
    if len(routers) != shape.num_moe_layers or experts != {shape.num_experts}:
        raise ValueError(f"return_routing: {type(model).__name__} has {len(routers)} MoE routers of "
                         f"{sorted(experts, key=str)} experts, the model family's routing shape says "
                         f"{shape.num_moe_layers} MoE layers of {shape.num_experts}")

    def hook_for(layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(f"return_routing: {type(module).__name__} returned {type(output).__name__}, "
                                f"not (logits, weights, expert ids)")
            engine._record(layer, output[2])
        return hook

    for layer, router in enumerate(routers):
        handles.append(router.register_forward_hook(hook_for(layer)))


def _check_tags(tags: Sequence[str]) -> None:
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; choose from {list(MEMORY_TAGS)}")


def _from_settings(settings: EngineSettings) -> EmbeddedEngine:
    return EmbeddedEngine(settings.model_dir, dtype=torch.float32, seed=settings.seed,
                          pad_token_id=settings.pad_token_id, routing=settings.routing)


register_engine("embedded", _from_settings)
