"""Equal work, equal pay, at unit level on the Scoreboard.

Each test reproduces a case tried on the exponential-average scoreboard (all fail on it):

* ``make localnet`` 3 x 2: the replicas of each stage ended with identical verified work but final
  weights up to 2.5x apart, depending on which lane's last steps fell in which tempo;
* a miner that no validator evaluated for 8 tempos kept publishing at the same weight share;
* with no miner evaluated for 5 tempos, identical weights were republished every tempo.

And the acceptance: each pair of replicas ends with a weight ratio within 10 % of its
verified-work ratio, and keeps it while the scores decay after the run.
"""
from __future__ import annotations

import random

import pytest

from iota_subnet.validator.scoring import Ledger, Scoreboard, with_burn

SHARES = [0.3, 0.3, 0.4]


def simulate(seed: int, *, steps: int = 150, step_s: tuple[float, float] = (6.0, 8.0), tempo_s: float = 20.0,
             extra: dict | None = None, after: int = 6, lane_speed: tuple[float, float] = (1.0, 1.0)):
    """A localnet-like run: 3 stages x 2 lanes; lane l's step k credits every member 2048 tokens x
    stage share when it completes (step times drawn per lane, lane 1 possibly slower); one scoreboard
    update per tempo until ``after`` tempos past the last step, naming the members of lanes that
    finished their steps as unrouted (as the validator service does). ``extra``: (stage, lane) ->
    work multiplier (a replica that served more hops). Returns (board, ledger, weights per tempo)."""
    rng = random.Random(seed)
    led = Ledger(SHARES)
    events = []
    for lane in range(2):
        t = rng.uniform(0, 5)
        for k in range(steps):
            t += rng.uniform(*step_s) * lane_speed[lane]
            events.append((t, lane))
    events.sort()
    end = events[-1][0]
    board = Scoreboard()
    current = {}
    hist = []
    i = 0
    done = [0, 0]
    tempo_end = tempo_s
    while tempo_end < end + (after + 1) * tempo_s:
        while i < len(events) and events[i][0] <= tempo_end:
            _, lane = events[i]
            for s in range(3):
                uid = 1 + s * 2 + lane
                current[uid] = f"hk{uid}"
                mult = (extra or {}).get((s, lane), 1.0)
                rec = led.record(uid, f"hk{uid}", s)
                rec.work += 2048 * SHARES[s] * mult
            done[lane] += 1
            i += 1
        board.update(led, unrouted=[(1 + s * 2 + lane, f"hk{1 + s * 2 + lane}") for lane in range(2)
                                    if done[lane] >= steps for s in range(3)])
        hist.append(board.weights(SHARES, current))
        tempo_end += tempo_s
    return board, led, hist


def pair_ratios(led: Ledger, w: dict) -> list[tuple[float, float]]:
    """(weight ratio, verified-work ratio) of each stage's replica pair."""
    out = []
    for s in range(3):
        a, b = 1 + 2 * s, 2 + 2 * s
        work = led.records[(a, f"hk{a}")].work / led.records[(b, f"hk{b}")].work
        out.append((w[a] / w[b], work))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_equal_verified_work_earns_equal_weight_and_decays_alike(seed):
    board, led, hist = simulate(seed)
    final = hist[-1]
    for wr, kr in pair_ratios(led, final):
        assert kr == pytest.approx(1.0)                       # identical verified work
        assert abs(wr / kr - 1) <= 0.10, (seed, pair_ratios(led, final))
    # after the run: every tempo the weights shrink (stale, the rest burned) but keep their ratios
    post = hist[-4:]
    sums = [sum(w.values()) for w in post]
    assert all(b < a for a, b in zip(sums, sums[1:])) and sums[-1] < 0.5
    for w in post:
        for wr, kr in pair_ratios(led, w):
            assert abs(wr / kr - 1) <= 0.10
    assert all(e.stale for e in board.entries.values())


@pytest.mark.parametrize("seed", range(3))
def test_weight_ratio_follows_verified_work_ratio(seed):
    # one replica of each stage served 30 % more hops (reroutes); lane 1 is 5 % slower
    board, led, hist = simulate(seed, extra={(0, 0): 1.3, (1, 1): 1.3, (2, 0): 1.3}, lane_speed=(1.0, 1.05))
    for w in hist[-5:]:
        for wr, kr in pair_ratios(led, w):
            assert abs(wr / kr - 1) <= 0.10, (seed, pair_ratios(led, w))


