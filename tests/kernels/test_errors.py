"""Bad input fails early with a ValueError that names the argument and what is allowed."""

import pytest
import torch

import kernels
from tests.kernels.helpers import inputs, offsets

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def operands():
    x, w, dy, offs = inputs([3, 0, 5], 256, 128)
    return {"x": x, "w": w, "dy": dy, "offs": offs, "a": kernels.quantize_activation(x),
            "b": kernels.quantize_weight(w), "dy_q": kernels.quantize_activation(dy)}


def gemm(ops, **change):
    args = {"a": ops["a"][0], "a_scale": ops["a"][1], "b": ops["b"][0], "b_scale": ops["b"][1],
            "offs": ops["offs"], **change}
    return kernels.fp8_grouped_gemm(**args)


@pytest.mark.parametrize("change,message", [
    ({"a": torch.zeros(8, 256)}, "a has dtype torch.float32; allowed: float8_e4m3fn"),
    ({"b": torch.zeros(3, 128, 256, dtype=torch.bfloat16)}, "b has dtype torch.bfloat16; allowed: float8_e4m3fn"),
    ({"b": torch.zeros(3, 128, 192, dtype=FP8)},
     r"reduction size mismatch: a.shape\[1\] is 256 but b.shape\[2\] is 192"),
    ({"a_scale": torch.ones(8, 3)}, r"a_scale must have shape \(8, 2\), got \(8, 3\)"),
    ({"b_scale": torch.ones(3, 1, 2, dtype=torch.float64)}, "b_scale has dtype torch.float64; allowed: float32"),
    ({"offs": torch.tensor([3, 3, 8])}, "offs has dtype torch.int64; allowed: int32"),
    ({"offs": offsets([3, 5])}, "offs has 2 entries but the weights have 3 groups"),
    ({"offs": torch.tensor([5, 3, 8], dtype=torch.int32)}, r"non-decreasing .* offs\[0\] = 5 > offs\[1\] = 3"),
    ({"offs": torch.tensor([3, 3, 9], dtype=torch.int32)},
     r"offs must end at most at the number of rows M = 8 \(rows past offs\[-1\] are padding\), got offs\[-1\] = 9"),
    ({"offs": torch.tensor([-1, 3, 8], dtype=torch.int32)}, "offs must be non-negative"),
    ({"a": torch.zeros(8, 256, 1, dtype=FP8)}, r"a must have 2 dimensions, got shape \(8, 256, 1\)"),
])
def test_fp8_grouped_gemm_rejects(operands, change, message):
    with pytest.raises(ValueError, match=message):
        gemm(operands, **change)


def test_dgrad_checks_n_against_the_weight(operands):
    dy_q, dy_scale = kernels.quantize_activation(torch.randn(8, 96))
    w_t, w_scale = kernels.quantize_weight(operands["w"], transposed=True)
    with pytest.raises(ValueError, match=r"dy.shape\[1\] is 96 but w_t.shape\[2\] is 128"):
        kernels.fp8_grouped_gemm_dgrad(dy_q, dy_scale, w_t, w_scale, operands["offs"])
    with pytest.raises(ValueError, match=r"w_t_scale must have shape \(3, 1, 2\), got \(3, 2, 1\)"):
        kernels.fp8_grouped_gemm_dgrad(*operands["dy_q"], w_t, w_scale.transpose(1, 2), operands["offs"])


def test_triton_gemm_needs_sizes_that_are_multiples_of_16():
    x, w, _, offs = inputs([3, 0, 5], 200, 128)
    with pytest.raises(ValueError, match=r"needs both matrix sizes \(K = 200, N = 128\) to be multiples of 16"):
        kernels.fp8_grouped_linear(x, w, offs, backend="triton")


def test_wgrad_needs_the_kgrouped_layout(operands):
    offs = operands["offs"]
    dy_t = kernels.quantize_activation_kgrouped(operands["dy"], offs)
    with pytest.raises(ValueError, match=r"b_t must have 512 columns \(a k-grouped layout: .* as the other operand\)"):
        kernels.fp8_grouped_gemm_wgrad(*dy_t, *operands["a"], offs)


@pytest.mark.parametrize("call,message", [
    (lambda o: kernels.quantize_activation(torch.zeros(4, 8, dtype=torch.int32)), "x has dtype torch.int32"),
    (lambda o: kernels.quantize_activation(torch.zeros(4)), "x must have 2 dimensions"),
    (lambda o: kernels.quantize_weight(torch.zeros(4)), "w must have 2 or 3 dimensions"),
    (lambda o: kernels.quantize_activation_kgrouped(o["x"], offsets([3, 6])), "offs must end at most at the number"),
    (lambda o: kernels.fp8_grouped_linear(o["x"], o["w"][:, :, :128], o["offs"]),
     r"reduction size K mismatch: x.shape\[1\] is 256 but w.shape\[2\] is 128"),
    (lambda o: kernels.fp8_grouped_linear(o["x"], o["w"], o["offs"].float()), "offs has dtype torch.float32"),
    (lambda o: kernels.fp8_grouped_linear(o["x"].to(FP8), o["w"], o["offs"]), "x has dtype torch.float8_e4m3fn"),
    (lambda o: kernels.fp8_grouped_linear(o["x"], o["w"], [3, 3, 8]), "offs must be a torch.Tensor, got list"),
    (lambda o: kernels.quantize_activation(o["x"], backend="cuda"), "backend must be one of auto, triton, torch"),
])
def test_other_entry_points_reject(operands, call, message):
    with pytest.raises(ValueError, match=message):
        call(operands)
