"""Which FP8 grouped GEMM runs: the Gluon kernels only where they can (CUDA sm_90 with Gluon), the `tl` reference
elsewhere; train.fp8_gemm / $MOE_FP8_GEMM force either, bad values fail early naming the key."""

import pytest
import torch

from kernels import backend, ops


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.delenv(backend.GEMM_ENV, raising=False)
    yield
    backend.set_gemm_kernels("reference")


def test_auto_takes_the_fast_kernels_only_where_they_run(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setattr(backend, "fast_gemm_runs_on", lambda t: True)
    assert not backend.use_fast_gemm(cpu)  # the default, "reference", until the GPU check has run them (issue 47)
    backend.set_gemm_kernels("auto")
    assert backend.use_fast_gemm(cpu)
    monkeypatch.setattr(backend, "fast_gemm_runs_on", lambda t: False)
    assert not backend.use_fast_gemm(cpu)
    monkeypatch.setattr(backend, "fast_gemm_runs_on", lambda t: True)
    backend.set_gemm_kernels("reference")
    assert not backend.use_fast_gemm(cpu)
    monkeypatch.setenv(backend.GEMM_ENV, "auto")  # the environment overrides the config
    assert backend.use_fast_gemm(cpu)


def test_fast_where_it_cannot_run_and_bad_values_are_errors(monkeypatch):
    backend.set_gemm_kernels("fast")
    with pytest.raises(ValueError, match="needs a CUDA sm_90 GPU"):
        backend.use_fast_gemm(torch.zeros(1))
    with pytest.raises(ValueError, match="train.fp8_gemm must be one of auto, fast, reference, got 'quick'"):
        backend.set_gemm_kernels("quick")
    monkeypatch.setenv(backend.GEMM_ENV, "gluon")
    with pytest.raises(ValueError, match=r"\$MOE_FP8_GEMM must be one of auto, fast, reference"):
        backend.use_fast_gemm(torch.zeros(1))


def test_run_dispatches_the_three_gemms_to_the_fast_kernels(monkeypatch):
    """ops.run imports FAST_KERNELS' module where use_fast_gemm says so (here a stand-in module), the `tl` one
    otherwise; the other ops never switch."""
    called = []
    monkeypatch.setattr(ops, "use_triton", lambda t, b: True)
    monkeypatch.setattr(ops, "use_fast_gemm", lambda t: True)
    names = ("mgrouped_gemm", "mgrouped_dgrad", "kgrouped_gemm", "quantize_weight")
    monkeypatch.setattr(ops.importlib, "import_module",
                        lambda name: type("M", (), {n: staticmethod(lambda *a, n=n: called.append((name, n)))
                                                    for n in names}))
    x = torch.zeros(1)
    for op in ("gemm", "dgrad", "wgrad", "quantize_weight"):
        ops.run(op, None, x)
    assert called == [("kernels.gluon_ops", "mgrouped_gemm"), ("kernels.gluon_ops", "mgrouped_dgrad"),
                      ("kernels.gluon_ops", "kgrouped_gemm"), ("kernels.triton_quant", "quantize_weight")]


def test_gpu_check_says_what_it_needs_and_covers_the_edge_cases(capsys):
    """kernels.gpu_check (the GPU slice's first command) refuses to run without sm_90 + Gluon (exit 2); its edge cases
    hold empty groups, a 1-row group, partial tiles, no rows at all and a 4093-row group for all three ops."""
    from kernels import gpu_check

    assert gpu_check.main(["--quick"]) == 2 and "needs a CUDA sm_90 GPU" in capsys.readouterr().out
    for op in ("forward", "dgrad", "wgrad"):
        sizes = [s for o, _, _, case in gpu_check.EDGE_CASES if o == op for s in case]
        assert {0, 1, 4093} <= set(sizes) and any(s % 128 for s in sizes)
        assert (op, 128, 256, (0, 0)) in gpu_check.EDGE_CASES
