"""Output nobody can use is charged to the miner that sent it, and the lanes route around it.

A whole p2p network in process (3 stages x 2 replicas, real HTTP, real text): the head of lane 0
corrupts its training forwards from lane step 1 on (:mod:`iota_subnet.sim.bad_output`: its data
plane transport sends non-finite values, a wrong shape or dtype, content not matching the root it
committed); its next-stage peer refuses each hop and proves it to the validator with the sender's
signed body. In the last case a colluding tail (lane 1) also reports NaN losses. Each run checks
that every lane step completes in both lanes, the bad miners are barred with weight 0, no honest
miner is charged a failure, and the honest miners hold at least 95 % of the weights. About 10-15 s
each on 2 cores (6 network tests: about 70 s together). The localnet form, with spares and bad output
from lane step 5, is ``tests/test_bad_output_localnet.py`` (slow). The judge alone: a report proves
only bytes the sender signed for the reporter (a relay or a forger frames nobody).
"""
from __future__ import annotations

import pytest

from iota_subnet.sim.bad_output import MODES, bad_output_parts
from support.dataplane_net import P2PNet, run

pytestmark = pytest.mark.timeout(300)

STEPS = 3


async def _train_with(net: P2PNet, bad: dict[tuple[int, int], str]) -> None:
    await net.start(per_miner=lambda s, r: {"parts": bad_output_parts(bad[(s, r)], from_step=1)}
                    if (s, r) in bad else {})
    vali = net.validator(steps=STEPS)
    assert await vali.run() == 0
    st = net.status()
    assert st["done"] and st["steps_done"] == {"0": STEPS, "1": STEPS}, st
    corrupted = {k: net.miners[k].node.transport.status()["corrupted"] for k in bad}
    assert all(corrupted.values()), corrupted           # the bad miners did send bad output
    hk = {k: w.hotkey.ss58_address for k, w in net.miner_wallets.items()}
    bad_hk = {hk[k] for k in bad}
    barred = {h for _, h in st["barred"]}
    assert barred == bad_hk, (st["barred"], st["blame"])
    for (uid, h), rec in vali.ledger.records.items():
        if h not in bad_hk:
            assert rec.failures == 0, (uid, rec)
    vali.update_scores()
    w = vali.scores.board.weights(vali.ledger.shares, vali.current, exclude_uids=[vali.uid])
    uid_of = {h: u for u, h in vali.current.items()}
    assert all(w.get(uid_of[h], 0.0) == 0.0 for h in bad_hk), w
    honest = sum(v for u, v in w.items() if vali.current.get(u) not in bad_hk)
    assert w and honest / sum(w.values()) >= 0.95, w


@pytest.mark.parametrize("mode", MODES)
def test_a_head_whose_output_is_refused_is_charged_and_routed_around(mode, tmp_home, tmp_path, wikitext_path,
                                                                      cache_dir):
    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir)
        try:
            await _train_with(net, {(0, 0): f"bad-{mode}"})
        finally:
            await net.close()

    run(main(), timeout=90)


def test_a_bad_head_and_a_colluding_tail_reporting_nan_losses(tmp_home, tmp_path, wikitext_path, cache_dir):
    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir)
        try:
            await _train_with(net, {(0, 0): "bad-inf", (2, 1): "nan-loss"})
        finally:
            await net.close()

    run(main(), timeout=90)


# ------------------------------------------------------------------ the judge alone: evidence must bind the sender
import time  # noqa: E402

import torch  # noqa: E402
from bittensor import http_auth  # noqa: E402

from iota_subnet.protocol import Hop, Ticket, encode, to_wire  # noqa: E402
from iota_subnet.protocol.refusal import RefusalReport  # noqa: E402
from iota_subnet.validator.blame import judge  # noqa: E402
from iota_subnet.wallets import create_wallet  # noqa: E402


def _evidence(tmp_path, value: float = 1.0, *, signer=None, receiver=None, tamper: bool = False):
    """(report, validator, sender, receiver hotkeys): a forward hop of stage 0 -> 1 holding ``value``."""
    w = {n: create_wallet(n, "default", tmp_path / "w") for n in ("vali", "m0", "m1", "m2", "x")}
    hk = {n: x.hotkey.ss58_address for n, x in w.items()}
    now = time.time()
    t = Ticket(run_id="r", validator=hk["vali"], lane=0, step=1, index=0, microbatch_id="mb", split="train", seed=0,
               start=0, rows=2, seq_len=4, width=3, wire_dtype="bf16", train=True, micro_per_step=2,
               route=(hk["m0"], hk["m1"], hk["m2"]), alternates=(), trains=(), attempt=0, issued_at=now,
               deadline=now + 60).signed(w["vali"])
    data, _ = to_wire(torch.full((2, 4, 3), value), "bf16")
    body = encode(Hop(run_id="r", stage=1, microbatch_id="mb", ticket=t.to_json(), direction="forward",
                      path=[hk["m0"]], data=data))
    to = receiver or hk["m1"]
    auth = http_auth.sign((signer or w["m0"]).hotkey, method="POST", path="/hop", body=body, receiver_ss58=to)
    if tamper:
        body = body[:-2] + bytes([body[-2] ^ 1]) + body[-1:]
    rep = RefusalReport(run_id="r", microbatch_id="mb", sender=hk["m0"], auth=auth, outcome="NON_FINITE",
                        body=torch.frombuffer(bytearray(body), dtype=torch.uint8))
    return rep, hk


