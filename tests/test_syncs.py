"""The sync detector (tests/syncs.py) sees both kinds of host read, names where each happened, and leaves
torch as it found it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dispatch.test_segment_ops import one_rank  # noqa: F401 (a fixture)
from tests.syncs import PYTHON_READS, HostRead, SyncDetector


def test_planted_python_level_reads_are_caught_once_each():
    x, three = torch.arange(6.0), torch.tensor(3)
    with SyncDetector() as detector:
        x.tolist()  # planted: a CPU .tolist() issues no operator
        x[2].item()  # planted: once, though it dispatches aten._local_scalar_dense too
        bool(x[1] > 0), int(x[3]), float(x[4])
        x.numpy()
        range(three)
    kinds = [kind for kind, _ in detector.kinds()]
    assert kinds == ["Tensor.tolist", "Tensor.item", "Tensor.__bool__", "Tensor.__int__", "Tensor.__float__",
                     "Tensor.numpy", "Tensor.__index__"]
    assert all(where.startswith("tests/test_syncs.py:") for _, where in detector.kinds())


def test_host_data_made_a_tensor_is_an_upload_but_a_cached_constant_only_once():
    """torch.tensor / as_tensor of Python data in a step (on a GPU: a waiting copy from pageable memory, and a host
    buffer a CUDA graph would capture) is caught; dispatch.layout.device_index's constant is made once and kept, its
    making exempt (EXEMPT_UPLOADS), and a later call makes nothing; inside a capture (capture=True) every upload is
    refused, dispatch.upload.upload's queued ones too."""
    from dispatch.layout import device_index
    from dispatch.upload import upload

    values = (7, 11, 13)  # a tuple no other test caches
    with SyncDetector() as detector:
        torch.tensor([1, 2])  # planted
        torch.as_tensor([3.0])  # planted
        first = device_index(values, torch.device("cpu"))
    assert [kind for kind, _ in detector.kinds()] == ["aten.lift_fresh", "aten.lift_fresh"]
    with SyncDetector(strict=True):  # nothing made: a HostRead would raise
        again = device_index(values, torch.device("cpu"))
    assert again is first and first.tolist() == list(values)
    with SyncDetector(capture=True) as detector:
        upload([1.0, 2.0], torch.float64, torch.device("cpu"))
        device_index((17, 19), torch.device("cpu"))
    assert [kind for kind, _ in detector.kinds()] == ["aten.lift_fresh", "aten.lift_fresh"]
    with SyncDetector() as detector:
        upload([1.0, 2.0], torch.float64, torch.device("cpu"))
    assert detector.kinds() == []


def test_dispatch_level_reads_are_caught_and_static_shapes_are_not():
    x = torch.tensor([0, 3, 0, 2])
    with SyncDetector() as detector:
        torch.nonzero(x)
        x[x > 0]  # a boolean mask: a nonzero inside
        torch.repeat_interleave(x)
        torch.nonzero_static(x, size=2)  # sized by the caller: no read
        torch.repeat_interleave(torch.arange(4), x, output_size=5)
        torch.zeros(2, device="meta").nonzero_static(size=1)
    assert [kind for kind, _ in detector.kinds()] == ["aten.nonzero", "aten.index", "aten.repeat_interleave"]


def test_strict_refuses_the_first_read_and_torch_is_restored():
    saved = {name: torch.Tensor.__dict__.get(name) for name in PYTHON_READS}
    with pytest.raises(HostRead, match=r"Tensor.item at tests/test_syncs.py:\d+"), SyncDetector(strict=True):
        torch.ones(1).item()
    assert {name: torch.Tensor.__dict__.get(name) for name in PYTHON_READS} == saved
    assert torch.ones(1).item() == 1.0


@pytest.mark.usefixtures("one_rank")
def test_collectives_with_list_splits_are_reads():
    x = torch.arange(4.0)
    out = torch.empty(4)
    with SyncDetector() as detector:
        dist.all_to_all_single(out, x)  # equal splits: sizes from the shapes
        dist.all_to_all_single(out, x, [4], [4])
    assert [kind for kind, _ in detector.kinds()] == ["all_to_all_single(list splits)"]
    assert dist.all_to_all_single is not None and torch.equal(out, x)
