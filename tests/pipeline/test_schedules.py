"""Schedules as data and the simulator: bubble formulas, peak activations, validity, CLI."""

from __future__ import annotations

import random

import pytest

from pipeline import (Costs, Op, afab, build, dualpipe, dualpipev, merge_weight_grads, min_chunks, one_f_one_b,
                      simulate, with_communication, zb1p)
from pipeline.schedules import Schedule
from pipeline.simulator import main as simulate_main
from pipeline.simulator import simulate_shared

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
def test_afab_has_1f1b_bubble_and_holds_every_chunk(pp: int, c: Costs) -> None:
    """GPipe: every rank runs all forwards, then all backwards; the bubble is (PP-1)(F+B) like 1F1B's, but each
    rank holds the activations of every chunk at once (1F1B: PP - r)."""
    for chunks in _chunk_counts(pp):
        result = simulate(afab(pp, chunks), c)
        assert result.bubble == pytest.approx((pp - 1) * (c.f + c.b))
        assert result.peak_activations == [chunks] * pp
        for rank in range(pp):
            ops = [a.op for a in afab(pp, chunks).compute_actions(rank)]
            assert ops == [Op.F] * chunks + [Op.B] * chunks


def test_min_chunks_fill_the_pipeline() -> None:
    assert [min_chunks(name, 4) for name in ("afab", "1f1b", "zb1p", "dualpipe", "dualpipev")] == [4, 4, 4, 8, 8]
    for name in ("afab", "1f1b", "zb1p", "dualpipev"):
        build(name, 4, min_chunks(name, 4))  # each builder takes its minimum


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


@pytest.mark.parametrize("name,ranks,merge", [("afab", 4, 1), ("afab", 4, 3), ("1f1b", 4, 1), ("zb1p", 4, 1), ("dualpipe", 4, 1), ("dualpipev", 2, 1),
                                              ("dualpipe", 4, 3), ("dualpipev", 2, 4), ("dualpipev", 2, 10)])
def test_every_chunk_passes_every_stage_once(name: str, ranks: int, merge: int) -> None:
    sched = build(name, ranks, 10 if name != "dualpipe" else 8)
    sched = merge_weight_grads(sched, merge) if merge > 1 else sched
    layout = sched.layout
    seen = {op: set() for op in (Op.F, Op.B, Op.W)}
    for rank in range(ranks):
        for act in sched.compute_actions(rank):
            for half in act.halves():
                for chunk in half.chunks:
                    key = (layout.stage_of(rank, half.phase), chunk)
                    assert key not in seen[half.op]
                    seen[half.op].add(key)
    full = {(s, ch) for s in range(layout.num_stages) for ch in range(layout.num_chunks)}
    assert seen[Op.F] == full and seen[Op.B] == full
    split = {(layout.stage_of(r, a.phase), a.chunk) for r in range(ranks)
             for act in sched.compute_actions(r) for a in act.halves() if a.op is Op.B and a.split}
    assert seen[Op.W] == split


@pytest.mark.parametrize("name,ranks,chunks", [("dualpipe", 2, 8), ("dualpipe", 4, 10), ("dualpipev", 2, 8),
                                               ("dualpipev", 4, 9)])
@pytest.mark.parametrize("group", [2, 3, 100])
def test_merged_w_follows_its_backwards_in_groups_of_consecutive_chunks(name: str, ranks: int, chunks: int,
                                                                        group: int) -> None:
    plain = build(name, ranks, chunks)
    merged = merge_weight_grads(plain, group)
    for rank in range(ranks):
        acts = merged.compute_actions(rank)
        backs = [(h.phase, h.chunk) for a in acts for h in a.halves() if h.op is Op.B]
        assert all(h.split for a in acts for h in a.halves() if h.op is Op.B)
        assert backs == [(h.phase, h.chunk) for a in plain.compute_actions(rank) for h in a.halves() if h.op is Op.B]
        for i, act in enumerate(a for a in acts if a.op is Op.W):
            order = [c for p, c in backs if p == act.phase]
            start = order.index(act.chunk)
            assert list(act.chunks) == order[start:start + len(act.chunks)]  # consecutive backwards
            assert len(act.chunks) == min(group, len(order) - start) and start % group == 0
            done = {(h.phase, h.chunk) for a in acts[:acts.index(act)] for h in a.halves() if h.op is Op.B}
            assert {(act.phase, c) for c in act.chunks} <= done  # after every backward it covers
    # the simulator prices a merged W as its chunks' W (the same work per rank) and finds no deadlock
    c = COSTS[0]
    assert simulate(merged, c).busy == pytest.approx(simulate(plain, c).busy)


