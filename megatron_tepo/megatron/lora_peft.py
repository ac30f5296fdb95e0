"""The actor's LoRA adapters (:mod:`.lora`) in PEFT's format: names, the adapter folder, and back.

A PEFT LoRA adapter names one ``lora_A`` ``[r, in]`` / ``lora_B`` ``[out, r]`` pair per HF linear
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``) with ``scaling = lora_alpha /
r``, as :mod:`.lora` does per megatron linear. The fused linears map through the family's own name
table and splits (:func:`~megatron_tepo.models.converters.convert_megatron_to_hf` and
:func:`~megatron_tepo.models.converters.fuse_group`, the weights' very functions): ``linear_qkv``'s
one adapter is q/k/v adapters sharing its A, with B's rows split the way the weight's rows are
(megatron's per-query-group interleaving, gated attention's gates included); ``linear_fc1`` is
``gate_proj`` / ``up_proj`` likewise; ``linear_proj`` / ``linear_fc2`` are ``o_proj`` /
``down_proj`` one to one.

* :func:`megatron_to_peft` / :func:`peft_to_megatron` -- full tensors, global names, both ways.
* :func:`write_peft_adapter` -- an adapter folder (``adapter_config.json``,
  ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the HF base.
* :func:`export_peft_adapter` -- a live model's adapters as that folder (the end-of-run export,
  beside the merged HF model); :func:`gather_peft_adapters` -- the same tensors in memory on one
  rank (:class:`PeftAdapters`, what the ``adapters`` weight sync sends).
* :func:`read_peft_adapter` -- such a folder as megatron full tensors, checked against
  ``actor.lora`` (rank, alpha, targets); :func:`load_peft_adapter_into` -- into a built model's
  adapters, each rank its shard (``actor.lora.init_from``).

An adapter whose q/k/v (or gate/up) ``lora_A`` differ is not one adapter of rank r on the fused
linear: it would be one of rank 3r (2r) in block form, which this run's ``actor.lora.rank`` and
checkpoints do not describe; it is refused with a one-line error naming ``actor.lora.init_from``.

Left out: PEFT's other variants (rsLoRA, DoRA, per-module ranks or alphas: refused), adapters on
modules the actor does not adapt (embeddings, ``lm_head``, experts: refused), bias adapters.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_tepo.megatron.lora import LoraError

__all__ = ["PEFT_PREFIX", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "megatron_to_peft", "peft_to_megatron",
           "peft_target_modules", "peft_adapter_config", "write_peft_adapter", "read_peft_adapter",
           "load_peft_adapter_into", "export_peft_adapter", "gather_peft_adapters", "PeftAdapters"]

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_MG_ADAPTER = re.compile(r"^(decoder\.layers\.\d+\..+)\.lora_([AB])$")
_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight$")


def _tables(family_cfg):
    from megatron_tepo.models import layer_mapping

    return layer_mapping(family_cfg)


def _hf_modules(family_cfg, mapping, layer: int, suffix: str):
    """HF weight suffixes (``self_attn.q_proj.weight`` ...) of megatron weight ``suffix`` of ``layer``
    and its fused group (None for a one-to-one rename); ``([], None)`` when the HF model lacks it."""
    table = mapping.for_layer(layer)
    for g in table.fused:
        if g.megatron == suffix:
            return list(g.hf), g
    for hf, mg in table.renames.items():
        if mg == suffix:
            return [hf], None
    return [], None


def _peft_name(hf_weight: str, which: str) -> str:
    return f"{PEFT_PREFIX}{hf_weight[:-len('.weight')]}.lora_{which}.weight"


def megatron_to_peft(adapters: Iterable[Tuple[str, torch.Tensor]], family_cfg,
                     naming=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Megatron adapters (``(decoder.layers.N.<linear>.lora_A|B, full tensor)``, as
    :func:`~megatron_tepo.megatron.lora.adapter_full_tensors` gives them) -> PEFT ``(name, tensor)``:
    a fused linear's B split by rows like its weight, its A repeated for each part. ``naming``: a
    :class:`~megatron_tepo.models.names.CheckpointNaming` whose stored names PEFT's module paths
    follow (a multimodal checkpoint's text model under its prefix); None: the plain causal LM's."""
    from megatron_tepo.models.converters import convert_megatron_to_hf

    mapping = _tables(family_cfg)
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in adapters:
        m = _MG_ADAPTER.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not a LoRA adapter of a decoder layer's linear")
        pair = pending.setdefault(m.group(1), {})
        pair[m.group(2)] = tensor
        if len(pair) < 2:
            continue
        del pending[m.group(1)]
        weight = f"{m.group(1)}.weight"
        parts = list(convert_megatron_to_hf([(weight, pair["B"])], family_cfg, mapping))
        for hf, b in parts:
            hf = naming.stored_name(hf) if naming is not None else hf
            yield _peft_name(hf, "A"), pair["A"].contiguous()
            yield _peft_name(hf, "B"), b.contiguous()
    if pending:
        raise ValueError(f"LoRA adapters without their other half: {sorted(pending)[:4]}")


