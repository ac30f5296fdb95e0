"""The fit check with context parallelism (``parallel.cp``; docs/LAUNCH.md, "Context parallelism in the
fit check"): each CP rank's share of a micro-batch's tokens (the actor's own rule), its activations, LM
head and routing at that share, the CP attention's keys, values and mask, the optimizer sharded over
DP x CP; the 32k-response 14B example fits at its CP and is refused at CP 1 naming ``parallel.cp``."""
from pathlib import Path

import pytest
import torch

from megatron_tepo.config import ConfigError, load_config
from megatron_tepo.launch import FitError, check_fit, load_launch, write_run_config
from megatron_tepo.launch.memory import GiB, actor_memory, context_tokens, cp_attention_bytes
from tests.launch.test_fit import tiny

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"
Q32K = MODELS / "qwen3_14b_32k.yaml"


@pytest.mark.parametrize("tokens,cp,multiple", [(1, 2, 1), (7, 2, 1), (100, 3, 1), (100, 3, 2), (100, 3, 4),
                                                (14, 2, 3), (34816, 2, 4), (34817, 4, 4), (4096, 8, 2)])
def test_rank_share_is_the_actors(tokens, cp, multiple):
    """A CP rank's share of one packed sequence of ``tokens`` tokens is what the actor gives it
    (``MicroBatch.with_context_tokens`` then ``context_tokens``: 2 x cp chunks, two a rank, padded for
    the sequence-parallel split)."""
    from megatron_tepo.token_layout import build_micro_batch
    from megatron_tepo.batch import RolloutBatch

    ids = torch.arange(10, 10 + tokens + 1).unsqueeze(0)  # one row: 1 prompt token + `tokens` response tokens
    batch = RolloutBatch(input_ids=ids, prompt_lens=torch.tensor([1]), response_mask=torch.ones(1, tokens))
    mb = build_micro_batch(batch, [0], packed=True)
    actor = mb.with_context_tokens(cp, multiple=multiple).context_tokens(cp)
    assert context_tokens(tokens + 1, cp, multiple) == actor
    assert context_tokens(tokens + 1, 1, multiple) == tokens + 1  # CP 1: the micro-batch, unpadded, as before


def test_tiny_context_parallel_by_hand(tmp_path):
    """The tiny layout of test_fit.py (TP 2 on 4 GPUs, s = 256 tokens, no recompute, 1256 B a token a
    layer, 2 layers) at CP 2: DP 1, each rank 128 tokens."""
    base = actor_memory(*(lambda s: (s.shape(), s.cfg, s.launch))(tiny(tmp_path)))
    spec = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True})
    a = actor_memory(spec.shape(), spec.cfg, spec.launch)
    assert (a.cp, a.dp, a.tokens, a.rank_tokens) == (2, 1, 256, 128)
    assert a.activations == 2 * 1256 * 128 == base.activations / 2
    # the fused head at 128 tokens (its weight gradient, 2 * 128 * 64, and staging, 4 * 128 * 64, as at 256)
    assert a.logits == 2 * 2 * 128 * 128 + (2 * 2 + 4) * 64 * 128 + 2 * 128 * 64 + 4 * 128 * 64
    # no recompute, no TE: every layer keeps its gathered K and V (2 x 2 groups / TP 2 x 16 x 2 B x 256
    # tokens) and its causal mask (bool + bf16 bias, 128 local queries x 128 keys: the longest sequence)
    per_layer = 2 * 1 * 16 * 2 * 256 + 3 * 128 * 128
    assert cp_attention_bytes(spec.shape(), 2, 128, 2, 128) == per_layer == 65_536
    assert a.cp_attention == 2 * per_layer
    assert a.total == a.weights + a.grads + a.optimizer + a.activations + a.logits + a.cp_attention + a.reserve
    assert (a.weights, a.grads, a.optimizer) == (base.weights, base.grads, base.optimizer)  # replicated over CP
    # TE's ring: two ranks' blocks of K and V, no mask, passing (one layer)
    te = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True, "attention": "te"})
    assert actor_memory(te.shape(), te.cfg, te.launch).cp_attention == 2 * 1 * 16 * 2 * 2 * 128
    # full recompute: the re-run block's, then freed
    full = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True, "recompute": "full",
                                                     "recompute_num_layers": 2})
    f = actor_memory(full.shape(), full.cfg, full.launch)
    assert f.cp_attention == 2 * per_layer and f.activations == 2 * 128 * 128 + 2 * 1256 * 128
    sel = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True, "recompute": "selective"})
    assert actor_memory(sel.shape(), sel.cfg, sel.launch).cp_attention == per_layer
    # the distributed optimizer shards over DP x CP = 2 (as at CP 1 over DP 2)
    dist = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True},
                optim={"use_distributed_optimizer": True})
    assert actor_memory(dist.shape(), dist.cfg, dist.launch).optimizer == 12 * 53632 / 2


