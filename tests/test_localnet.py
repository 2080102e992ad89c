"""End to end: a devnet local network of real processes on 127.0.0.1 (3 stages x 2 replicas).

The loss falls, a miner killed with SIGKILL is routed around and rejoins after its restart,
weights land on chain and become incentive, and no process outlives the run.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import yaml

from iota_subnet.devnet import open_devnet
from iota_subnet.network.localnet import NETUID, LocalNet
from iota_subnet.network.processes import Child

pytestmark = pytest.mark.timeout(600)

CFG = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 512},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "data": {"vocab_size": 512, "seq_len": 32},
       "train": {"batch_size": 8, "micro_batch_size": 4, "lr": 1.0e-2, "warmup_steps": 2, "eval_batches": 2}}


def _config(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(CFG))
    return str(p)


def _chain_weights(db):
    async def go():
        chain = await open_devnet(db)
        try:
            return await chain.weights(NETUID)
        finally:
            await chain.close()
    return asyncio.run(go())


def _status(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


def test_localnet_trains_survives_a_killed_miner_and_pays(tmp_path, tmp_home, wikitext_path, monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    net = LocalNet(stages=3, replicas=2, validators=1, config=_config(tmp_path), data=str(wikitext_path), steps=300,
                   out=tmp_path / "ln", block_time=0.5, tempo=10, progress=False, restart_delay_s=3.0,
                   timeout_s=420)
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(summary=net.run()), daemon=True)
    th.start()
    vstatus = tmp_path / "ln" / "validators" / "validator0" / "status.json"
    victim = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and th.is_alive():
        st = _status(vstatus)
        if min((st.get("steps_done") or {"0": 0}).values()) >= 10:
            victim = next(c for c in net.children if c.name == "miner-s1-r0")
            os.kill(victim.proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    assert victim is not None, "training never reached step 10"
    killed_pid = victim.proc.pid
    # wait for the restart, then note how much work the restarted process had resumed with
    while th.is_alive() and victim.restarts == 0:
        time.sleep(0.2)
    mstatus = victim.out / "status.json"
    resumed_backwards = None
    while th.is_alive() and resumed_backwards is None:
        st = _status(mstatus)
        if st.get("uptime_s", 1e9) < 30 and "backwards" in st:
            resumed_backwards = st["backwards"]
        time.sleep(0.2)
    th.join(timeout=420)
    assert not th.is_alive()
    s = result["summary"]
    assert s["ended"] == "done" and s["steps_done"] == 300, (s["ended"], s["steps_done"])

    rows = [json.loads(l) for l in (tmp_path / "ln" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(300))
    assert all({"step", "tokens", "loss", "lr", "elapsed_s"} <= set(r) for r in rows)
    assert s["final_loss"] < rows[0]["loss"] - 0.8, (rows[0]["loss"], s["final_loss"])
    assert s["val_loss"] is not None and s["val_loss"] < rows[0]["loss"]
    for k in ("tokens_per_s", "wire_bytes_per_token", "reroutes"):
        assert s[k] is not None
    assert s["reroutes"] > 0                                   # the killed miner's hops went elsewhere
    assert s["miner_restarts"] >= 1 and resumed_backwards is not None
    by_name = {m["name"]: m for m in s["miners"]}
    assert by_name["miner-s1-r0"]["restarts"] >= 1
    final_backwards = _status(mstatus).get("backwards", 0)
    assert final_backwards > resumed_backwards, "the restarted miner never served again"
    # weights on chain -> incentive for every miner that did work
    weights = _chain_weights(tmp_path / "ln" / "chain.db")
    vuid = s["validators_detail"][0]["uid"]
    assert any(u == vuid and row for u, row in weights)
    worked = [m for m in s["miners"] if m["work"] > 0]
    assert len(worked) == 6
    assert all(m["incentive"] > 0 for m in worked), [(m["name"], m["incentive"]) for m in worked]
    # nothing outlives the run
    assert _dead(killed_pid)
    for c in net.children:
        assert c.proc.poll() is not None, c.name


@pytest.mark.slow          # about 3-5 min on 2 cores: `make test-slow` (CI runs it)
def test_localnet_with_two_validators(tmp_path, tmp_home, wikitext_path, monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    s = LocalNet(stages=3, replicas=2, validators=2, config=_config(tmp_path), data=str(wikitext_path), steps=16,
                 out=tmp_path / "ln2", block_time=0.5, tempo=10, progress=False, timeout_s=300).run()
    weights = _chain_weights(tmp_path / "ln2" / "chain.db")
    setters = {u for u, row in weights if row}
    vuids = {v["uid"] for v in s["validators_detail"]}
    assert len(vuids) == 2 and vuids <= setters              # both validators' weights reached the chain
    assert all(v["weights_set_blocks"] for v in s["validators_detail"])
    assert all(m["incentive"] > 0 for m in s["miners"] if m["work"] > 0)
    assert s["final_loss"] is not None and s["tokens"] == 16 * 2 * 8 * 32


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


@pytest.mark.parametrize("how", ["kill", "terminal closed", "ctrl-c"])
def test_a_terminated_localnet_stops_every_neuron_and_writes_its_summary(tmp_path, tmp_home, wikitext_path, how):
    """``kill <pid of iota-subnet localnet>`` (SIGTERM) ended the localnet at once and left its
    devnet's miners and validator running, orphaned (found when a churn benchmark was stopped,
    2026-12-02). Now it stops every neuron and writes its summary, as at the end of a run. A closed
    terminal sends SIGHUP to the whole foreground process group: it killed every neuron at once (no
    clean stop, no checkpoint); now each neuron has a process group of its own, and the localnet stops
    them in order."""
    out = tmp_path / "ln"
    env = dict(os.environ, IOTA_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from iota_subnet.cli import main; sys.exit(main())",
                             "localnet", "--stages", "2", "--replicas", "1", "--config", _config(tmp_path),
                             "--data", str(wikitext_path), "--steps", "1000", "--out", str(out),
                             "--block-time", "0.5", "--tempo", "10"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)      # its own process group, as a terminal's job is
    try:
        deadline = time.monotonic() + 240
        kids: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:
            kids = _children(proc.pid)
            serving = [p for p in out.glob("miners/*/status.json") if _status(p).get("port")]
            if len(kids) >= 3 and len(serving) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None and len(kids) >= 3, f"the localnet did not come up: {proc.stdout.read()[-3000:]}"
        if how == "kill":
            proc.send_signal(signal.SIGTERM)
        else:                                          # what the terminal sends its foreground job
            os.killpg(proc.pid, signal.SIGHUP if how == "terminal closed" else signal.SIGINT)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert all(_dead(k) for k in kids), [k for k in kids if not _dead(k)]
    sig = {"kill": "SIGTERM", "terminal closed": "SIGHUP", "ctrl-c": "SIGINT"}[how]
    assert f"signal {sig}: stopping every neuron" in text, text[-3000:]
    assert "killing it" not in text, text[-3000:]
    logs = sorted(out.glob("logs/miner-*.log"))
    assert len(logs) == 2, logs
    for log in logs:                                # each miner stopped as at the end of a run
        assert "miner stopped" in log.read_text(errors="replace"), (log.name, log.read_text(errors="replace")[-2000:])
    summary = json.loads((out / "summary.json").read_text())     # it says it covers only part of the run
    assert summary["ended"] == "stopped" and 0 <= summary["steps_done"] < 1000, {k: summary.get(k) for k in ("ended", "steps_done")}
    assert f"stopped early, at step {summary['steps_done']} of 1000" in text, text[-3000:]


def test_a_resumed_run_ignores_the_previous_processes_status(tmp_path):
    """A resumed localnet's folders still hold the last run's status.json (its ports, its dashboard
    address): until the new process writes its own, the child has no status."""
    c = Child("validator0", "validator", ["true"], tmp_path / "v.log", tmp_path / "v")
    c.out.mkdir()
    (c.out / "status.json").write_text(json.dumps({"dashboard": "http://127.0.0.1:1/"}))
    os.utime(c.out / "status.json", (time.time() - 60, time.time() - 60))
    assert c.status() == {"dashboard": "http://127.0.0.1:1/"}      # never started here: read as it is
    c.started_wall = time.time()
    assert c.status() == {}
    (c.out / "status.json").write_text(json.dumps({"dashboard": "http://127.0.0.1:2/"}))
    assert c.status()["dashboard"] == "http://127.0.0.1:2/"


def test_dashboard_addresses_go_to_stderr_so_json_on_stdout_stays_parseable(tmp_path, capsys):
    """``bench_churn.py --json`` and ``bench_verification.py --json`` print one JSON object on stdout;
    the dashboard address a local network announces once its validator serves one went to stdout too
    and made that output unparseable."""
    ns = SimpleNamespace(children=[Child("validator0", "validator", ["true"], tmp_path / "v.log", tmp_path / "v")],
                         dashboards={})
    LocalNet._announce_dashboards(ns, [{"dashboard": "http://127.0.0.1:5/"}])
    out, err = capsys.readouterr()
    assert out == "" and "dashboard (validator0): http://127.0.0.1:5/" in err


@pytest.mark.parametrize("nohup", [False, True])
def test_a_neuron_stops_cleanly_on_sighup_unless_under_nohup(nohup):
    """A closed terminal's SIGHUP stops a neuron as at the end of its run (it used to kill it with no
    clean stop); one started with ``nohup`` ignores SIGHUP and must keep running."""
    code = ("import asyncio, os, signal\n"
            "from iota_subnet.neuron_common import install_stop\n"
            "async def main():\n"
            "    stop = install_stop(asyncio.get_running_loop())\n"
            "    os.kill(os.getpid(), signal.SIGHUP)\n"
            "    try:\n"
            "        await asyncio.wait_for(stop.wait(), 2)\n"
            "        print('stopped cleanly')\n"
            "    except asyncio.TimeoutError:\n"
            "        print('still running')\n"
            "asyncio.run(main())\n")
    argv = (["nohup"] if nohup else []) + [sys.executable, "-c", code]
    # started from a terminal: SIGHUP at its default (this test may itself run under nohup, whose
    # ignored SIGHUP every child inherits)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("still running" if nohup else "stopped cleanly"), out


@pytest.mark.parametrize("command", ["localnet", "miner"])
def test_adversary_help_names_every_kind(command, capsys, monkeypatch):
    """`--help` listed fewer cheater kinds than the README and the code accept."""
    monkeypatch.setenv("COLUMNS", "2000")          # no wrapping inside a name (noisy-update)
    from iota_subnet.cli import main as cli_main
    from iota_subnet.sim.adversary import ALL_KINDS
    with pytest.raises(SystemExit):
        cli_main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index("--adversary KIND ")      # the option's own help, not the usage line
    help_text = text[start:start + 900]
    assert [k for k in ALL_KINDS if k not in help_text] == [], help_text