def test_miner_not_evaluated_loses_its_share():
    """Tried: a miner no validator evaluated for 8 tempos kept publishing at the same share (0.4)."""
    led = Ledger([1.0])
    cur = {1: "a", 2: "b", 3: "c"}
    board = Scoreboard()
    shares = []
    for t in range(20):
        for uid, hk in cur.items():
            if uid != 3 or t < 10:            # uid 3 is not evaluated any more from tempo 10 on
                led.record(uid, hk, 0).work += 4.0 if uid == 3 else 3.0
        board.update(led)
        shares.append(board.weights([1.0], cur).get(3, 0.0))
    assert shares[9] == pytest.approx(0.4)
    assert shares[9 + board.grace] == pytest.approx(0.4)          # the grace tempos are free
    for k in range(board.grace + 1, 9):           # then its score halves every tempo (its share a bit less)
        assert shares[9 + k] < shares[9 + k - 1] * 0.65
    assert shares[17] < 0.4 / 2 ** (8 - board.grace - 1)
    e = board.entries[(3, "c")]
    assert e.stale and e.lag == 10 and any("stale" in w for w in e.why)
    # its lost share went to the replicas that do the stage's work now
    w = board.weights([1.0], cur)
    assert sum(w.values()) == pytest.approx(1.0) and w[1] == pytest.approx(w[2])


def test_nobody_evaluated_weights_are_not_republished_as_current():
    """Tried: with no miner evaluated for 5 tempos, identical weights were republished every tempo."""
    led = Ledger([0.5, 0.5])
    cur = {1: "a", 2: "b"}
    board = Scoreboard()
    for _ in range(5):
        led.record(1, "a", 0).work += 3.0
        led.record(2, "b", 1).work += 3.0
        board.update(led)
    published = []
    for _ in range(5):                          # nothing verified any more
        board.update(led)
        published.append(with_burn(board.weights([0.5, 0.5], cur), burn_uid=0))
    assert all(abs(sum(w.values()) - 1.0) < 1e-9 for w in published)
    assert published[1] == published[0]          # inside the grace tempos
    for a, b in zip(published[1:], published[2:]):
        assert b != a and b[1] < a[1] and b[0] > a.get(0, 0.0)   # stale: it costs weight, the rest is burned
    assert all(e.stale and e.freshness < 1 for e in board.entries.values())
    assert published[-1][1] == pytest.approx(published[-1][2])           # alike


def test_finished_lanes_do_not_count_as_missing():
    """A lane the validator finished driving (its steps are done) is not stale while other lanes run."""
    led = Ledger([1.0])
    cur = {1: "a", 2: "b"}
    board = Scoreboard()
    for t in range(12):
        led.record(1, "a", 0).work += 3.0
        if t < 4:
            led.record(2, "b", 0).work += 3.0
        board.update(led, unrouted=[(2, "b")] if t >= 4 else [])
    assert not board.entries[(2, "b")].stale
    w = board.weights([1.0], cur)
    assert w[1] == pytest.approx(w[2])


def test_with_burn():
    assert with_burn({1: 0.25, 2: 0.25}, 0) == {1: 0.25, 2: 0.25, 0: 0.5}
    assert with_burn({1: 0.5, 2: 0.5}, 0) == {1: 0.5, 2: 0.5}
    assert with_burn({}, 7) == {7: 1.0}
    assert with_burn({1: 0.25}, None) == {1: 0.25}