def test_the_judge_proves_only_what_the_sender_signed(tmp_path):
    rep, hk = _evidence(tmp_path, float("inf"))
    verdict, sender, t, detail = judge(rep, hk["m1"], hk["vali"])
    assert (verdict, sender) == ("proven", hk["m0"]) and "NON_FINITE" in detail
    assert judge(rep, hk["m2"], hk["vali"])[0] == "unproven"           # not signed for this reporter
    assert judge(rep, hk["m1"], hk["x"])[0] == "unknown"                # another validator's ticket
    rep, hk = _evidence(tmp_path, float("inf"), tamper=True)           # a relay changed the bytes
    assert judge(rep, hk["m1"], hk["vali"])[0] == "unproven"
    rep, hk = _evidence(tmp_path, 1.0)                                  # nothing wrong with it
    assert judge(rep, hk["m1"], hk["vali"])[0] == "unproven"


def test_a_forger_cannot_frame_a_miner(tmp_path):
    """A hop signed by someone else than the miner it names: the signature names the forger, who does
    not serve the stage before on the ticket, so nobody is charged."""
    rep, hk = _evidence(tmp_path, float("nan"), signer=create_wallet("x", "default", tmp_path / "w"))
    verdict, sender, _, _ = judge(rep, hk["m1"], hk["vali"])
    assert verdict == "unproven" and sender == hk["x"]


def test_with_every_head_barred_the_lanes_stall_and_weights_decay_to_burn(tmp_home, tmp_path, wikitext_path,
                                                                           cache_dir):
    """Both stage-0 replicas send bad output from lane step 2 on and are barred: no lane can train
    (stage 0 has nobody left to route to). The weights this validator sets (it holds the burn uid, 0)
    must decay to burn from the second stalled tempo on, not renormalise the miners' stale scores
    (before: the sender kept a normal share, 6.7 %). About 15-30 s."""
    import asyncio
    import contextlib
    import json
    import time

    from iota_subnet.validator.state import ValidatorState

    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir)
        try:
            await net.start(per_miner=lambda s, r: {"parts": bad_output_parts("bad-inf", from_step=2)}
                            if s == 0 else {})
            vali = net.validator(steps=40)
            task = asyncio.create_task(vali.run())
            rows: list[dict] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60 and not task.done():
                await asyncio.sleep(1.0)
                st = ValidatorState(tmp_path / "vali0" / "validator.sqlite")
                try:
                    rows = [dict(zip(json.loads(r["uids"]), json.loads(r["weights"])))
                            for r in st.conn.execute("SELECT uids, weights FROM weights ORDER BY id").fetchall()]
                finally:
                    st.close()
                paid = [i for i, v in enumerate(rows) if sum(w for u, w in v.items() if u != 0) > 0.5]
                if paid and rows[-1].get(0, 0.0) >= 0.9:   # paid miners, then went to burn
                    break
            if task.done():
                raise AssertionError(f"the validator ended before its weights went to burn: {task.result()!r}")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            heads = {w.hotkey.ss58_address for (s, _), w in net.miner_wallets.items() if s == 0}
            return rows, net.status(), vali.uid, heads
        finally:
            await net.close()

    rows, st, vuid, heads = run(main(), timeout=150)
    assert vuid == 0                                   # the validator holds the burn uid
    assert {h for _, h in st["barred"]} == heads, st["barred"]
    assert all(int(k) < 40 for k in st["steps_done"].values()), st["steps_done"]     # no lane finished
    paid = [i for i, v in enumerate(rows) if sum(w for u, w in v.items() if u != 0) > 0.5]
    assert paid, rows                                  # miners were paid while the lanes trained
    after = rows[paid[-1]:]
    assert after[-1].get(0, 0.0) >= 0.9, rows          # then the weight went to burn
    burn = [v.get(0, 0.0) for v in after]
    assert all(b2 >= b1 - 1e-9 for b1, b2 in zip(burn, burn[1:])), burn     # decaying, never back to full
