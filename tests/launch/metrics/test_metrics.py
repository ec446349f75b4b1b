"""Metric values against independent counts from a recorded step's routing indices, and the writers."""

import json
import math

import numpy as np
import pytest
import torch

from launch.metrics.records import (SCHEMA_VERSION, JsonlWriter, TensorBoardWriter, decode_array, expert_load_summary,
                            model_flops_per_token, moe_layer_metrics, peak_flops_for_device,
                            rank_metrics, read_jsonl, step_record, throughput_metrics, traffic_metrics)
from moe.config import ModelConfig
from moe.model import MoETransformer

CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=32,
              first_k_dense=1, dense_ffn_size=64, num_experts=8, num_shared_experts=1, expert_ffn_size=16,
              top_k=2, score_func="sigmoid", num_groups=2, topk_groups=2, capacity_factor=1.0,
              seq_aux_loss_coeff=1e-3, aux_loss_coeff=1e-2, z_loss_coeff=1e-4)


def recorded_step():
    """One forward of a small MoE model with a dead expert forced in layer 0; router indices kept by hooks."""
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**CONFIG))
    layers = model.moe_layers()
    layers[0].router.expert_bias[3] = -1e4  # never selected
    layers[1].router.expert_bias.copy_(torch.linspace(-0.01, 0.01, 8))
    indices = []
    for layer in layers:
        layer.router.register_forward_hook(lambda _m, _i, out: indices.append(out.indices.clone()))
    tokens = torch.randint(0, 64, (4, 16))
    out = model(tokens, tokens)
    return model, out, [i.numpy() for i in indices]


def test_layer_metrics_match_an_independent_count_of_the_routing_indices():
    model, out, indices = recorded_step()
    stats = out.moe_stats
    metrics = moe_layer_metrics([s.tokens_per_expert for s in stats],
                                [layer.router.expert_bias for layer in model.moe_layers()], [int(s.dropped) for s in stats],
                                [{k: v.item() for k, v in s.losses.items()} for s in stats])
    moe = json.loads(json.dumps(metrics))["moe"]  # what a reader of the JSONL sees
    load = decode_array(moe["load"])
    assert load.shape == (2, 8) and moe["num_experts"] == 8
    for layer, chosen in enumerate(indices):
        counts = np.bincount(chosen[chosen >= 0], minlength=8)
        assert load[layer].tolist() == counts.tolist()
        mean = counts.mean()
        assert moe["max_over_mean"][layer] == pytest.approx(counts.max() / mean, abs=1e-4)
        assert moe["min_over_mean"][layer] == pytest.approx(counts.min() / mean, abs=1e-4)
        assert moe["cv"][layer] == pytest.approx(math.sqrt(((counts - mean) ** 2).mean()) / mean, abs=1e-4)
        assert moe["dead"][layer] == sum(c == 0 for c in counts)
        p = counts[counts > 0] / counts.sum()
        assert moe["entropy"][layer] == pytest.approx(-(p * np.log(p)).sum() / np.log(8), abs=1e-4)
        assert moe["dropped"][layer] == int((chosen < 0).sum())
    assert moe["dead"][0] >= 1 and load[0][3] == 0
    assert sum(moe["dropped"]) > 0  # capacity_factor 1.0 drops slots
    assert decode_array(moe["bias"])[1] == pytest.approx(np.linspace(-0.01, 0.01, 8), abs=1e-7)
    assert set(moe["losses"]) == {"load_balance", "seq_balance", "z"}
    assert moe["losses"]["z"] == pytest.approx([s.losses["z"].item() for s in stats])


def test_schema_one_summary_keeps_its_keys_and_agrees_with_the_layer_metrics():
    _, out, indices = recorded_step()
    loads = [s.tokens_per_expert for s in out.moe_stats]
    old = expert_load_summary(loads)
    new = moe_layer_metrics(loads, [torch.zeros(8)] * 2, [0, 0], [{}, {}])["moe"]
    assert old == {"expert_load_max_over_mean": new["max_over_mean"], "expert_load_min_over_mean": new["min_over_mean"],
                   "dead_experts": new["dead"], "expert_load_entropy": new["entropy"]}


