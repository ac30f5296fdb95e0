"""A launch file, read (:func:`load_launch` -> :class:`LaunchSpec`) and handed on: the run config
the trainer is started with (:func:`write_run_config`), the serve command of every rollout server
(:func:`serve_args`: the one place where the launch file's server options become the serve
command's options) and the ``FIT_*`` shell variables of slurm/lib.sh (:func:`shell_vars`,
:func:`render_shell`).

A launch file (``examples/models/<model>.yaml``) holds the model's HF ``config.json`` numbers
(``architecture``, or a path to one; a ``config.json`` in ``model.path`` wins), the placement and
the rollout servers (``launch``: :mod:`megatron_tepo.launch.schema`) and a
:class:`~megatron_tepo.config.RunConfig` fragment (everything else, ``_base_`` naming the method
file), which is typed and validated by the run config's own loader, errors naming the key and its
line in the launch file. docs/LAUNCH.md says how the Slurm scripts and the nemo-run launcher use
it. A colocated launch (``launch.rollout.placement: colocated``) makes the run colocated
(``rollout.colocated: true``; a run config that says otherwise is an error naming both) and, on
cuda, takes the fit check's offload level (``actor.offload``), the servers' ``mem_fraction_static``
and SGLang's memory saver (:func:`megatron_tepo.launch.fit.settle_colocated`). Left out: the memory
arithmetic and the fit check (:mod:`megatron_tepo.launch.fit`), the order of the job's steps
(:mod:`megatron_tepo.launch.sequence`)."""
from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml

from megatron_tepo.config import ConfigError, RunConfig, apply_overrides, from_file_data, load_config, read_yaml_file
from megatron_tepo.launch.engines import SERVED_ENGINES, served_engine
from megatron_tepo.launch.fit import settle_colocated
from megatron_tepo.launch.schema import LaunchLayout, read_layout
from megatron_tepo.launch.sequence import RELEASE_TAGS, job_steps
from megatron_tepo.launch.shape import ModelShape, model_shape
from megatron_tepo.rollout.sglang.options import server_env

__all__ = ["LaunchSpec", "load_launch", "write_run_config", "SERVE_MODULE", "serve_args", "shell_vars",
           "render_shell"]

LAUNCH_KEYS = ("architecture", "launch")
#: the SGLang serve command (one server in the foreground), run with the project's python on the nodes
SERVE_MODULE = SERVED_ENGINES["sglang"].serve_module


@dataclass
class LaunchSpec:
    path: Path
    launch: LaunchLayout
    cfg: RunConfig
    run_data: Dict[str, Any]  # the RunConfig fragment, ``_base_`` made absolute
    architecture: Dict[str, Any]
    architecture_source: str

    def shape(self) -> ModelShape:
        return model_shape(self.architecture)


def _split_overrides(overrides: Sequence[str]) -> Tuple[List[str], List[str]]:
    launch, run = [], []
    for item in overrides:
        (launch if item.split("=", 1)[0].strip().split(".")[0] in LAUNCH_KEYS else run).append(item)
    return launch, run


