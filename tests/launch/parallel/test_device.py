"""One device per rank from train.device: cuda:LOCAL_RANK and NCCL when CUDA is there (checked with CUDA
reported available, without running on it), the CPU and gloo otherwise; bad requests refused before spawn."""

import pytest
import torch

from launch.parallel.device import backend_for, check_device, rank_device, to_host
from launch.train_cli import main

TINY = "configs/tiny.toml"


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch reports `count` CUDA GPUs of compute capability `capability` (nothing runs on them)."""
    def install(count: int = 8, capability: tuple[int, int] = (9, 0)) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    return install


def test_cuda_ranks_take_their_local_gpu_and_nccl(fake_cuda):
    fake_cuda()
    assert rank_device("auto", {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert rank_device("cuda", {"LOCAL_RANK": "7"}) == torch.device("cuda", 7)
    assert rank_device("cpu", {"LOCAL_RANK": "3"}) == torch.device("cpu")
    assert backend_for("auto", "auto") == "nccl" and backend_for("cpu", "auto") == "gloo"
    check_device("auto", "auto", "fp8", local_ranks=8)  # 8 Hopper GPUs hold 8 FP8 ranks


def test_cpu_machine_runs_on_cpu_and_gloo():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert rank_device("auto", {"LOCAL_RANK": "1"}) == torch.device("cpu")
    assert backend_for("auto", "auto") == "gloo"


@pytest.mark.parametrize("setting, backend, precision, gpus, capability, ranks, words", [
    ("cuda", "auto", "native", 0, (9, 0), 1, ["train.device = 'cuda'", "no CUDA GPU"]),
    ("cpu", "nccl", "native", 8, (9, 0), 1, ["parallel.comm_backend = 'nccl'", "'gloo'"]),
    ("auto", "auto", "native", 2, (9, 0), 4, ["4 ranks on this node", "2 GPUs visible"]),
    ("cuda", "auto", "fp8", 8, (8, 0), 8, ["model.expert_precision = 'fp8'", ">= 8.9", "8.0", "'native'"]),
])
def test_bad_device_requests_name_the_field_and_numbers(fake_cuda, setting, backend, precision, gpus, capability,
                                                        ranks, words):
    if gpus:
        fake_cuda(gpus, capability)
    elif torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError) as error:
        check_device(setting, backend, precision, local_ranks=ranks)
    for word in words:
        assert word in str(error.value)


def test_moe_train_refuses_cuda_without_gpus_before_spawning(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--config", TINY, "--set", "train.device=cuda"]) == 2
    assert "train.device = 'cuda'" in capsys.readouterr().err


def test_moe_train_refuses_more_ranks_than_gpus_before_spawning(fake_cuda, capsys, tmp_path):
    fake_cuda(count=2)
    code = main(["--config", TINY, "--run-dir", str(tmp_path), "--set", "parallel.comm_backend=gloo"],
                trainer=lambda *a, **k: pytest.fail("a rank started"))
    assert code == 2
    assert "4 ranks on this node but 2 GPUs visible" in capsys.readouterr().err


def test_cuda_graphs_off_cuda_are_refused_before_spawning(fake_cuda, capsys, tmp_path):
    """train.cuda_graphs (issue 48) captures CUDA graphs: ranks on the CPU (forced, or auto without a GPU) are refused
    naming the key and why, before any rank starts; with CUDA GPUs the device check passes."""
    with pytest.raises(ValueError, match=r"train.cuda_graphs = true .* train.device = 'cpu' puts the ranks on the CPU"):
        check_device("cpu", "auto", "native", cuda_graphs=True)
    padded = ["--set", "parallel.dispatch_exchange=padded", "--set", "train.cuda_graphs=true"]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"train.device = 'auto' resolves to the CPU \(this torch sees no CUDA"):
            check_device("auto", "auto", "native", cuda_graphs=True)
        code = main(["--config", TINY, "--run-dir", str(tmp_path), *padded],
                    trainer=lambda *a, **k: pytest.fail("a rank started"))
        assert code == 2 and "train.cuda_graphs = true" in capsys.readouterr().err
    fake_cuda()
    check_device("auto", "auto", "native", local_ranks=4, cuda_graphs=True)


def test_host_copy_of_meta_reads_zeros_and_real_values_cross_unchanged():
    assert to_host(torch.empty(3, device="meta")).tolist() == [0.0, 0.0, 0.0]
    assert to_host(torch.tensor([1.5, -2.0])).tolist() == [1.5, -2.0]