def peft_target_modules(family_cfg, targets: Iterable[str]) -> List[str]:
    """PEFT's ``target_modules`` (HF module names: ``q_proj`` ...) of megatron targets ``targets``,
    in :data:`~megatron_tepo.config.schema.LORA_TARGETS`' order."""
    from megatron_tepo.config.schema import LORA_TARGETS

    mapping = _tables(family_cfg)
    found: Dict[str, List[str]] = {}
    for layer in range(family_cfg.num_layers):
        table = mapping.for_layer(layer)
        for hf, mg in [*((h, m) for h, m in table.renames.items()), *((h, g.megatron) for g in table.fused for h in g.hf)]:
            if not (hf.endswith(".weight") and mg.endswith(".weight")):
                continue
            linear, module = mg.rsplit(".", 2)[-2], hf.rsplit(".", 2)[-2]
            if linear in targets and module not in found.setdefault(linear, []):
                found[linear].append(module)
    return [m for t in LORA_TARGETS for m in found.get(t, [])]


def peft_adapter_config(lora, family_cfg, base_model: str) -> dict:
    """PEFT's ``adapter_config.json`` of ``lora`` (:class:`~megatron_tepo.config.LoraConfig`)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
            "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": float(lora.dropout),
            "target_modules": peft_target_modules(family_cfg, lora.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None}


def write_peft_adapter(directory, tensors: Iterable[Tuple[str, torch.Tensor]], lora, family_cfg,
                       base_model: str) -> Path:
    """Write a PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``
    (``tensors``: PEFT names, :func:`megatron_to_peft`'s). Returns the folder."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().cpu().clone().contiguous() for n, t in tensors}  # (a shared A: one copy each, as PEFT keeps it)
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(lora, family_cfg, base_model), indent=2))
    return directory