def test_merge_weight_grads_rejects_a_bad_group() -> None:
    with pytest.raises(ValueError, match="integer >= 1"):
        merge_weight_grads(dualpipev(2, 4), 0)


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


def test_cli_merges_w_and_rejects_a_merge_without_split(tmp_path, capsys) -> None:
    svg = tmp_path / "m.svg"
    assert simulate_main(["--pp", "4", "--chunks", "8", "--merge-w", "4", "--svg", str(svg)]) == 0
    merged = merge_weight_grads(build("dualpipev", 2, 8), 4)
    assert svg.read_text().count("<rect") == sum(len(merged.compute_actions(r)) for r in range(2))
    assert svg.read_text().count("<title>W") == 2 * 2 * 2  # 2 ranks x 2 stages x 8/4 groups
    with pytest.raises(SystemExit):
        simulate_main(["--merge-w", "2", "--no-split"])
    assert "needs the B/W split" in capsys.readouterr().err


def test_a_pair_with_a_forward_share_runs_its_forward_on_the_forward_input_alone() -> None:
    sched, c = dualpipev(2, 8), Costs(1.0, 2.0, 0.5, 3.0, p2p=0.1)
    durations = {(r, a): c.of(a) for r in range(2) for a in sched.compute_actions(r)}
    pair = next(a for a in sched.compute_actions(0) if a.op is Op.FB and a.phase == 0)  # F0.x on stage 0
    partner = next(a for a in sched.compute_actions(1) if a.op is Op.FB and (a.phase, a.chunk) == (0, pair.chunk))
    assert (partner.backward.phase, partner.backward.chunk) == (pair.backward.phase, pair.backward.chunk)
    durations[(0, pair)] = 20.0  # rank 0's slow pair feeds both halves of its partner on rank 1

    def spans(shares: dict) -> tuple:
        result = simulate(sched, c, durations, forward_shares=shares)
        return ({s.action: s for s in result.timelines[0]}[pair], {s.action: s for s in result.timelines[1]}[partner],
                result)

    slow, waiting, _ = spans({})
    assert waiting.start == pytest.approx(slow.end + 0.1)  # one block: both inputs first, from the pair's end
    slow, waiting, result = spans({(0, pair): 0.25, (1, partner): 0.5})
    # the forward half starts on the forward's output, a quarter into the slow pair; the backward
    # half then waits for the pair's end
    assert waiting.start == pytest.approx(slow.start + 0.25 * 20.0 + 0.1)
    assert waiting.end == pytest.approx(slow.end + 0.1 + 0.5 * 3.0)
    assert result.busy[1] == pytest.approx(sum(d for (r, _), d in durations.items() if r == 1))  # the gap is idle


def _random_durations(schedule: Schedule) -> dict:
    rng = random.Random(0)
    return {(r, act): rng.uniform(1.0, 3.0) for r in range(schedule.layout.num_ranks)
            for act in schedule.compute_actions(r)}


SHARED = [afab(4, 8), one_f_one_b(4, 8), zb1p(4, 8), dualpipe(4, 8), dualpipev(2, 8)]


@pytest.mark.parametrize("schedule", SHARED, ids=lambda s: s.name)
def test_ranks_sharing_nothing_simulate_as_the_plain_simulator(schedule: Schedule) -> None:
    durations, costs = _random_durations(schedule), Costs(0.0, 0.0, p2p=0.1)
    plain = simulate(schedule, costs, durations)
    shared = simulate_shared(schedule, costs, durations, lambda n: 1.0)
    assert shared.makespan == pytest.approx(plain.makespan)
    assert shared.idle_fractions == pytest.approx(plain.idle_fractions)


@pytest.mark.parametrize("schedule", SHARED, ids=lambda s: s.name)
def test_ranks_sharing_one_processor_take_the_sum_of_all_work(schedule: Schedule) -> None:
    # one processor shared fairly by every running rank: with instant p2p some rank can always run, so the
    # processor never idles and the step lasts exactly the sum of every action's time
    durations = _random_durations(schedule)
    result = simulate_shared(schedule, Costs(0.0, 0.0), durations, lambda n: 1.0 / n)
    assert result.makespan == pytest.approx(sum(durations.values()))