def test_context_parallel_report_says_what_it_assumed(tmp_path):
    spec = tiny(tmp_path, parallel={"cp": 2}, actor={"pack_sequences": True}, launch={"gpu_mem_gib": 80},
                optim={"use_distributed_optimizer": True})
    text = check_fit(spec.shape(), spec.cfg, spec.launch).render()
    assert "tp=2 pp=1 ep=1 dp=1 cp=2 " in text
    assert ("micro-batch tokens=256 (128 a CP rank: each sequence in 2 x cp=2 chunks, two a rank; the optimizer "
            "sharded over dp x cp = 2)") in text
    assert "CP attention 0.0 GiB" in text
    one = tiny(tmp_path, launch={"gpu_mem_gib": 80})
    text = check_fit(one.shape(), one.cfg, one.launch).render()
    assert "dp=2 cp=1 " in text and "a CP rank" not in text and "CP attention" not in text


def test_a_world_cp_does_not_divide_is_refused_naming_it():
    spec = load_launch(Q32K, ["parallel.cp=3"])
    with pytest.raises(FitError) as err:
        check_fit(spec.shape(), spec.cfg, spec.launch)
    assert str(err.value) == ("invalid layout: parallel.tp x parallel.pp x parallel.cp = 12 does not divide the "
                              "actor's ranks (launch.actor_nodes x launch.gpus_per_node) (16)")


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.cp=0"], "parallel.cp"),
    (["actor.pack_sequences=false"], "parallel.cp: context parallelism splits packed sequences: needs "
                                     "actor.pack_sequences=true, got 2"),
])
def test_bad_context_parallel_settings_name_the_field(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_launch(Q32K, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_qwen3_14b_32k_fits_at_cp_2():
    spec = load_launch(Q32K)
    m, cfg = spec.shape(), spec.cfg
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.rollout.max_new_tokens, cfg.actor.max_tokens_per_micro_batch) == (
        4, 2, 32768, 34816)
    r = check_fit(m, cfg, spec.launch)
    a = r.actor
    params = 3_692_395_520  # TP 4, as the 14B file (test_fit.py)
    assert (a.dp, a.tokens, a.rank_tokens) == (2, 34816, 17408)
    assert a.optimizer == 12 * params / 4  # over DP 2 x CP 2
    # selective recompute with SP: (192,672 - 2*40*128*2 - 4*40) / 4 = 45,568 B a token a layer, 40 layers
    assert a.activations == 40 * 45_568 * 17408
    # one layer's core attention re-run: K and V of 34816 tokens (2 x 8/4 groups x 128 x 2 B) and the mask
    assert a.cp_attention == 2 * 2 * 128 * 2 * 34816 + 3 * 17408 * 34816
    assert round(a.total / GiB, 1) == 67.3 and r.actor_fits and r.server_fits
    assert r.server.kv_tokens == 44 * 34816  # 2048 + 32768 tokens a sequence


def test_qwen3_14b_32k_is_refused_at_cp_1_naming_parallel_cp():
    spec = load_launch(Q32K, ["parallel.cp=1"])
    with pytest.raises(FitError) as err:
        check_fit(spec.shape(), spec.cfg, spec.launch)
    msg = str(err.value)
    assert msg.startswith("actor does not fit: 95.9 GiB > 80 GiB per GPU") and "\n" not in msg
    assert "raise parallel.cp (now 1: each of cp ranks holds 1/cp of a micro-batch's tokens" in msg
    # the budget is one longest sequence already: lowering it would change nothing, so it is not offered
    assert "lower actor.max_tokens_per_micro_batch" not in msg


def test_fit_check_command_on_the_32k_example(capsys, tmp_path):
    from tools.fit_check import cli

    assert cli(["--config", str(Q32K), "--write-run-config", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    assert "dp=2 cp=2 " in out and "total 67.3 GiB of 80 GiB: fits" in out
    assert load_config(tmp_path / "run.yaml").parallel.cp == 2
    with pytest.raises(SystemExit) as exit_:
        cli(["--config", str(Q32K), "parallel.cp=1"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "actor does not fit: 95.9 GiB > 80 GiB per GPU" in err and "raise parallel.cp" in err


def test_the_32k_run_config_reads_back(tmp_path):
    spec = load_launch(Q32K)
    cfg = load_config(write_run_config(spec, tmp_path / "run.yaml"))
    assert cfg.parallel == spec.cfg.parallel and cfg.parallel.cp == 2 and cfg.actor.pack_sequences
    assert cfg.algorithm.loss == "tepo" and cfg.rollout.max_new_tokens == 32768