def peft_to_megatron(tensors: Dict[str, torch.Tensor], family_cfg, lora,
                     where: str = "actor.lora.init_from") -> Iterator[Tuple[str, torch.Tensor]]:
    """PEFT ``{name: tensor}`` -> megatron ``(decoder.layers.N.<linear>.lora_A|B, full tensor)`` for
    every target linear of ``lora`` (every layer of the model): a fused linear's B made from its
    parts' B's (the weights' fuse), its A the parts' common A. Raises :class:`LoraError` (naming
    ``where``) for a missing or unknown adapter, a rank other than ``lora.rank``, and parts whose A
    differ."""
    from megatron_tepo.models.converters import fuse_group

    mapping = _tables(family_cfg)
    by_module: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _PEFT_NAME.match(name)
        if m is None:
            raise LoraError(f"{where}: {name!r} is not a PEFT LoRA tensor (…lora_A.weight / …lora_B.weight)")
        by_module.setdefault(m.group(1), {})[m.group(2)] = t
    used = set()
    for layer in range(family_cfg.num_layers):
        table = mapping.for_layer(layer)
        weights = [*table.renames.values(), *(g.megatron for g in table.fused)]
        for suffix in weights:
            linear = suffix.rsplit(".", 2)[-2] if suffix.endswith(".weight") else None
            if linear not in lora.target_modules:
                continue
            hf_weights, group = _hf_modules(family_cfg, mapping, layer, suffix)
            mods = [f"model.layers.{layer}.{h[:-len('.weight')]}" for h in hf_weights]
            pairs = []
            for mod in mods:
                pair = by_module.get(mod) or by_module.get(_text_alias(mod, by_module))
                if pair is None or set(pair) != {"A", "B"}:
                    raise LoraError(f"{where}: the adapter has no lora_A / lora_B for {mod} (actor.lora.target_modules "
                                    f"{sorted(lora.target_modules)} adapts it)")
                used.add(mod if mod in by_module else _text_alias(mod, by_module))
                pairs.append(pair)
            a = pairs[0]["A"]
            if a.shape[0] != lora.rank:
                raise LoraError(f"{where}: {mods[0]}'s lora_A has rank {a.shape[0]}, actor.lora.rank is {lora.rank}")
            if any(not torch.equal(p["A"], a) for p in pairs[1:]):
                raise LoraError(f"{where}: {', '.join(m.rsplit('.', 1)[-1] for m in mods)} of layer {layer} have different "
                                f"lora_A; the fused {linear} holds one A of rank {lora.rank} (block form of rank "
                                f"{len(mods) * lora.rank} not loaded)")
            b = pairs[0]["B"] if group is None else fuse_group(group, [p["B"] for p in pairs], family_cfg)
            base = f"decoder.layers.{layer}.{suffix[:-len('.weight')]}"
            yield f"{base}.lora_A", a
            yield f"{base}.lora_B", b
    unused = sorted(set(by_module) - used)
    if unused:
        raise LoraError(f"{where}: adapters on modules the actor does not adapt (actor.lora.target_modules "
                        f"{sorted(lora.target_modules)}): {unused[:4]}")


def _text_alias(mod: str, by_module: Dict[str, dict]) -> Optional[str]:
    """A multimodal checkpoint's name of text module ``mod`` (``model.language_model.layers...``)."""
    alias = "model.language_model." + mod[len("model."):]
    return alias if alias in by_module else None


