"""Schedules as data and the simulator: bubble formulas, peak activations, validity, CLI."""

from __future__ import annotations

import pytest

from pipeline import Costs, Op, build, dualpipe, dualpipev, one_f_one_b, simulate, with_communication, zb1p
from pipeline.simulator import main as simulate_main

# Unequal F, B, W, F&B with the input-grad part of B (B - W) as long as F: the regime in which
# DeepSeek's table is exact (elsewhere the simulated DualPipe bubble departs from it).
COSTS = [Costs(1.3, 2.0, 0.7, 2.9), Costs(2.0, 3.0, 1.0, 4.5), Costs(1.0, 1.6, 0.6, 2.6)]
PPS = (4, 8, 16)


def _chunk_counts(pp: int) -> tuple[int, ...]:
    return (2 * pp, 2 * pp + 2, 3 * pp)


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("c", COSTS)
def test_1f1b_and_zb1p_bubbles(pp: int, c: Costs) -> None:
    for chunks in _chunk_counts(pp):
        assert simulate(one_f_one_b(pp, chunks), c).bubble == pytest.approx((pp - 1) * (c.f + c.b))
        assert simulate(zb1p(pp, chunks), c).bubble == pytest.approx((pp - 1) * (c.f + c.b - 2 * c.w))


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("c", COSTS)
def test_dualpipe_and_dualpipev_bubbles(pp: int, c: Costs) -> None:
    want = (pp / 2 - 1) * (c.fb + c.b - 3 * c.w)
    for chunks in _chunk_counts(pp):
        assert simulate(dualpipe(pp, chunks), c).bubble == pytest.approx(want)
        assert simulate(dualpipev(pp // 2, chunks), c).bubble == pytest.approx(want)


@pytest.mark.parametrize("pp", PPS)
def test_peak_activations_and_param_copies(pp: int) -> None:
    c = COSTS[0]
    for chunks in _chunk_counts(pp):
        dp, dpv = simulate(dualpipe(pp, chunks), c), simulate(dualpipev(pp // 2, chunks), c)
        assert max(dp.peak_activations) == pp + 1
        assert max(dpv.peak_activations) == pp + 1
        assert dp.param_copies == dpv.param_copies == 2
        assert max(simulate(one_f_one_b(pp, chunks), c).peak_activations) == pp
        assert simulate(zb1p(pp, chunks), c).param_copies == 1


@pytest.mark.parametrize("name,ranks", [("1f1b", 4), ("zb1p", 4), ("dualpipe", 4), ("dualpipev", 2)])
def test_every_chunk_passes_every_stage_once(name: str, ranks: int) -> None:
    sched = build(name, ranks, 10 if name != "dualpipe" else 8)
    layout = sched.layout
    seen = {op: set() for op in (Op.F, Op.B, Op.W)}
    for rank in range(ranks):
        for act in sched.compute_actions(rank):
            for half in act.halves():
                key = (layout.stage_of(rank, half.phase), half.chunk)
                assert key not in seen[half.op]
                seen[half.op].add(key)
    full = {(s, ch) for s in range(layout.num_stages) for ch in range(layout.num_chunks)}
    assert seen[Op.F] == full and seen[Op.B] == full
    split = {(layout.stage_of(r, a.phase), a.chunk) for r in range(ranks)
             for act in sched.compute_actions(r) for a in act.halves() if a.op is Op.B and a.split}
    assert seen[Op.W] == split


def test_without_split_removes_w_and_costs_more() -> None:
    c = COSTS[0]
    split, fused = build("dualpipev", 4, 16), build("dualpipev", 4, 16, split_bw=False)
    assert not any(a.op is Op.W for r in range(4) for a in fused.compute_actions(r))
    assert simulate(fused, c).makespan > simulate(split, c).makespan


def test_communication_pairs_match() -> None:
    sched = with_communication(dualpipe(4, 8))
    sends = {(r, a.peer, a.op.value[-1], a.phase, a.chunk) for r, acts in enumerate(sched.actions)
             for a in acts if a.op in (Op.SEND_F, Op.SEND_B)}
    recvs = {(a.peer, r, a.op.value[-1], a.phase, a.chunk) for r, acts in enumerate(sched.actions)
             for a in acts if a.op in (Op.RECV_F, Op.RECV_B)}
    # a forward of phase p arrives as phase p on the next rank in DualPipe (both copies share a direction)
    assert sends == recvs and len(sends) == 2 * 3 * 8


@pytest.mark.parametrize("call,match", [
    (lambda: dualpipe(3, 12), "even number of ranks"),
    (lambda: dualpipe(4, 6), "too few"),
    (lambda: dualpipe(4, 9), "even"),
    (lambda: dualpipev(2, 3), "too few"),
    (lambda: build("gpipe", 2, 4), "choose one of"),
])
def test_bad_schedule_arguments(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_cli_prints_timeline_and_writes_svg(tmp_path, capsys) -> None:
    svg = tmp_path / "t.svg"
    assert simulate_main(["--schedule", "dualpipev", "--pp", "8", "--chunks", "16", "--f", "1", "--b", "2",
                          "--w", "1", "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "bubble(max rank idle)=" in out and out.count("rank ") >= 4
    boxes = sum(len(build("dualpipev", 4, 16).compute_actions(r)) for r in range(4))
    assert svg.read_text().startswith("<svg") and svg.read_text().count("<rect") == boxes