def load_launch(path: Union[str, Path], overrides: Sequence[str] = (),
                hf_config: Optional[Union[str, Path]] = None) -> LaunchSpec:
    """Read a launch file; ``overrides`` are dotted ``KEY=VALUE`` (``launch.actor_nodes=4``,
    ``parallel.tp=8``, ``model.path=/models/x``); ``hf_config`` a ``config.json`` that wins."""
    path = Path(path).resolve()
    where: Dict[str, str] = {}  # dotted key -> "file:line" or "override '...'", for the errors
    data = read_yaml_file(path, where) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    launch_ov, run_ov = _split_overrides(overrides)
    data = apply_overrides(data, launch_ov, where)
    arch = data.pop("architecture", None)
    launch = read_layout(data.pop("launch", None) or {}, where)
    bases = data.pop("_base_", None)
    data = apply_overrides(data, run_ov, where)
    data = _colocate(data, launch, where)
    try:
        cfg = from_file_data(path, data if bases is None else {"_base_": bases, **data}, where)
    except ConfigError as exc:
        if launch.colocated and str(exc).startswith("rollout.max_staleness: one-step-off"):  # (validation's rule)
            raise ConfigError(_contradiction("rollout.max_staleness", "1 (one-step-off generation: the servers "
                                             "generate while the actor trains)", launch, where)
                              + ": set rollout.max_staleness: 0") from None
        if launch.colocated and str(exc).startswith("rollout.partial_rollout: the engine generates"):
            raise ConfigError(_contradiction("rollout.partial_rollout", "true (partial rollout: the servers "
                                             "generate while the actor trains)", launch, where)
                              + ": set rollout.partial_rollout: false") from None
        raise
    served = cfg.rollout.engine
    if served in SERVED_ENGINES and served != launch.rollout.engine:
        raise ConfigError(f"rollout.engine: {served}, but {launch.rollout.key} serves {launch.rollout.engine}: "
                          f"the launcher starts the servers the trainer attaches to; name one engine")
    if launch.colocated and launch.device == "cuda" and served == launch.rollout.engine \
            and cfg.rollout.sync_mode == "distributed":
        raise ConfigError(_contradiction("rollout.sync_mode", "distributed (an NCCL group of the trainer's rank 0 and "
                                         "every server's ranks, two of them on GPU 0, which NCCL refuses)", launch,
                                         where) + ": set rollout.sync_mode: ipc (or tensor)")
    lora = cfg.actor.lora
    if lora is not None and lora.sync == "adapters" and served == launch.rollout.engine \
            and not (launch.shares_actor_nodes and launch.actor_nodes == 1):
        raise ConfigError(f"actor.lora.sync: adapters hands the adapters to the servers in the trainer's shared "
                          f"memory, which servers on other nodes cannot read ({launch.actor_nodes} actor node(s), "
                          f"launch.rollout_nodes: {launch.rollout_nodes}): use sync: merged, or one node")
    if cfg.rollout.colocated and not launch.colocated and served == launch.rollout.engine:
        raise ConfigError(f"rollout.colocated ({where.get('rollout.colocated', 'set')}): true, but "
                          f"{launch.rollout.key}.placement is separate (the servers on their own GPUs, no turns): "
                          f"set {launch.rollout.key}.placement: colocated, or rollout.colocated: false")
    bases = [bases] if isinstance(bases, str) else bases or []
    run_data = {"_base_": [str((path.parent / b).resolve()) for b in bases], **data} if bases else data
    source = ""
    if hf_config is not None:
        arch, source = str(hf_config), str(hf_config)
    elif cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        arch = source = str(Path(cfg.model.path) / "config.json")
    elif isinstance(arch, str):
        arch = source = str((path.parent / arch).resolve())
    elif isinstance(arch, dict):
        source = f"{path} (architecture)"
    else:
        raise ConfigError(f"{path}: no architecture: give an 'architecture' mapping (HF config.json "
                          f"numbers) or path, a model.path holding config.json, or --hf-config")
    if isinstance(arch, str):
        try:
            arch = json.loads(Path(arch).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read HF config {source}: {exc}") from None
    spec = LaunchSpec(path, launch, cfg, run_data, arch, source)
    if launch.colocated and served == launch.rollout.engine:
        settle_colocated(spec.shape(), cfg, launch)  # the offload level, mem_fraction_static, memory saver
        if launch.device == "cuda":
            run_data["actor"] = {**(run_data.get("actor") or {}), "offload": cfg.actor.offload}
    return spec


def _contradiction(key: str, value: str, launch: LaunchLayout, where: Dict[str, str]) -> str:
    placement = f"{launch.rollout.key}.placement"
    return (f"{key} ({where.get(key, 'set')}): {value} contradicts {placement}: colocated "
            f"({where.get(placement, 'set')}: the servers and the actor take turns with the GPUs)")


def _colocate(data: Dict[str, Any], launch: LaunchLayout, where: Dict[str, str]) -> Dict[str, Any]:
    """The run config part of a colocated launch: ``rollout.colocated: true`` (the servers and the
    actor take turns); a ``false`` the file or an override gives is an error naming both."""
    if not launch.colocated:
        return data
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    if rollout.get("colocated", True) is not True:
        value = rollout["colocated"]
        raise ConfigError(_contradiction("rollout.colocated", str(value).lower() if isinstance(value, bool) else
                                         repr(value), launch, where)
                          + ": leave rollout.colocated out (the launch sets it)")
    return {**data, "rollout": {**rollout, "colocated": True}}


def write_run_config(spec: LaunchSpec, out: Union[str, Path]) -> Path:
    """Write the RunConfig file the trainer is started with (same numbers as the check)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(f"# written by tools/fit_check.py from {spec.path}\n"
                   + yaml.safe_dump(spec.run_data, sort_keys=False), encoding="utf-8")
    tmp.replace(out)
    load_config(out)  # what the trainer will read must validate
    return out


def lora_server_options(lora, server) -> Dict[str, object]:
    """A server's LoRA options for ``actor.lora`` with ``sync: adapters`` (the adapters are loaded
    into the servers: LoRA enabled up to the run's rank on its targets' HF modules); none otherwise."""
    if lora is None or lora.sync != "adapters":
        return {}
    from megatron_tepo.config.schema import LORA_HF_MODULES

    modules = [m for t in lora.target_modules for m in LORA_HF_MODULES[t]]
    return {"max_lora_rank": max(int(server.max_lora_rank or 0), lora.rank), "lora_target_modules": ",".join(modules)}


def serve_args(spec: LaunchSpec) -> List[str]:
    """The words after the python of every rollout server of the job, all but ``--port`` (one per
    server): ``-m`` the engine's serve module and one server's options (``launch.rollout``) with
    what the launcher decides (the model path; every interface, for the actor nodes; on cuda the
    context length of a rollout), written by the options type itself (``to_argv``), which the serve
    command reads back. slurm/lib.sh reads them as ``FIT_SERVE_ARGS``, the nemo-run launcher calls this."""
    L, cfg = spec.launch, spec.cfg
    ctx = cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens if L.device == "cuda" else None
    # (a colocated layout's mem_fraction_static and memory saver: the fit check's, in L.rollout.server)
    server = dataclasses.replace(L.rollout.server, model_path=cfg.model.path, host="0.0.0.0", context_length=ctx,
                                 # MoE routing replay from the rollout's experts: the servers return them
                                 enable_return_routed_experts=(L.rollout.server.enable_return_routed_experts
                                                               or cfg.actor.routing_replay == "r3"),
                                 **lora_server_options(cfg.actor.lora, L.rollout.server))
    return ["-m", served_engine(L.rollout.engine).serve_module, *server.to_argv()]


def shell_vars(spec: LaunchSpec) -> Dict[str, str]:
    """What slurm/lib.sh needs, as ``FIT_*`` shell variables: the placement, ``FIT_STEPS`` (the
    job's steps, :func:`megatron_tepo.launch.sequence.job_steps`) and ``FIT_SERVE_ARGS`` (:func:`serve_args`,
    shell-quoted). ``FIT_ENGINE`` is ``rollout.engine`` (for the log of a job without servers);
    ``FIT_SGLANG_MAX_TOTAL_TOKENS`` is the server's KV pool, which lib.sh does not read (the serve
    command has it in ``FIT_SERVE_ARGS``). ``FIT_PLACEMENT`` is ``launch.rollout.placement``;
    ``FIT_RELEASE_TAGS`` the memory the ``release`` step frees on every server (empty: no such step);
    ``FIT_SERVE_ENV`` the variables a server of this job runs with beyond the job's own
    (``NAME=VALUE`` words, shell-quoted: :func:`~megatron_tepo.rollout.sglang.options.server_env`,
    which the serve command applies as well; slurm/lib.sh puts them in front of the serve command,
    so that a dry run shows them)."""
    L, r = spec.launch, spec.launch.rollout
    return {
        "FIT_DEVICE": L.device,
        "FIT_ENGINE": spec.cfg.rollout.engine,
        "FIT_STEPS": " ".join(job_steps(spec.cfg, L)),
        "FIT_ACTOR_NODES": str(L.actor_nodes), "FIT_ROLLOUT_NODES": str(L.rollout_nodes),
        "FIT_GPUS_PER_NODE": str(L.gpus_per_node), "FIT_SGLANG_TP": str(r.server.tp),
        "FIT_SERVERS_PER_NODE": str(L.servers_per_node), "FIT_SGLANG_PORT": str(r.port),
        "FIT_PLACEMENT": r.placement,
        "FIT_RELEASE_TAGS": ",".join(RELEASE_TAGS) if "release" in job_steps(spec.cfg, L) else "",
        "FIT_SGLANG_MAX_TOTAL_TOKENS": str(r.server.max_total_tokens),
        "FIT_OUTPUT_DIR": spec.cfg.train.output_dir,
        "FIT_SERVE_ARGS": shlex.join(serve_args(spec)),
        "FIT_SERVE_ENV": " ".join(f"{k}={shlex.quote(v)}" for k, v in server_env(r.server, {}).items() if v is not None),
    }


def render_shell(spec: LaunchSpec) -> str:
    return "\n".join(f"{k}={shlex.quote(v)}" for k, v in shell_vars(spec).items())
