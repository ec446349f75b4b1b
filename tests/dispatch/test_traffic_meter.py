"""TrafficMeter's counts from the device (a device-split exchange's rows): kept unread, added up on the device for
the step's statistics, read once when a caller reads the host counters, and logged under deferred() like host counts."""

from __future__ import annotations

import torch

from dispatch.traffic import FIELDS, Traffic, TrafficMeter, deferred, redo
from tests.syncs import SyncDetector

KINDS = ("dispatch", "combine")


def test_device_rows_are_added_up_on_the_device_without_a_read_and_read_once_later():
    meter = TrafficMeter()
    meter.start("dispatch")
    meter.add("dispatch", True, "meta", 8, 1, "ep")  # a host count beside them
    rows = torch.tensor([3, 0, 5])
    with SyncDetector() as detector:
        meter.add_rows("dispatch", "payload", rows, 10, [1, 2, 3], [True, False, True], "ep")
        rows.fill_(100)  # the counts are kept as they were when counted
        by_kind, sent = meter.tables(KINDS, 4, torch.device("cpu"))
    assert detector.kinds() == []
    assert by_kind[0].tolist() == [0, 80, 0, 8] and by_kind[1].tolist() == [0] * len(FIELDS)
    assert sent.tolist() == [0, 38, 0, 50]
    assert meter.total["dispatch"] == Traffic(0, 80, 0, 8) == meter.last["dispatch"]
    assert meter.sent_to == {1: 38, 2: 0, 3: 50} and meter.by_hop["ep"]["dispatch"] == Traffic(0, 80, 0, 8)


def test_a_new_call_and_clear_drop_device_rows_from_last_and_from_the_totals():
    meter = TrafficMeter()
    meter.start("combine")
    meter.add_rows("combine", "payload", torch.tensor([2]), 4, [1], [False])
    meter.clear()  # a new step: the totals forget them, the latest call keeps them
    assert meter.last["combine"] == Traffic(intra_payload=8) and meter.total == {}
    meter.add_rows("combine", "payload", torch.tensor([1]), 4, [1], [False])
    meter.start("combine")  # a new call: last forgets them, the totals keep them
    assert meter.last["combine"] == Traffic() and meter.total["combine"] == Traffic(intra_payload=4)
    by_kind, _ = meter.tables(KINDS, 2, torch.device("cpu"))
    assert by_kind.sum().item() == 4


def test_deferred_device_rows_count_at_each_redo_what_that_replay_left():
    meter = TrafficMeter()
    rows = torch.tensor([1])
    with deferred() as log:  # a graph's capture: counted nothing
        meter.start("dispatch")
        meter.add_rows("dispatch", "payload", rows, 2, [1], [True])
    assert meter.total == {}
    for replayed in (3, 5):
        rows.fill_(replayed)  # what the replay wrote into the captured counts
        redo(log)
        assert meter.last["dispatch"] == Traffic(inter_payload=2 * replayed)
    assert meter.total["dispatch"] == Traffic(inter_payload=16)
