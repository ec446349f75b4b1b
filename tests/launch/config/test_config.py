"""Config validation: every bad value stops the program early with the field named."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.config.run import build_config, load_config

ROOT = Path(__file__).resolve().parents[3]
MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


@pytest.mark.parametrize("raw, message", [
    ({"model": {"top_k": 9, "num_experts": 8}}, "top_k = 9 must be <= num_experts"),
    ({"model": {"num_groups": 2, "topk_groups": 3}}, "topk_groups = 3 must be <= num_groups"),
    ({"model": {"num_experts": 6, "num_groups": 4}}, "num_experts = 6 must be divisible by num_groups"),
    ({"model": {"capacity_factor": 0.0}}, "capacity_factor = 0.0 must be > 0"),
    ({"model": {"capacity_factor": -1}}, "capacity_factor = -1 must be > 0"),
    ({"model": {"score_func": "tanh"}}, "score_func = 'tanh' is not allowed; choose one of 'softmax', 'sigmoid'"),
    ({"model": {"expert_precision": "fp4"}}, "expert_precision = 'fp4' is not allowed"),
    ({"model": {"hidden_size": 100, "num_heads": 3}}, "hidden_size = 100 must be divisible by num_heads"),
    ({"model": {"nonsense": 1}}, "unknown key model.nonsense"),
    ({"model": {"attention": "mha"}}, r"\[model\] attention = 'mha' is not allowed; choose one of 'gqa', 'mla'"),
    ({"model": {"attention": "mla", **MLA, "kv_lora_rank": 0}},
     r"\[model\] kv_lora_rank = 0 must be an integer >= 1 with attention = 'mla'"),
    ({"model": {"attention": "mla", "kv_lora_rank": 16}}, r"qk_nope_head_dim = 0 must be an integer >= 1 with attention"),
    ({"model": {"attention": "mla", **MLA, "qk_rope_head_dim": 7}}, r"qk_rope_head_dim = 7 must be even"),
    ({"model": {"attention": "mla", **MLA, "q_lora_rank": -1}}, r"q_lora_rank = -1 must be an integer >= 0"),
    ({"model": {"attention": "mla", **MLA, "q_lora_rank": 2.0}}, r"model.q_lora_rank = 2.0 must be of type int"),
    ({"model": {"attention": "mla", **MLA, "v_head_dim": 1.5}}, r"model.v_head_dim = 1.5 must be of type int"),
    ({"model": {"kv_lora_rank": 16}}, r"kv_lora_rank = 16 is an MLA width: set attention = 'mla'"),
    ({"model": {"attention": "mla", **MLA, "num_heads": 6}, "parallel": {"tp": 4}},
     r"model.num_heads = 6 is not divisible by parallel.tp = 4; tp must be one of \[1, 2, 3, 6\]"),
    ({"train": {"lr": "fast"}}, "train.lr = 'fast' must be of type float or int"),
    ({"train": {"dtype": "float16"}}, "train.dtype = 'float16' is not allowed"),
    ({"train": {"recompute": "some"}},
     "train.recompute = 'some' is not allowed; choose one of 'none', 'selective', 'full'"),
    ({"train": {"recompute": "full"}, "parallel": {"tp": 2}}, "train.recompute = 'full' reruns attention in backward"),
    ({"train": {"recompute": "full"}, "parallel": {"cp": 2}}, "train.recompute = 'full' reruns attention in backward"),
    ({"train": {"seq_len": 512}}, "train.seq_len = 512 must be <= model.max_seq_len"),
    ({"model": {"ep_size": 2}}, "unknown key model.ep_size"),
    ({"parallel": {"pp": 2, "dp": 1}}, "parallel.schedule = 'none' with parallel.pp = 2"),
    ({"parallel": {"ep": 3, "dp": 4}}, "parallel.ep = 3 must divide dp x cp x tp = 4 .allowed: 1, 2, 4."),
    ({"parallel": {"cp": 2, "tp": 4, "sequence_parallel": True}, "train": {"seq_len": 12}},
     r"train.seq_len = 12 / parallel.cp = 6 is not divisible by parallel.tp = 4, .* multiple of 8"),
    ({"parallel": {"cp": 2, "tp": 3}, "train": {"seq_len": 20},
      "model": {"num_heads": 6, "num_kv_heads": 3, "hidden_size": 96, "vocab_size": 258}},
     r"train.seq_len = 20 / parallel.cp = 10 is not divisible by parallel.tp = 3, .*MoE layers.* multiple of 12"),
    ({"parallel": {"cp": 2, "tp": 8}}, r"model.num_heads = 4 is not divisible by parallel.tp = 8"),
    ({"parallel": {"ep": 4, "dp": 4}, "model": {"num_experts": 6, "num_groups": 1}, "train": {"grad_accum_steps": 4}},
     "parallel.ep = 4 must divide model.num_experts = 6"),
    ({"parallel": {"pp": 3, "schedule": "dualpipe"}}, "parallel.pp = 3: schedule 'dualpipe' needs an even pp"),
    ({"parallel": {"pp": 4, "schedule": "dualpipev"}, "train": {"grad_accum_steps": 8}},
     "model.num_layers = 4 is fewer than the 8 pipeline stages"),
    ({"parallel": {"pp": 2, "schedule": "dualpipev"}, "train": {"grad_accum_steps": 2}},
     "parallel.num_chunks = 2 is too small for schedule 'dualpipev' with pp = 2: it needs >= 4"),
    ({"parallel": {"dp": 2, "gpus_per_node": 3}, "train": {"grad_accum_steps": 2}},
     "parallel.gpus_per_node = 3 must divide the world size"),
    ({"parallel": {"dp": 2}, "train": {"grad_accum_steps": 3}}, "train.grad_accum_steps = 3 .* multiple of parallel.dp"),
    ({"parallel": {"schedule": "gpipe"}}, "parallel.schedule = 'gpipe' is not allowed"),
    ({"model": {"hidden_size": 120, "num_heads": 4}, "parallel": {"dispatch_payload": "fp8"}},
     "model.hidden_size = 120 must be a multiple of 16 with parallel.dispatch_payload = 'fp8'.*allowed e.g. 112, 128"),
    ({"model": {"hidden_size": 120, "num_heads": 4, "expert_precision": "fp8"}}, "model.hidden_size = 120 must be a multiple of 16"),
    ({"model": {"expert_ffn_size": 100, "expert_precision": "fp8"}}, "model.expert_ffn_size = 100 must be a multiple of 16"),
    ({"data": {"corpus": "/no/such/corpus"}}, "data.corpus = '/no/such/corpus': no such file or folder"),
    ({"optimizer": {}}, "unknown section .optimizer."),
])
def test_bad_values_name_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        build_config(raw)


def test_context_parallel_composes_with_tensor_parallel():
    cfg = build_config({"parallel": {"cp": 2, "tp": 2, "ep": 4, "sequence_parallel": True}, "train": {"seq_len": 8}})
    assert (cfg.parallel.world_size, cfg.layout.sequence_group(3)) == (4, [0, 1, 2, 3])
    wide = build_config({"parallel": {"dp": 2, "cp": 2, "tp": 2},
                         "train": {"seq_len": 8, "grad_accum_steps": 2}}).layout
    assert wide.sequence_group(5) == [4, 5, 6, 7] and wide.cp_group(5) == [5, 7] and wide.tp_group(5) == [4, 5]


def test_shipped_config_and_overrides(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["model.expert_precision=fp8", "train.steps=7"])
    assert cfg.model.expert_precision == "fp8" and cfg.train.steps == 7
    assert cfg.model.num_moe_layers == cfg.model.num_layers - cfg.model.first_k_dense


@pytest.mark.slow  # starts processes (tests/conftest.py)
def test_cli_rejects_bad_config_before_any_work(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\ntop_k = 99\n[train]\nrun_dir = "%s"\n' % (tmp_path / "run"))
    result = subprocess.run([sys.executable, "-m", "launch.train_cli", "--config", str(bad)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "top_k = 99" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("parallel", "model", "key"), [
    ({"dp": 2, "ep": 2, "redundant_experts": 5}, {}, "parallel.redundant_experts"),  # 4 experts per rank
    ({"dp": 2, "ep": 2, "redundant_experts": 1, "rebalance_every": 0}, {}, "parallel.rebalance_every"),
    ({"dp": 2, "ep": 2, "redundant_experts": 1}, {"capacity_factor": 1.0}, "model.capacity_factor"),
    ({"dp": 2, "redundant_experts": 1}, {}, "parallel.ep > 1"),
])
def test_redundant_experts_refuse_bad_input_naming_the_key(parallel, model, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        build_config({"model": {"num_experts": 8, **model}, "train": {"grad_accum_steps": 2}, "parallel": parallel})


@pytest.mark.parametrize("exchange", ["padded", "device_split"])
def test_cuda_graphs_over_ep_ranks_need_the_padded_exchange(exchange):
    """Issue 48: train.cuda_graphs captures steps that read nothing to the host; over EP ranks the exact exchange
    reads its sizes, so it is refused naming both keys and the allowed exchanges; the padded and the device-split
    exchange, or no EP, pass the config's checks."""
    def raw(parallel: dict) -> dict:
        return {"model": {"num_experts": 8}, "train": {"grad_accum_steps": 2, "cuda_graphs": True},
                "parallel": parallel}
    with pytest.raises(ValueError, match=r"train.cuda_graphs = true .* parallel.dispatch_exchange = 'exact' with "
                                         r"parallel.ep = 2 .* allowed: parallel.dispatch_exchange = 'padded' or "
                                         r"'device_split'"):
        build_config(raw({"dp": 2, "ep": 2}))
    assert build_config(raw({"dp": 2, "ep": 2, "dispatch_exchange": exchange})).train.cuda_graphs
    assert build_config(raw({"dp": 2})).train.cuda_graphs


