"""moe-train --rehearse: one rank of a whole layout runs a training step on the meta device under the fake
process group; any tensor made off the trainer's device fails it, naming the op and the line."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import launch.parallel.stages
from launch.config.run import build_config, load_config
from launch.parallel.mesh import Mesh
from launch.plan.planner import Machine, Options, make_plan
from launch.plan.presets import gpu_preset
from launch.plan.rehearse import DeviceError, rehearse
from launch.train.build import build_model
from launch.train_cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny.toml"

# DeepSeek-V3's shape shrunk to a few seconds: 4 layers (1 dense), MLA (4 heads, query and KV latents, value heads
# narrower than query/key heads), 64 routed experts top-8 in 8 groups (4 kept), FP8 experts and FP8 dispatch,
# hierarchical EP64 over 8 nodes of 8, DualPipe over pp 2, 256 ranks in all
V3_SHAPED = {
    "model": {"vocab_size": 512, "hidden_size": 256, "num_layers": 4, "num_heads": 4, "attention": "mla",
              "q_lora_rank": 96, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
              "max_seq_len": 256, "first_k_dense": 1, "dense_ffn_size": 512, "num_experts": 64,
              "num_shared_experts": 1, "expert_ffn_size": 128, "top_k": 8, "score_func": "sigmoid",
              "num_groups": 8, "topk_groups": 4, "route_scale": 2.5, "seq_aux_loss_coeff": 0.0001,
              "bias_update_rate": 0.001, "expert_precision": "fp8"},
    "train": {"micro_batch_size": 1, "seq_len": 256, "grad_accum_steps": 512, "dtype": "bfloat16"},
    "parallel": {"pp": 2, "dp": 128, "ep": 64, "gpus_per_node": 8, "schedule": "dualpipe",
                 "dispatch_backend": "hierarchical", "dispatch_payload": "fp8"},
}


def _calls(result, kind: str) -> dict[int, int]:
    """group size -> calls of one collective kind."""
    return {group: calls for k, group, calls, _ in result.collectives.rows() if k == kind}


def test_tiny_rehearsal_runs_the_step_of_the_largest_rank():
    result = rehearse(load_config(TINY))
    assert (result.rank, result.world_size) == (2, 4)  # moe-plan's busiest pipeline rank is pp 1 (ranks 2, 3)
    for category in ("params", "grads", "optimizer"):  # fp32: the params are their own masters, grads bound
        assert result.peak[category] == pytest.approx(result.planned[category], rel=0.01), category
    assert result.peak["activations"] == pytest.approx(result.planned["activations"], rel=0.1)
    assert _calls(result, "alltoall_base_")[2] > 0   # EP dispatch over ep = 2
    assert set(_calls(result, "send")) == {2}        # pipeline p2p between pp 2 ranks
    assert 2 in _calls(result, "_reduce_scatter_base_")  # ZeRO-1 over dp = 2
    assert 4 in _calls(result, "allreduce_")         # the step's one stats all-reduce over the world


@pytest.mark.timeout(120)
def test_v3_shaped_rehearsal_at_world_256_runs_on_meta():
    """Rank 0 under DualPipe holds stages 0 and 1 (the embedding, the head and the MTP depth): its params as planned."""
    result = rehearse(build_config({**V3_SHAPED, "model": {**V3_SHAPED["model"], "mtp_depth": 1}}), rank=0)
    assert result.world_size == 256
    assert result.peak["params"] == pytest.approx(result.planned["params"], rel=0.01)
    # the plan counts the MTP depth's activations on the last stage (1.315 of the plan without them; 1.096 with,
    # this toy's fixed overheads being 1.171 of its plan without MTP)
    assert result.peak["activations"] == pytest.approx(result.planned["activations"], rel=0.15)
    assert set(_calls(result, "alltoall_base_")) == {8}  # EP64's hops: rail (8 nodes) and node (8 ranks) groups
    assert 256 in _calls(result, "allreduce_")


def test_dualpipe_rank_0_holds_one_embedding_and_one_head_that_mtp_shares():
    """DeepSeek-V3's layout: DualPipe puts the first and the last stage on pipeline rank 0, so the MTP depth there
    uses the model's own embedding and head (no copies); moe-plan counts that rank's params the same way."""
    cfg = build_config({**V3_SHAPED, "model": {**V3_SHAPED["model"], "mtp_depth": 1}})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.parallel.world_size)
    try:
        stages, _ = build_model(cfg, Mesh(cfg.layout), torch.device("meta"))
    finally:
        dist.destroy_process_group()
    params = {id(p): (name, p) for stage in stages for name, p in stage.named_parameters()}
    vocab_rows = sorted(name for name, p in params.values() if p.shape[0] == cfg.model.padded_vocab_size)
    assert vocab_rows == ["embed.weight", "lm_head.weight"]
    assert [s.mtp is not None for s in stages] == [False, True] and stages[1].embed is stages[0].embed
    plan = make_plan(cfg, Machine(gpu_preset("h800"), cfg.parallel.gpus_per_node), Options(), timed=False).ranks[0]
    assert plan.stages == [0, 1]
    expert = sum(p.numel() for name, p in params.values() if ".experts.w_" in name)
    assert (sum(p.numel() for _, p in params.values()) - expert, expert) == (plan.dense_params, plan.expert_params)


def test_chunked_hierarchical_rehearsal_runs_each_hop_on_its_group():
    plain = rehearse(load_config(TINY))
    chunked = rehearse(load_config(TINY, ["parallel.dispatch_chunks=3"]))
    assert set(_calls(plain, "alltoall_base_")) == {1, 2}  # ep 2 over 2 nodes: node groups of 1, rails of 2
    assert set(_calls(chunked, "alltoall_base_")) == {1, 2}
    assert _calls(chunked, "alltoall_base_")[2] > _calls(plain, "alltoall_base_")[2]  # one rail exchange per chunk
    assert chunked.peak["activations"] == pytest.approx(plain.peak["activations"], rel=0.1)


def test_a_cpu_tensor_planted_in_the_step_fails_the_rehearsal_naming_it(monkeypatch):
    real = launch.parallel.stages.lm_loss

    def planted(*args, **kwargs):
        torch.ones(4)  # a tensor on the default device, as a careless line would make
        return real(*args, **kwargs)

    monkeypatch.setattr(launch.parallel.stages, "lm_loss", planted)
    with pytest.raises(DeviceError, match=r"aten\.ones\.default created a tensor of shape \[4\] on cpu.*"
                                          r"test_rehearse\.py:\d+ \(torch\.ones\(4\)"):
        rehearse(load_config(TINY, ["parallel.pp=1", "parallel.schedule='none'"]))


@pytest.mark.parametrize("layout", [["parallel.pp=1", "parallel.schedule='none'"], []])
def test_mtp_rehearses_on_meta(layout):
    """MTP (depth 2) runs on the meta device: one stage, and the tiny config's pipeline."""
    result = rehearse(load_config(TINY, ["model.mtp_depth=2", *layout]))
    assert result.peak["activations"] > 0