def read_peft_adapter(directory, family_cfg, lora, where: str = "actor.lora.init_from") -> Dict[str, torch.Tensor]:
    """A PEFT adapter folder as megatron full tensors, its config checked against ``lora``: PEFT's
    ``r`` and ``lora_alpha`` (the scale ``alpha / r``) must be ``actor.lora``'s, no rsLoRA / DoRA /
    per-module ranks. Raises :class:`LoraError` naming ``where`` and the file."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise LoraError(f"{where}: {p} is missing (a PEFT adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: {cfg_path}: peft_type {cfg.get('peft_type')!r}, not LORA")
    for key in ("use_rslora", "use_dora"):
        if cfg.get(key):
            raise LoraError(f"{where}: {cfg_path}: {key} is set; only plain LoRA (scale lora_alpha / r) is built")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoraError(f"{where}: {cfg_path}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not built")
    if int(cfg.get("r", -1)) != lora.rank:
        raise LoraError(f"{where}: {cfg_path}: r is {cfg.get('r')}, actor.lora.rank is {lora.rank}")
    if float(cfg.get("lora_alpha", -1)) != float(lora.alpha):
        raise LoraError(f"{where}: {cfg_path}: lora_alpha is {cfg.get('lora_alpha')}, actor.lora.alpha is {lora.alpha}")
    return dict(peft_to_megatron(load_file(str(weights_path)), family_cfg, lora, where=f"{where}: {weights_path}"))


def load_peft_adapter_into(model_chunks: List[torch.nn.Module], directory, family_cfg, lora, tp_group=None) -> int:
    """Copy a PEFT adapter folder's adapters into this rank's shards of ``model_chunks``' adapters
    (every adapter of the stage filled, checked); returns how many were filled."""
    from megatron_tepo.megatron.lora import is_adapter
    from megatron_tepo.megatron.sharding import _local_shard, global_named_parameters, group_for, parallel_groups

    full = read_peft_adapter(directory, family_cfg, lora)
    filled = 0
    groups = parallel_groups(tp_group)
    for chunk in model_chunks:
        for gname, param in global_named_parameters(chunk):
            if not is_adapter(param):
                continue
            if gname not in full:
                raise LoraError(f"actor.lora.init_from: {directory} has no adapter for {gname}")
            local = _local_shard(full[gname], param, group_for(param, groups))
            if local.shape != param.shape:
                raise LoraError(f"actor.lora.init_from: {gname}: the adapter's {tuple(full[gname].shape)} gives "
                                f"{tuple(local.shape)} here, the parameter is {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(local.to(param.dtype))
            filled += 1
    return filled


class PeftAdapters(list):
    """``(PEFT name, tensor)`` of every adapter of the model, with PEFT's ``config``
    (``adapter_config.json``'s dict): what the ``adapters`` weight sync sends
    (``rollout/sglang/weight_sync/lora.py``). Empty on every rank but the one it was gathered to."""

    def __init__(self, tensors=(), config: Optional[dict] = None):
        super().__init__(tensors)
        self.config = config


def gather_peft_adapters(model_chunks: List[torch.nn.Module], family_cfg, lora, base_model: str = "",
                         naming=None, tp_group=None, dst: int = 0) -> PeftAdapters:
    """Collective over every rank: the model's adapters in PEFT's names on global rank ``dst``
    (each pipeline stage's gathered over TP, then every stage's to ``dst``: a few MB at rank 32),
    an empty :class:`PeftAdapters` (with the config) elsewhere."""
    import torch.distributed as dist

    from megatron_tepo.megatron.lora import adapter_full_tensors

    config = peft_adapter_config(lora, family_cfg, base_model)
    stage = [(n, t.detach().cpu()) for n, t in adapter_full_tensors(model_chunks, "param", tp_group=tp_group)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        # one copy of each adapter travels: from its first (expert-)TP rank of its first (expert-)data-parallel
        # replica (an MoE expert's from the EP rank that holds it)
        dist.gather_object([(n, t) for n, t in stage if _sends(n)], every, dst=dst)
        if dist.get_rank() != dst:
            return PeftAdapters((), config)
        merged: Dict[str, torch.Tensor] = {}
        for part in every:
            for n, t in part:
                merged.setdefault(n, t)  # (TP / DP replicas: the same tensors)
        stage = sorted(merged.items(), key=lambda kv: _layer_key(kv[0]))
    return PeftAdapters(megatron_to_peft(stage, family_cfg, naming=naming), config)


def export_peft_adapter(model_chunks: List[torch.nn.Module], family_cfg, lora, directory, base_model: str,
                        naming=None, tp_group=None) -> Optional[Path]:
    """Collective over every rank: the model's adapters as a PEFT adapter folder written by global
    rank 0 (:func:`gather_peft_adapters`). Returns the folder on rank 0, None elsewhere."""
    import torch.distributed as dist

    adapters = gather_peft_adapters(model_chunks, family_cfg, lora, base_model, naming=naming, tp_group=tp_group)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return write_peft_adapter(directory, adapters, lora, family_cfg, base_model)


def _sends(name: str) -> bool:
    """Whether this rank sends its stage's adapter ``name`` (a global name): a dense one from TP rank 0
    of data-parallel (and context-parallel) rank 0; an MoE expert's (``...mlp.experts.local_experts...``,
    held by one EP rank, whose ranks are part of the data-parallel group) from expert-TP rank 0 of
    expert-data-parallel rank 0; every rank without megatron's groups."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    if ".mlp.experts.local_experts." in name:
        return ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


def _layer_key(name: str):
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    return (int(m.group(1)), m.group(2)) if m else (-1, name)