def test_layer_metrics_refuse_mismatched_layer_counts():
    with pytest.raises(ValueError, match="one entry per MoE layer"):
        moe_layer_metrics([torch.ones(4)] * 2, [torch.zeros(4)], [0, 0], [{}, {}])


def test_traffic_matrices_from_per_rank_counters():
    # EP group of 4 ranks, 2 per node; row r = what rank r's counters say it sent to each peer
    sent = [[5, 10, 20, 30], [1, 0, 2, 3], [4, 5, 9, 6], [7, 8, 9, 0]]
    traffic = traffic_metrics(sent, gpus_per_node=2)["traffic"]
    ranks = decode_array(traffic["rank_bytes"])
    assert ranks.tolist() == [[0, 10, 20, 30], [1, 0, 2, 3], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert traffic["node_bytes"] == [[0 + 10 + 1 + 0, 20 + 30 + 2 + 3], [4 + 5 + 7 + 8, 0 + 6 + 9 + 0]]
    assert traffic["inter_node_bytes"] == 55 + 24 and traffic["intra_node_bytes"] == 11 + 15
    with pytest.raises(ValueError, match="square"):
        traffic_metrics([[1, 2, 3]])
    with pytest.raises(ValueError, match="gpus_per_node = 3"):
        traffic_metrics(sent, gpus_per_node=3)


def test_model_flops_per_token_counts_the_models_active_weights():
    cfg = ModelConfig(**CONFIG)
    model = MoETransformer(cfg)
    active = 0
    for name, param in model.named_parameters():
        if name.startswith("embed") or param.dim() < 2:
            continue
        share = cfg.top_k / cfg.num_experts if ".experts." in name else 1.0
        active += param.numel() * share
    seq_len = 16
    # causal QK^T and AV (launch.metrics.flops): 2 matmuls x 2 FLOPs per multiply-add x hidden x seq_len / 2 keys
    attention = 2 * 2 * cfg.hidden_size * (seq_len / 2) * cfg.num_layers
    assert model_flops_per_token(cfg, seq_len) == pytest.approx(3 * (2 * active + attention))


def test_throughput_and_rank_figures():
    out = throughput_metrics(tokens=4000, seconds=2.0, flops_per_token=1e9, peak_flops=8e12)
    assert out == {"tokens_per_s": 2000.0, "model_flops_per_token": 1e9, "mfu": 0.25}
    assert throughput_metrics(10, 1.0, 1e9, None)["mfu"] is None
    assert peak_flops_for_device("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_device("NVIDIA H100 80GB HBM3", "fp8") == 1979e12
    assert peak_flops_for_device("cpu") is None
    with pytest.raises(ValueError, match="seconds"):
        throughput_metrics(1, 0.0, 1.0, None)
    assert rank_metrics([10, 20], [0.1, 0.25]) == {"ranks": {"peak_memory_bytes": [10, 20],
                                                             "pipeline_idle_fraction": [0.1, 0.25]}}
    with pytest.raises(ValueError, match="idle"):
        rank_metrics([10, 20], [0.1])


def records():
    loads = [torch.tensor([4, 0, 2, 2]), torch.tensor([1, 1, 3, 3])]
    moe = moe_layer_metrics(loads, [torch.zeros(4), torch.ones(4)], [1, 0], [{"z": 0.5}, {"z": 0.25}])
    return [step_record(step, {"loss": 3.0 - step, "lr": 0.1}, moe) for step in range(2)]


def test_jsonl_and_tensorboard_writers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    jsonl, board = JsonlWriter(tmp_path / "m.jsonl"), TensorBoardWriter(tmp_path / "tb")
    for record in records():
        jsonl.write(record)
        board.write(record)
    jsonl.close()
    board.close()
    written = read_jsonl(tmp_path / "m.jsonl")
    assert [r["schema"] for r in written] == [SCHEMA_VERSION] * 2 and written == json.loads(json.dumps(records()))
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [3.0, 2.0]
    assert [e.value for e in events.Scalars("moe/max_over_mean/layer_0")] == [2.0, 2.0]
    assert [e.value for e in events.Scalars("moe/dead/layer_0")] == [1, 1]
    assert [e.value for e in events.Scalars("moe/loss_z/layer_1")] == [0.25, 0.25]
    assert events.Histograms("moe/load/layer_1")[0].histogram_value.num == 4