@pytest.mark.parametrize("layout", [["parallel.pp=1", "parallel.schedule='none'"], []])
def test_document_mask_and_padded_vocab_rehearse_on_meta(layout):
    """Document ids (every stage of the tiny config's DualPipeV gets them) and a padded vocab (512 ids in 600 rows)
    run on the meta device: nothing is created off it."""
    result = rehearse(load_config(TINY, ["data.document_mask=true", "model.vocab_multiple=100", *layout]))
    assert result.peak["activations"] > 0


def test_moe_train_rehearse_prints_memory_beside_the_plan_and_refuses_a_bad_rank(capsys):
    assert main(["--config", str(TINY), "--rehearse", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rehearsal of rank 1 of 4" in out and "moe-plan" in out and "alltoall_base_" in out
    assert main(["--config", str(TINY), "--rehearse", "--rank", "4"]) == 2
    assert "--rank 4 is outside the layout's 4 ranks" in capsys.readouterr().err


def test_a_ranks_step_stats_do_not_grow_with_the_world():
    """The stats all-reduce carries losses, loads and the EP-peer matrix, nothing per rank; the per-rank rows
    (on the step's last, rank-metrics step) go to rank 0 by one gather of a fixed-size row."""
    sent = {}
    for dp in (2, 32):
        result = rehearse(load_config(TINY, [f"parallel.dp={dp}", f"train.grad_accum_steps={4 * dp}"]), rank=1)
        world = result.world_size
        sent[world] = {k: (calls, nbytes) for k, group, calls, nbytes in result.collectives.rows()
                       if group == world and k in ("allreduce_", "gather_")}
    assert set(sent) == {4, 64}
    assert sent[4] == sent[64] and sent[4]["gather_"][0] == 1



def test_redundant_experts_rehearse_with_their_weights_as_planned():
    """parallel.redundant_experts = 1 (EP2 in one node, so replicas may go anywhere): the spare expert weights are
    model state (non-persistent buffers), counted in params as moe-plan counts them (one expert's weights for each
    of the rank's 2 MoE layers: 15.7% of its params, so a plan without them misses by far more than the 1%); grads
    and optimizer state as without spares; activations, with the owned and spare weights each chunk's grouped GEMMs
    keep, within the tiny rehearsal's 10%. (On meta the loads read as zeros: no spare is placed, so the refresh and
    grad fold move nothing here; moe-plan prices them.)"""
    spare = rehearse(load_config(TINY, ["parallel.gpus_per_node=2", "parallel.redundant_experts=1"]))
    assert spare.rank == 2
    for category in ("params", "grads", "optimizer"):
        assert spare.peak[category] == pytest.approx(spare.planned[category], rel=0.01), category
    assert spare.peak["activations"] == pytest.approx(spare.planned["activations"], rel=0.1)


@pytest.mark.parametrize("exchange", ["padded", "device_split"])
def test_padded_exchange_rehearses_its_padding_as_planned(exchange):
    """parallel.dispatch_exchange = "padded" (issue 48) hands each rank's experts a fixed number of rows, headroom
    times the routed ones (dispatch.routes.padded_bounds), and moe-plan prices every per-row byte of the routed experts
    at those rows (ActivationModel.slot_rows): the tiny rehearsal's activations, its hops in 2 chunks, within 10% of
    the plan, as the exact exchange's (measured 1.070; one chunk 1.068; exact 1.078; 1.538 unpriced). The device-split
    exchange (its reference on meta, the counts on the device) rehearses alike (measured 1.071)."""
    padded = rehearse(load_config(TINY, [f"parallel.dispatch_exchange={exchange}", "parallel.dispatch_chunks=2"]))
    assert padded.peak["activations"] == pytest.approx(padded.planned["activations"], rel=0.1)
