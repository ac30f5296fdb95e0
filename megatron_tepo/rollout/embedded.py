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

Left out: serving several processes (it lives in the driver's), and sampling beyond temperature
and top-p.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch

from megatron_tepo.rollout.engine import (FINISH_LENGTH, FINISH_STOP, MEMORY_TAGS, Group, RolloutEngine, Sample,
                                          gathered_tensors, make_params, validate_prompts)
from megatron_tepo.rollout.registry import EngineSettings, register_engine


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


class EmbeddedEngine(RolloutEngine):
    """In-process engine around a ``transformers`` causal LM (HF parameter names)."""

    def __init__(self, model: Union[torch.nn.Module, str], *, seed: int = 0,
                 dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu",
                 max_batch_size: int = 64, pad_token_id: int = 0):
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or torch.float32)
        elif dtype is not None:
            model = model.to(dtype)
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._released: set = set()  # colocated mode: the memory tags released
        self._weights_stale = False  # weights taken back, not yet updated: nothing to generate with

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: List[List[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 128,
                 stop_token_ids: Sequence[int] = ()) -> List[Group]:
        sp = make_params(n, temperature, top_p, max_new_tokens, stop_token_ids)
        validate_prompts(prompts, self.vocab_size)
        if self._released or self._weights_stale:
            what = f"its {', '.join(sorted(self._released))} released" if self._released else \
                "its weights taken back but not updated yet"
            raise RuntimeError(f"EmbeddedEngine.generate: {what} (colocated mode: resume the memory, then "
                               f"update the weights, before generating)")
        rows = [list(p) for p in prompts for _ in range(sp.n)]
        samples: List[Sample] = []
        for start in range(0, len(rows), self.max_batch_size):
            samples.extend(self._generate_rows(rows[start:start + self.max_batch_size], sp))
        return [samples[i * sp.n:(i + 1) * sp.n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_rows(self, rows: List[List[int]], sp) -> List[Sample]:
        b, width = len(rows), max(len(r) for r in rows)
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
        cache, step_ids = None, ids
        for _ in range(sp.max_new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                             past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logp = sampling_log_probs(out.logits[:, -1], sp.temperature, sp.top_p)
            tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(1)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(1)
            tok = tok.masked_fill(done, self.pad_token_id)
            out_tok = torch.cat([out_tok, tok[:, None]], 1)
            out_lp = torch.cat([out_lp, tok_lp[:, None]], 1)
            active = ~done
            if stop.numel():
                hit = torch.isin(tok, stop) & active
                stopped |= hit
                done |= hit
            step_ids = tok[:, None]
            mask = torch.cat([mask, active.long()[:, None]], 1)
            if bool(done.all()):
                break
        samples = []
        for i in range(b):
            toks, lps = out_tok[i].tolist(), out_lp[i].tolist()
            if bool(stopped[i]):
                k = next(j for j, t in enumerate(toks) if t in sp.stop_token_ids) + 1
                samples.append(Sample(toks[:k], lps[:k], FINISH_STOP))
            else:
                samples.append(Sample(toks, lps, FINISH_LENGTH))
        return samples

    @torch.no_grad()
    def score(self, sequences: List[List[int]], prompt_lens: List[int],
              temperature: float = 1.0) -> List[List[float]]:
        result = []
        for seq, pl in zip(sequences, prompt_lens):
            ids = torch.tensor([seq], device=self.device)
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
        seen = set()
        for name, tensor in gathered_tensors(named_tensors):
            seen.add(name)
            param = self._params.get(name)
            if param is None:
                raise KeyError(f"EmbeddedEngine.update_weights: unknown parameter {name!r} "
                               f"(the model has {len(self._params)} named parameters)")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
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
        self.model = None
        self._params = {}


def _check_tags(tags: Sequence[str]) -> None:
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; choose from {list(MEMORY_TAGS)}")


def _from_settings(settings: EngineSettings) -> EmbeddedEngine:
    return EmbeddedEngine(settings.model_dir, dtype=torch.float32, seed=settings.seed,
                          pad_token_id=settings.pad_token_id)


register_engine("embedded", _from_settings)
