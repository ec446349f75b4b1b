"""launch.bench.breakdown: names of kernels (CUDA) and operators (CPU) go to the right kind of work, and a trainer
run's last step profiled through ProfiledFeed sums its operators' time by kind, the kinds adding up to the total."""

import pytest
import torch

from launch.bench.breakdown import CATEGORIES, OTHER, ProfiledFeed, categorize
from launch.config.run import load_config
from launch.plan.compute import WORK_KINDS
from launch.plan.rehearse import RandomFeed
from launch.train.loop import train

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.dense_ffn_size=64", "model.expert_ffn_size=16", "train.seq_len=16", "train.micro_batch_size=2",
         "train.grad_accum_steps=2", "train.eval_batches=0", "train.device='cpu'"]


@pytest.mark.parametrize("name, kind", [
    ("aten::_grouped_mm", "expert GEMM"),  # torch's grouped GEMM (our bf16 experts, torchtitan's)
    ("_mgrouped_kernel", "expert GEMM"), ("kgrouped_kernel", "expert GEMM"),  # our Triton / Gluon FP8 kernels
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<...>>>",
     "expert GEMM"),
    ("_quantize_rows_kernel", "FP8 quantise"), ("_retile_kgrouped_kernel", "FP8 quantise"),
    ("_quantize_kgrouped_kernel", "FP8 quantise"),
    ("cutlass::device_kernel<...GroupProblemShape...cutlass::float_e4m3_t...>", "expert GEMM"),  # torch's FP8 peer
    ("flash_fwd_kernel<...>", "attention"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "GEMM"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "GEMM"),
    ("aten::mm", "GEMM"), ("aten::addmm", "GEMM"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>", "optimizer"),
    ("aten::_foreach_mul_", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("aten::sort", "routing & permute"), ("aten::index_select", "routing & permute"),
    ("aten::embedding_dense_backward", "routing & permute"),
    ("aten::_fused_rms_norm", "norm & softmax"), ("aten::_log_softmax", "norm & softmax"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise & copy"),
    ("aten::copy_", "elementwise & copy"),
    ("Memset (Device)", OTHER),
])
def test_each_name_goes_to_its_kind_of_work(name, kind):
    assert categorize(name) == kind


def test_the_categories_are_moe_plans_kinds_of_work_and_other():
    """What a profile is summed into is what moe-plan's step is split into (launch.plan.kinds), each kind once, plus
    "other" for the names no pattern matches."""
    names = [name for name, _ in CATEGORIES]
    assert sorted(names) == sorted(WORK_KINDS) and OTHER not in WORK_KINDS


def test_a_trainer_runs_last_step_is_profiled_and_its_kinds_add_up():
    """3 steps of a shrunk tiny-1proc on the CPU, the last under the profiler (ProfiledFeed at step 2): the
    breakdown holds the experts' GEMM, the dense GEMMs and the optimizer, and its kinds sum to its total."""
    cfg = load_config("configs/tiny-1proc.toml", [*SMALL, "train.steps=3", "train.run_dir='/tmp/unused'"])
    device = torch.device("cpu")
    feed = ProfiledFeed(RandomFeed(cfg, device), 2, device)
    records = train(cfg, progress=False, device=device, feed=feed, checkpoints=False)
    got = feed.stop()
    assert len(records) == 3 and feed.calls == 3
    assert got["measured"] == "operators' self CPU time"
    assert {"expert GEMM", "GEMM", "optimizer", "routing & permute"} <= set(got["ms"])
    assert set(got["ms"]) <= {name for name, _ in CATEGORIES} | {OTHER}
    assert sum(got["ms"].values()) == pytest.approx(got["total_ms"])
    assert all(item["category"] == categorize(item["name"]) for item in got["top"])


def test_a_feed_whose_profiled_step_never_came_reports_none():
    device = torch.device("cpu")
    cfg = load_config("configs/tiny-1proc.toml", SMALL)
    feed = ProfiledFeed(RandomFeed(cfg, device), 5, device)
    feed.next_step()
    assert feed.stop() is None
