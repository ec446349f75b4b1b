"""HostStager reuses its host buffers from one asynchronous save to the next, so it refuses to stage while the
previous save (its `saving` future) still reads them (issue 51)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from launch.checkpoint.chunks import HostStager


def test_the_stager_refuses_to_restage_under_a_save_in_flight() -> None:
    stager = HostStager()
    first = stager.stage({"w": torch.arange(4.0), "step": 3})
    stager.saving = Future()
    with pytest.raises(RuntimeError, match="still reads the host staging buffers"):
        stager.stage({"w": torch.ones(4)})
    stager.saving.set_result(None)
    again = stager.stage({"w": torch.ones(4)})
    assert again["w"].data_ptr() == first["w"].data_ptr() and torch.equal(first["w"], torch.ones(4))  # one buffer