def test_every_lane_stalled_for_two_tempos_decays_weights_to_burn():
    """Tried: a lane stuck on a miner whose output was refused, the other lane stuck on a NaN tail:
    both lanes stood still for 300 s, yet micro-batches of the stuck steps still credited a little
    work, so no score went quiet and the renormalised weights paid the sender a normal share."""
    led = Ledger([0.5, 0.5])
    cur = {1: "a", 2: "b", 3: "c"}
    board = Scoreboard()
    for _ in range(4):                          # lanes progress
        for uid, hk, s in ((1, "a", 0), (2, "b", 0), (3, "c", 1)):
            led.record(uid, hk, s).work += 3.0
        board.update(led, lanes_stalled=False)
    full = with_burn(board.weights([0.5, 0.5], cur), burn_uid=0)
    assert full.get(0, 0.0) == pytest.approx(0.0, abs=1e-9)
    published = []
    for _ in range(4):                          # every lane stalled; a trickle of work still verified
        led.record(3, "c", 1).work += 0.5
        board.update(led, lanes_stalled=True)
        published.append(with_burn(board.weights([0.5, 0.5], cur), burn_uid=0))
    assert board.quiet == 0 and board.stalled == 4
    assert published[0].get(0, 0.0) == pytest.approx(0.0, abs=1e-9)     # one stalled tempo is free
    for a, b in zip(published, published[1:]):                           # from the second: decay to burn
        assert b[0] > a.get(0, 0.0) and all(b[u] < a[u] for u in (1, 2, 3))
    assert published[-1][0] >= 0.85
    for uid, hk, s in ((1, "a", 0), (2, "b", 0), (3, "c", 1)):         # the lanes move again: full weights
        led.record(uid, hk, s).work += 3.0
    board.update(led, lanes_stalled=False)
    assert board.stalled == 0 and sum(board.weights([0.5, 0.5], cur).values()) == pytest.approx(1.0)
    assert Scoreboard.from_dict(board.to_dict()).stalled == 0


def test_the_validator_counts_a_tempo_stalled_only_while_it_drives_unfinished_lanes():
    from iota_subnet.validator.pacing import StallWatch
    t = [0.0]
    watch = StallWatch(every=0, merge_allowance_s=60.0, clock=lambda: t[0])
    assert not watch.update(4, [2, 2], 5, driving=True)          # first update: nothing to compare with
    assert watch.update(4, [2, 2], 5, driving=True)              # no lane step since
    assert not watch.update(5, [3, 2], 5, driving=True)
    assert not watch.update(5, [5, 5], 5, driving=False)         # every lane finished: not stalled (quiet covers it)


def test_a_merge_pause_is_not_a_stall_for_as_long_as_a_merge_may_take():
    """Lanes wait at the merge gate while their replicas merge (190 s per merge of a tiny_merge stage at
    0.8 Mbit/s, dozens of localnet tempos): not stalled, so the weights do not decay to burn; past the
    merge's allowance, or away from a merge boundary, a tempo without a lane step is stalled."""
    from iota_subnet.validator.pacing import StallWatch
    t = [0.0]
    watch = StallWatch(every=10, merge_allowance_s=300.0, clock=lambda: t[0])
    assert not watch.update(20, [10, 10], 20, driving=True)      # both lanes' next step opens a window
    for t[0] in (50.0, 150.0, 290.0):
        assert not watch.update(20, [10, 10], 20, driving=True) and watch.paused   # merging
    t[0] = 310.0
    assert watch.update(20, [10, 10], 20, driving=True) and not watch.paused      # longer than any merge may take
    t[0] = 320.0
    assert not watch.update(22, [11, 11], 20, driving=True)      # trained on
    t[0] = 330.0
    assert watch.update(22, [11, 11], 20, driving=True)          # inside a window: stalled
    assert not StallWatch(every=10, merge_allowance_s=1e9).merging([20, 20], 20)   # the run's end is no merge


def test_tempos_of_a_merge_pause_leave_the_scores_as_they_were():
    """Before: a 190 s merge spanned ~38 localnet tempos without verified work ("quiet"), and every
    miner's weight decayed to 0.0003 (the rest burned) though every merge applied."""
    led = Ledger([0.5, 0.5])
    cur = {1: "a", 2: "b"}
    board = Scoreboard()
    led.record(1, "a", 0).work = 100.0
    led.record(2, "b", 1).work = 100.0
    board.update(led)
    before = board.weights([0.5, 0.5], cur)
    for _ in range(30):
        board.update(led, paused=True)
    assert board.quiet == 0 and board.weights([0.5, 0.5], cur) == pytest.approx(before)
    assert sum(before.values()) == pytest.approx(1.0)
    for _ in range(4):
        board.update(led)                                # not a merge: quiet tempos decay as before
    assert sum(board.weights([0.5, 0.5], cur).values()) < 0.5
