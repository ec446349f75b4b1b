"""Probe run in its own process: anonymous RSS growth of one rank's model build (rank 0 of a pp2 x dp4 ep4
layout under the fake process group, on the CPU) beside the full model's and the rank's parameter bytes."""

import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from launch.bench.data import rss_anon
from launch.config.run import build_config
from launch.parallel.mesh import Mesh
from launch.train.build import build_model
from moe.model import MoETransformer

CONFIG = {
    "model": {"vocab_size": 256, "hidden_size": 256, "num_layers": 8, "num_heads": 4, "num_kv_heads": 2,
              "first_k_dense": 1, "dense_ffn_size": 512, "num_experts": 32, "expert_ffn_size": 256, "top_k": 2},
    "train": {"micro_batch_size": 1, "grad_accum_steps": 8, "seq_len": 64},
    "parallel": {"pp": 2, "dp": 4, "ep": 4, "schedule": "1f1b"},
}


def main() -> None:
    cfg = build_config(CONFIG)
    with torch.device("meta"):
        full = sum(t.nbytes for t in MoETransformer(cfg.model).state_dict().values())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.parallel.world_size)
    mesh = Mesh(cfg.layout)
    before = rss_anon()
    stages, _ = build_model(cfg, mesh, torch.device("cpu"))
    growth = rss_anon() - before
    held = sum(t.nbytes for s in stages for t in s.state_dict().values())
    json.dump({"growth": growth, "full": full, "rank": held}, sys.stdout)


if __name__ == "__main__":
    main()
