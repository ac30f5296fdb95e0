"""The typed configuration: YAML + overrides, errors that name the field and where it came from."""
from pathlib import Path

import pytest

from megatron_tepo.config import ConfigError, RunConfig, dump_config, load_config

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_and_file_and_overrides(tmp_path):
    path = write(tmp_path, "a.yaml", "algorithm:\n  loss: grpo\n  kl_coef: 0.01\nrollout:\n  n_samples: 4\n")
    cfg = load_config(path, ["algorithm.kl_coef=1e-3", "train.seed=7", "algorithm.agg=seq-mean-token-sum"])
    assert isinstance(cfg, RunConfig)
    assert cfg.algorithm.loss == "grpo"
    assert cfg.algorithm.kl_coef == pytest.approx(1e-3)  # override wins; "1e-3" read as a float
    assert cfg.rollout.n_samples == 4
    assert cfg.rollout.temperature == 1.0  # default kept
    assert cfg.train.seed == 7
    assert cfg.algorithm.agg == "seq-mean-token-sum"


def test_unknown_key_names_path_file_and_line(tmp_path):
    path = write(tmp_path, "bad.yaml", "algorithm:\n  loss: tepo\n  clip_hihg: 0.3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "algorithm.clip_hihg" in msg and f"{path.resolve()}:3" in msg and "clip_high" in msg


def test_unknown_section_and_override_key():
    with pytest.raises(ConfigError, match=r"algorithmm \(override .algorithmm.loss=tepo.\): unknown key in the top level; did you mean algorithm"):
        load_config(None, ["algorithmm.loss=tepo"])
    with pytest.raises(ConfigError, match=r"rollout\.nsamples \(override 'rollout\.nsamples=3'\)"):
        load_config(None, ["rollout.nsamples=3"])


@pytest.mark.parametrize("override, needle", [
    ("rollout.n_samples=eight", "rollout.n_samples.*expected int, found str 'eight'"),
    ("rollout.n_samples=2.5", "rollout.n_samples.*expected int, found float"),
    ("rollout.dynamic_sampling=1", "rollout.dynamic_sampling.*expected bool"),
    ("algorithm.kl_mask=everything", "algorithm.kl_mask.*one of 'none'"),
    ("algorithm.agg=token-sum", "algorithm.agg.*token-mean"),
    ("algorithm=3", "expected a mapping for section 'algorithm'"),
    ("algorithm.loss=ppo2", "algorithm.loss: unknown loss 'ppo2'"),
    ("algorithm.loss_args.nonsense=1", "algorithm.loss_args.nonsense: not an argument of loss 'tepo'"),
    ("rollout.top_p=1.5", r"rollout.top_p: must be in \(0, 1\]"),
    ("train.mini_batch_prompts=48", "train.mini_batch_prompts: 48 must divide rollout.prompts_per_step"),
    ("optim.lr=0", "optim.lr: must be > 0"),
    ("algorithm.rollout_correction.rollout_is=seq", "algorithm.rollout_correction.rollout_is.*'token'"),
    ("algorithm.rollout_correction.rollout_is_cap=0.5", "algorithm.rollout_correction.rollout_is_cap must be"),
    ("algorithm.rollout_correction.rollout_rs_bounds=[1.5, 2]",
     r"algorithm.rollout_correction.rollout_rs_bounds must be \(lo, hi\)"),
    ("algorithm.rollout_correction.rollout_rs_bounds=[0.5]", "algorithm.rollout_correction.rollout_rs_bounds"),
    ("algorithm.old_log_prob=engine", "algorithm.old_log_prob.*'recompute'"),
    ("rollout.max_staleness=2", "rollout.max_staleness: 2 needs rollout.partial_rollout: true"),
    ("actor.lora.rank=0", "actor.lora.rank: must be > 0"),
    ("actor.lora.dropout=1.0", r"actor.lora.dropout: must be in \[0, 1\)"),
    ("actor.lora.target_modules=[q_proj]", r"actor.lora.target_modules: \['q_proj'\]: choose from linear_qkv"),
    ("actor.lora.ranks=8", "actor.lora.ranks.*unknown key in section 'actor.lora'; did you mean rank"),
    ("actor.lora.sync=adapters", "actor.lora.sync: adapters goes to SGLang's LoRA endpoints; rollout.engine 'embedded'"),
    ("actor.lora.sync=both", "actor.lora.sync"),
    ("actor.lora.init_from=/nonexistent/peft", "actor.lora.init_from: '/nonexistent/peft' is not a directory"),
])
def test_wrong_values_name_the_field(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_lora_is_off_unless_set_and_one_override_turns_it_on():
    assert load_config(None, []).actor.lora is None  # a full-parameter run: nothing of LoRA is built
    lora = load_config(None, ["actor.lora.rank=8"]).actor.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (8, 16.0, 0.0) and lora.scale == 2.0
    assert lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj"]
    with pytest.raises(ConfigError, match="actor.lora: .*actor.attention te builds Transformer Engine's"):
        load_config(None, ["actor.lora.rank=8", "actor.attention=te"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["algorithm.kl_coef"])


def test_base_inheritance_and_cycle(tmp_path):
    write(tmp_path, "base.yaml", "algorithm:\n  loss: tepo\n  kl_coef: 1.0\nrollout:\n  n_samples: 16\n")
    child = write(tmp_path, "child.yaml", "_base_: base.yaml\nalgorithm:\n  kl_coef: 0.0\n")
    cfg = load_config(child)
    assert (cfg.algorithm.loss, cfg.algorithm.kl_coef, cfg.rollout.n_samples) == ("tepo", 0.0, 16)
    write(tmp_path, "x.yaml", "_base_: y.yaml\n")
    write(tmp_path, "y.yaml", "_base_: x.yaml\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_duplicate_key_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"dup.yaml:3: duplicate key 'algorithm.loss'"):
        load_config(write(tmp_path, "dup.yaml", "algorithm:\n  loss: tepo\n  loss: grpo\n"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "broken.yaml", "algorithm: [\n"))


def test_dump_round_trip(tmp_path):
    cfg = load_config(None, ["algorithm.loss=gspo", "algorithm.clip_low=3e-4"])
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_every_example_config_loads():
    # examples/models/*.yaml are launch descriptions (architecture + layout), checked by tests/launch.
    files = sorted(p for p in (REPO / "examples").rglob("*.yaml") if "models" not in p.parts
                   and "eval" not in p.parts)
    assert files, "no example configs found"
    for path in files:
        load_config(path)  # raises with the file and field on any problem


def test_several_files_merge_left_to_right(tmp_path):
    a = write(tmp_path, "a.yaml", "algorithm:\n  loss: gspo\n  agg: seq-mean-token-mean\nrollout:\n  n_samples: 16\n")
    b = write(tmp_path, "b.yaml", "rollout:\n  n_samples: 4\n  max_new_tokens: 8\n")
    cfg = load_config([a, b])
    assert (cfg.algorithm.loss, cfg.algorithm.agg, cfg.rollout.n_samples, cfg.rollout.max_new_tokens) == (
        "gspo", "seq-mean-token-mean", 4, 8)
    with pytest.raises(ConfigError, match=r"b2.yaml:1"):
        load_config([a, write(tmp_path, "b2.yaml", "rolout:\n  n_samples: 4\n")])


def test_old_log_prob_rollout_refuses_what_needs_the_old_entropy():
    # TEPO's KL mask on the measured entropy change needs the old policy's entropy
    with pytest.raises(ConfigError, match="algorithm.old_log_prob: 'rollout' gives no old-policy entropy.*"
                                          "delta_entropy: predicted"):
        load_config(None, ["algorithm.old_log_prob=rollout", "algorithm.kl_coef=0.001"])
    with pytest.raises(ConfigError, match="loss 'steer' needs"):
        load_config(None, ["algorithm.old_log_prob=rollout", "algorithm.loss=steer"])
    # what it can do: the predicted entropy change uses the training pass's own entropy
    cfg = load_config(None, ["algorithm.old_log_prob=rollout", "algorithm.kl_coef=0.001",
                             "algorithm.delta_entropy=predicted"])
    assert cfg.algorithm.old_log_prob == "rollout"
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=geometric",
                             "algorithm.rollout_correction.rollout_rs_bounds=[0.25, 4]"])
    assert cfg.algorithm.rollout_correction.rollout_is == "geometric"
    assert cfg.algorithm.rollout_correction.rollout_rs_bounds == [0.25, 4.0]


def test_resume_check_takes_a_moved_run_folder_and_refuses_a_changed_setting(tmp_path):
    """The checkpoint a run resumes from is found in ``train.output_dir``: a different folder there
    is the same run moved (or named by another path), not a changed setting."""
    from megatron_tepo.trainer.main import RUN_CONFIG, check_resume

    ckpt = tmp_path / "moved" / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    dump_config(load_config([], [f"train.output_dir={tmp_path / 'run'}"]), ckpt / RUN_CONFIG)
    check_resume(load_config([], [f"train.output_dir={tmp_path / 'moved'}"]), ckpt)
    with pytest.raises(ConfigError, match=r"\(optim.lr 5e-07 -> 0.1\)"):  # and nothing else listed
        check_resume(load_config([], [f"train.output_dir={tmp_path / 'moved'}", "optim.lr=0.1"]), ckpt)


def test_a_checkpoint_saved_before_a_setting_existed_resumes_while_the_setting_keeps_its_default(tmp_path):
    """A run config saved by an earlier version lacks the settings added since (actor.lora,
    reward.function, environment.args ...): it ran as their defaults do, so resuming with the
    defaults is no change; giving one another value still is, and so is any other changed key."""
    import yaml

    from megatron_tepo.config import ConfigError, RunConfig, from_dict, to_dict
    from megatron_tepo.trainer.main import RUN_CONFIG, check_resume

    saved = to_dict(RunConfig())
    del saved["actor"]["lora"], saved["environment"]
    saved["reward"].pop("function", None)
    (tmp_path / RUN_CONFIG).write_text(yaml.safe_dump(saved))
    check_resume(RunConfig(), tmp_path)  # the defaults: no change
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank '<absent>' -> 8|actor\.lora '<absent>' -> "):
        check_resume(from_dict({"actor": {"lora": {"rank": 8}}}), tmp_path)
    with pytest.raises(ConfigError, match=r"rollout\.n_samples 8 -> 4|rollout\.n_samples \d+ -> 4"):
        check_resume(from_dict({"rollout": {"n_samples": 4}}), tmp_path)


def test_the_prompts_show_the_environments_tool_unless_data_tools_says_otherwise():
    """#58 item 4: with the Python tool in Qwen3's <tool_call> format and no data.tools, every
    rendering (prompts, turn boundaries, comparator) takes the tool's schema as tools=; data.tools
    wins when set; the fenced format and a run without an environment show none; the 14B tool
    example shows Qwen3 its tool."""
    import yaml

    from megatron_tepo.config import from_dict
    from megatron_tepo.config.validation import template_kwargs

    def kw(**sections):
        return template_kwargs(from_dict(sections))

    (tool,) = kw(environment={"name": "python", "format": "qwen3"})["tools"]
    assert tool["function"]["name"] == "python" and tool["function"]["parameters"]["required"] == ["code"]
    (session,) = kw(environment={"name": "python_session", "format": "qwen3"})["tools"]
    assert "earlier calls" in session["function"]["description"]
    assert kw(environment={"name": "python", "format": "fenced"}) == {} and kw() == {}
    mine = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    assert kw(environment={"name": "python", "format": "qwen3"},
              data={"tools": mine, "chat_template_kwargs": {"enable_thinking": False}}) == {
        "tools": mine, "enable_thinking": False}
    example = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples/models/qwen3_14b_tir.yaml").read_text())
    assert kw(environment={k: example["environment"][k] for k in ("name", "format")})["tools"] == [tool]
