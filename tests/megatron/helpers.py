"""Tiny Hugging Face models, random rollout batches and the single-process HF reference.

The reference is the plain transformers model (eager attention, fp32) with the SAME weights as
the Megatron actor: log-probs/entropy from ``log_softmax`` of its logits, the loss from
``compute_policy_loss`` over the whole mini-batch at once, gradients by autograd, and one step of
``torch.optim.AdamW`` (weight decay only on >=2-D weights, like megatron) after
``clip_grad_norm_``.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import torch

from megatron_tepo.batch import RolloutBatch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_hf_config(family: str, tie: bool = False, **overrides):
    import transformers

    kw = dict(TINY, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if family == "qwen3":
        kw.update(head_dim=32, rope_theta=1e6)  # head_dim != hidden / heads on purpose
        cls = transformers.Qwen3Config
    elif family == "qwen2":
        kw.update(rope_theta=1e6)
        cls = transformers.Qwen2Config
    elif family == "qwen3_moe":
        kw.update(head_dim=32, rope_theta=1e6, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[])
        cls = transformers.Qwen3MoeConfig
    elif family == "llama":
        kw.update(rope_theta=5e5)
        cls = transformers.LlamaConfig
    elif family in ("qwen3_5", "qwen3_5_moe"):
        # 3 Gated DeltaNet layers + 1 gated attention layer; head_dim != hidden / heads, RoPE on a
        # quarter of each head, 2 key heads for 4 value heads in the Gated DeltaNet
        kw.update(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4)
        cls = transformers.Qwen3_5TextConfig
        if family == "qwen3_5_moe":
            kw.pop("intermediate_size")
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
            cls = transformers.Qwen3_5MoeTextConfig
    else:
        raise ValueError(family)
    kw.update(overrides)
    cfg = cls(**kw)
    cfg.architectures = [cls.__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    return cfg


#: a tiny vision tower for a Qwen3.5 ``*ForConditionalGeneration`` (its ``out_hidden_size``: the text model's hidden size)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TINY["hidden_size"],
                   patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)


def conditional_generation_config(family: str, **overrides):
    """A published-style Qwen3.5 config (``Qwen3_5ForConditionalGeneration`` / the MoE one): the tiny
    text model of :func:`tiny_hf_config` under ``text_config`` beside :data:`TINY_VISION`."""
    import transformers

    text = tiny_hf_config(family, **overrides)
    cls = transformers.Qwen3_5Config if family == "qwen3_5" else transformers.Qwen3_5MoeConfig
    cfg = cls(text_config=text.to_dict(), vision_config=dict(TINY_VISION), tie_word_embeddings=False)
    cfg.architectures = [cls.__name__.replace("Config", "ForConditionalGeneration")]
    return cfg


def adapted_linears(family_cfg) -> Dict[str, Tuple[int, int]]:
    """``{decoder.layers.N.<linear>: (out, in)}`` of the four dense targets of LoRA (fused q/k/v, o,
    fused gate/up, down) in every layer of a dense ``family_cfg``: the weights' shapes, whose
    adapters are ``lora_A [r, in]`` and ``lora_B [out, r]``."""
    c = family_cfg
    h, q, kv, ffn = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim, c.ffn_hidden_size
    shapes = {"self_attention.linear_qkv": (q + 2 * kv, h), "self_attention.linear_proj": (h, q),
              "mlp.linear_fc1": (2 * ffn, h), "mlp.linear_fc2": (h, ffn)}
    return {f"decoder.layers.{layer}.{lin}": shape for layer in range(c.num_layers) for lin, shape in shapes.items()}


def make_hf_model(hf_config, seed: int = 0):
    """Random init with randomised norm weights and biases (so a wrong mapping shows): a norm's
    weight around its init (1, or 0 for the zero-centred norms of Qwen3.5, which scale by 1 + w).
    A conditional-generation config (a ``text_config``) gives its ``*ForConditionalGeneration``."""
    import transformers

    torch.manual_seed(seed)
    if getattr(hf_config, "text_config", None) is not None and hf_config.architectures:
        model = getattr(transformers, hf_config.architectures[0])._from_config(
            hf_config, attn_implementation="eager", dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager",
                                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # around the init: 1, or 0 for a zero-centred norm (1 + w)
                p.copy_((0.0 if bool((p == 0).all()) else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.float()


def checkpoint_names(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers>=5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]); checkpoints (and the mapping) use one tensor per expert."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def stacked_experts(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`checkpoint_names`, by hand: each layer's ``mlp.experts.{e}.gate_proj`` /
    ``up_proj`` / ``down_proj.weight`` -> ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's
    gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, no ``.weight``: the
    published Qwen3.5-MoE checkpoints' layout (and transformers' in memory); other tensors as given."""
    import re

    expert = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out, groups = {}, {}
    for name, t in tensors.items():
        m = expert.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for head, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[head + "gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                                  for e in range(n)])
        out[head + "down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    return out


def hf_state(model) -> Dict[str, torch.Tensor]:
    """The model's tensors as a checkpoint holds them (tied lm_head dropped)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return checkpoint_names(state)


def hf_param_names(model) -> list:
    return sorted(checkpoint_names({n: p.detach() for n, p in model.named_parameters()}))


def make_batch(seed: int, batch_size: int = 8, vocab: int = 256, max_prompt: int = 10,
               max_resp: int = 14, train: bool = True) -> RolloutBatch:
    """Variable prompt lengths (1..max_prompt), variable responses (some with holes, one empty)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, max_prompt + 1, (batch_size,), generator=g)
    resp_lens = torch.randint(1, max_resp + 1, (batch_size,), generator=g)
    resp_lens[-1] = 0  # one empty response
    length = int((prompt_lens + resp_lens).max())
    input_ids = torch.randint(0, vocab, (batch_size, length), generator=g)
    mask = torch.zeros(batch_size, max_resp)
    for i in range(batch_size):
        mask[i, : resp_lens[i]] = 1
        input_ids[i, prompt_lens[i] + resp_lens[i]:] = 0  # right padding
    mask[0, 1] = 0  # a hole inside a response
    batch = RolloutBatch(input_ids=input_ids, prompt_lens=prompt_lens, response_mask=mask)
    if train:
        # mixed signs, but not mean-zero: a near-zero loss would make its relative error meaningless
        batch.advantages = (torch.randn(batch_size, max_resp, generator=g) + 1.0) * mask
        batch.old_entropy = torch.rand(batch_size, max_resp, generator=g) * mask
    return batch


def update_batch(seed: int) -> RolloutBatch:
    """:func:`make_batch` with old log-probs (a loss's ratio needs them): one update's batch."""
    b = make_batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    b.old_log_probs = (-2.0 - torch.rand(b.response_mask.shape, generator=g)) * b.response_mask
    return b


# the layouts a test of the actor's state covers: TP=2 in fp32 and bf16, and the distributed optimizer
STATE_CASES = [{"tp": 2, "precision": "fp32"}, {"tp": 2, "precision": "bf16"},
               {"tp": 1, "precision": "bf16", "dist_opt": True}]


def state_case_actor(spec: dict, hf_config, hf_model):
    """A MegatronActor of ``hf_model``'s weights in the layout of one of :data:`STATE_CASES`
    (Adam, lr 1e-3, gradients clipped at 1, SDPA attention); call it on every rank."""
    from megatron_tepo.actor import MegatronActor
    from megatron_tepo.config import OptimConfig
    from megatron_tepo.layout import ParallelLayout

    return MegatronActor(hf_config, hf_state(hf_model), layout=ParallelLayout(tp=spec["tp"]),
                         optim=OptimConfig(lr=1e-3, clip_grad=1.0, use_distributed_optimizer=spec.get("dist_opt", False)),
                         precision=spec["precision"], attention="sdpa")


def hf_log_probs(model, batch: RolloutBatch, temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference per-response-token log-probs and entropy (0 on padding), differentiable."""
    logits = model(input_ids=batch.input_ids).logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    b, s = batch.input_ids.shape
    r = batch.response_len
    target = batch.prompt_lens[:, None] + torch.arange(r)[None]
    valid = (target < s) & (batch.response_mask != 0)
    target = target.clamp(max=s - 1)
    rows = torch.arange(b)[:, None]
    lp_rows = logp_all[rows, target - 1]  # [b, r, V]
    labels = batch.input_ids.gather(1, target)
    lp = lp_rows.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(lp_rows.exp() * lp_rows).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def hf_reference_step(model, batch: RolloutBatch, loss_cfg: dict, lr: float, betas, eps: float,
                      weight_decay: float, clip_grad: float):
    """(loss, metrics, grads by HF name, params after one AdamW step by HF name)."""
    from megatron_tepo.algorithms import compute_policy_loss

    cfg = dict(loss_cfg)
    name = cfg.pop("name")
    model.zero_grad(set_to_none=True)
    lp, ent = hf_log_probs(model, batch, batch.temperature)

    def f64(t):  # the loss arithmetic in fp64, so the reference adds no rounding of its own
        return None if t is None else t.double()

    loss, metrics = compute_policy_loss(name, f64(lp), f64(batch.old_log_probs), f64(batch.advantages),
                                        batch.response_mask, entropy=f64(ent),
                                        old_entropy=f64(batch.old_entropy),
                                        ref_log_prob=f64(batch.ref_log_probs), **cfg)
    loss.backward()
    grads = checkpoint_names({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    params = [p for p in model.parameters()]
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
    if clip_grad > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip_grad))
    else:
        grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    opt.step()
    after = checkpoint_names({n: p.detach().clone() for n, p in model.named_parameters()})
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, grads, after, grad_norm


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = float(ref.abs().max())
    return float((got - ref).abs().max()) / max(scale, 1e-30)


# ------------------------------------------------------------------ the asynchronous saves' writers
#: the writers of the asynchronous checkpoint saves (megatron_tepo/megatron/async_save.py:choose_async_writer),
#: each forced by MTEPO_ASYNC_WRITER in the tests that run both
ASYNC_WRITERS = ("mcore", "nvrx")


#: a folder holding nvidia-resiliency-ext's code where pip cannot install it (tools/test.sh unpacks
#: the PyPI wheel there: its wheels >= 0.5 are tagged for glibc >= 2.39, and the asynchronous
#: checkpoint code megatron-core calls is pure Python); only the tests of NVRx's writer put it on
#: their subprocesses' path, so every other test sees the stack as it installs
NVRX_PATH = os.environ.get("MTEPO_NVRX_PATH", "")


def _unpacked_nvrx_version():
    import glob

    found = sorted(glob.glob(os.path.join(NVRX_PATH, "nvidia_resiliency_ext-*.dist-info"))) if NVRX_PATH else []
    return os.path.basename(found[-1])[len("nvidia_resiliency_ext-"):-len(".dist-info")] if found else None


def writer_env(writer: str) -> dict:
    """The environment a subprocess of the tests of ``writer`` needs beyond the tests' own: the
    writer forced (``MTEPO_ASYNC_WRITER``), and for NVRx's its unpacked code on the path where it
    is not installed (:data:`NVRX_PATH`)."""
    env = {"MTEPO_ASYNC_WRITER": writer}
    if writer == "nvrx" and _unpacked_nvrx_version() and not _installed_nvrx_version():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (NVRX_PATH, os.environ.get("PYTHONPATH", "")) if p)
    return env


def _installed_nvrx_version():
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return None


def async_writer_missing(writer: str):
    """Why ``writer`` cannot run on this stack (None when it can), from the installed packages'
    versions, without importing megatron-core: NVRx's needs megatron-core >= 0.19 (``async_strategy``)
    and nvidia-resiliency-ext >= 0.6 (megatron-core's minimum), installed or unpacked in
    ``$MTEPO_NVRX_PATH`` (:data:`NVRX_PATH`)."""
    import importlib.metadata

    from packaging.version import Version

    if writer == "mcore":
        return None
    mcore = Version(importlib.metadata.version("megatron-core"))
    if mcore < Version("0.19"):
        return f"megatron-core {mcore} has no async_strategy: only its own writer"
    version = _installed_nvrx_version() or _unpacked_nvrx_version()
    if version is None:
        return ("nvidia-resiliency-ext is neither installed (its wheels >= 0.5 need glibc >= 2.39: "
                "docs/FAULT_TOLERANCE.md) nor unpacked in $MTEPO_NVRX_PATH (tools/test.sh does that)")
    nvrx = Version(version)
    return None if nvrx >= Version("0.6") else f"nvidia-resiliency-ext {nvrx} < 0.6, megatron-core's minimum"