def test_dispatch_exchange_takes_device_split_and_names_the_allowed_values():
    """parallel.dispatch_exchange = "device_split" is a layout like "padded" (hierarchical in chunks, any payload); an
    unknown value is refused naming the key and every allowed value."""
    parallel = {"dp": 2, "ep": 2, "dispatch_backend": "hierarchical", "gpus_per_node": 1, "dispatch_chunks": 2,
                "dispatch_payload": "fp8", "dispatch_exchange": "device_split"}
    raw = {"model": {"num_experts": 8}, "train": {"grad_accum_steps": 2}}
    assert build_config({**raw, "parallel": parallel}).parallel.dispatch_exchange == "device_split"
    with pytest.raises(ValueError, match=re.escape("parallel.dispatch_exchange = 'nvshmem' is not allowed; choose one "
                                                   "of 'exact', 'padded', 'device_split'")):
        build_config({**raw, "parallel": {**parallel, "dispatch_exchange": "nvshmem"}})


@pytest.mark.parametrize("exchange", ["padded", "device_split"])
def test_fixed_size_exchanges_refuse_a_hierarchical_dispatch_without_hop_groups(exchange):
    """Equal blocks need groups of exactly each hop's peers: refused (before any collective) naming the exchange."""
    from dispatch import EPDispatcher

    with pytest.raises(ValueError, match=f"exchange = '{exchange}' sends equal blocks .* needs hops"):
        EPDispatcher(8, gpus_per_node=1, backend="hierarchical", exchange=exchange)
