"""A miner whose output goes bad, in a local network of real processes (slow): 3 stages x 2 lanes plus
one spare replica per stage (``localnet --replicas 3 --spares 1``), devnet chain, the miner-to-miner
data plane. The head of lane 0 (stage 0, replica 0) sends bad training forwards from lane step 5 on
(``--adversary bad-MODE``: ``inf``, ``nan``, a wrong shape, a wrong dtype, validly signed content
that does not match its committed root; :mod:`iota_subnet.sim.bad_output`), and once with a
colluding tail in lane 1 that reports NaN losses (``bad-inf,nan-loss``). Each run: every lane step
of both lanes is done, the bad miners' weight is 0 from the third weights row set after lane step 5
began (3 tempos), no honest miner is flagged or charged a failure, honest miners hold >= 95 % of
the weight, the spares that take the bad miners' lane seats do not take their weights, and the chain
pays every honest miner that worked and none of the bad ones. About
40-70 s each on 2 cores. The in-process form (bad from lane step 1, no spares) is
``tests/test_blame.py``.
"""
from __future__ import annotations

import json

import pytest
import yaml

from iota_subnet.network.localnet import LocalNet
from iota_subnet.sim.bad_output import FROM_STEP, MODES
from iota_subnet.validator.state import ValidatorState
from support.localnet import SMALL_CFG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 30


@pytest.mark.parametrize("adversary", [f"bad-{m}" for m in MODES] + ["bad-inf,nan-loss"])
def test_bad_output_is_charged_to_its_sender_and_both_lanes_train_on(adversary, tmp_path, tmp_home, wikitext_path,
                                                                       monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(SMALL_CFG))
    net = LocalNet(stages=3, replicas=3, spares=1, validators=1, config=str(cfg), data=str(wikitext_path),
                   steps=STEPS, out=tmp_path / "ln", block_time=0.5, tempo=10, progress=False, timeout_s=600,
                   adversary=adversary, extra_miner_args=["--audit-window", "16"])
    summary = net.run()
    bad = set(summary["adversary_uids"])
    assert len(bad) == adversary.count(",") + 1, summary["adversary_uids"]
    vdir = tmp_path / "ln" / "validators" / "validator0"
    st = ValidatorState(vdir / "validator.sqlite")
    try:
        lanes = {r["lane"]: r["steps_done"] for r in st.conn.execute("SELECT lane, steps_done FROM lanes")}
        failures = {r["uid"]: r["failures"] for r in st.conn.execute("SELECT uid, failures FROM miners")}
        t_bad = st.conn.execute("SELECT MIN(ts) FROM microbatches WHERE step >= ?", (FROM_STEP,)).fetchone()[0]
        rows = st.conn.execute("SELECT ts, uids, weights FROM weights ORDER BY id").fetchall()
    finally:
        st.close()
    # training went on in both lanes: every lane step done
    assert lanes == {0: STEPS, 1: STEPS}, lanes
    # no honest miner charged a failure (the refusing receivers and the spares included)
    assert all(n == 0 for u, n in failures.items() if u not in bad), failures
    status = json.loads((vdir / "status.json").read_text())
    flagged = {m["uid"] for m in status["scores"] if (m["clasp"] or {}).get("flagged")
               or (m["audits"] or {}).get("flagged")}
    assert flagged <= bad, status["scores"]
    assert {u for u, _ in status["barred"]} == bad, (status["barred"], status.get("blame"))
    # weight 0 within 3 tempos of the first bad output, and from then on
    assert t_bad is not None
    after = [dict(zip(json.loads(r["uids"]), json.loads(r["weights"]))) for r in rows if r["ts"] > t_bad]
    assert len(after) >= 3, (len(rows), after)
    assert all(v.get(u, 0.0) == 0.0 for v in after[2:] for u in bad), after
    miners = {m["uid"]: m for m in summary["miners"]}
    # the spares that took the bad miners' lanes did not take the barred miners' weights
    took = [line for p in (tmp_path / "ln" / "logs").glob("miner-*.log")
            for line in p.read_text(errors="replace").splitlines() if "took lane" in line]
    assert took, "no spare took a lane"
    assert not [line for line in took for u in bad if f"holder {miners[u]['hotkey'][:10]}" in line], took
    total = sum(m["weight"] for m in miners.values())
    assert total > 0 and sum(m["weight"] for u, m in miners.items() if u not in bad) >= 0.95 * total, miners
    # on chain: every honest miner that worked is paid, the bad ones are not
    assert all(m["incentive"] > 0 for u, m in miners.items() if u not in bad and m["work"] > 0), miners
    assert all(miners[u]["incentive"] == 0.0 for u in bad), miners
