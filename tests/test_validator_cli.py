"""``neurons/validator.py`` as a real process against the lead's MinerService miners (in this
process) on a SQLite devnet with WikiText-2 data: runs its steps, evaluates, sets weights, and
exits cleanly on SIGTERM; errors are one clear line and exit code 2."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest
import yaml

from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.config import load_config
from iota_subnet.miner.options import DataOptions, MinerOptions
from iota_subnet.miner.service import MinerService
from support.common import OVR, make_wallet
from support.miners import LOCAL

pytestmark = pytest.mark.timeout(180)
NETUID = 9
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_cli_errors_are_clear(tmp_home, tmp_path):
    r = subprocess.run([sys.executable, "neurons/validator.py", "--wallet-name", "nobody", "--wallet-path",
                        str(tmp_path / "w"), "--chain-db", str(tmp_path / "none.db")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no hotkey file" in r.stderr
    make_wallet(tmp_path / "w", "v")
    r = subprocess.run([sys.executable, "neurons/validator.py", "--wallet-name", "v", "--wallet-path",
                        str(tmp_path / "w"), "--chain-db", str(tmp_path / "none.db")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_cli_validator_with_miner_services(tmp_home, tmp_path, wikitext_path, cache_dir):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({**OVR, "model": {**OVR["model"], "vocab_size": 300},
                                        "data": {**OVR["data"], "vocab_size": 300},
                                        "train": {**OVR["train"], "eval_batches": 2}}))
    cfg = load_config(cfg_path)
    root = tmp_home / "wallets"
    vali = make_wallet(root, "vali")
    mws = [make_wallet(root, f"m{i}") for i in range(3)]
    db = create_devnet(tmp_path / "chain.db", NETUID, tempo=4, block_time=0.1, weights_rate_limit=1,
                       immunity_period=0)
    out = tmp_path / "vout"

    async def main():
        chain = await open_devnet(db)
        await chain.register(vali, NETUID)
        add_stake(db, vali.hotkey.ss58_address, vali.coldkeypub.ss58_address, 100.0, netuid=NETUID)
        miners = []
        try:
            for s, w in enumerate(mws):
                await chain.register(w, NETUID)
                m = MinerService(cfg, w, chain, MinerOptions(
                    netuid=NETUID, run_id="cli", stage=s, out_dir=tmp_path / f"m{s}", serve=LOCAL,
                    metagraph_refresh_s=0.5,
                    data=DataOptions(source=str(wikitext_path), cache_dir=str(cache_dir))))   # the validator's data
                await m.start()
                miners.append(m)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "neurons/validator.py", "--wallet-name", "vali", "--wallet-hotkey", "default",
                "--wallet-path", str(root), "--network", "devnet", "--chain-db", str(db), "--netuid", str(NETUID),
                "--config", str(cfg_path), "--data", str(wikitext_path), "--cache-dir", str(cache_dir),
                "--steps", "4", "--out", str(out), "--run-id", "cli", "--sync-interval", "0.5",
                cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            st = {}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.returncode is None:
                await asyncio.sleep(0.5)
                try:
                    st = json.loads((out / "status.json").read_text())
                except (FileNotFoundError, json.JSONDecodeError):
                    continue
                if st.get("done") and st.get("weights_set_blocks"):
                    # rows set before any verified work put everything on the burn uid (the
                    # validator's own here): wait for the row set after the work was verified
                    row = dict(await chain.weights(NETUID)).get(0, [])
                    if {u for u, _ in row} & {1, 2, 3}:
                        break
            if proc.returncode is not None:
                err = (await proc.stderr.read()).decode()[-3000:]
                pytest.fail(f"validator exited early ({proc.returncode}): {err}")
            assert st.get("done"), st
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 30)
            await proc.stderr.read()
            assert rc == 0
            assert st["steps_done"] == {"0": 4} and st["lanes"] == 1
            assert st["val_loss"] is not None and st["loss"] is not None and st["tokens"] == 4 * 4 * 16
            assert all(m.worker.inner_step == 4 for m in miners)
            rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(r["loss"] > 0 for r in rows)
            weights = dict(await chain.weights(NETUID))
            assert {u for u, _ in weights[0]} == {1, 2, 3}
        finally:
            for m in miners:
                await m.stop()
            await chain.close()

    asyncio.run(main())


@pytest.mark.parametrize("flag, value, needle", [("--clasp-paths", "0", "--clasp-paths must be >= 1"),
                                                 ("--hop-timeout", "0", "--hop-timeout must be > 0"),
                                                 ("--audit-timeout", "-1", "--audit-timeout must be > 0")])
def test_cli_refuses_out_of_range_values(tmp_home, tmp_path, flag, value, needle):
    r = subprocess.run([sys.executable, "neurons/validator.py", flag, value, "--chain-db", str(tmp_path / "x.db")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_localnet_set_overrides_parse_and_refuse_bad_items():
    from iota_subnet.config import ConfigError, load_config
    from iota_subnet.network.cli import parse_sets
    ovr = parse_sets(["merge.every_steps=10", "merge.quantization=int8", "train.lr=1e-3"])
    assert ovr == {"merge": {"every_steps": 10, "quantization": "int8"}, "train": {"lr": 1e-3}}
    cfg = load_config("configs/tiny.yaml", ovr)
    assert cfg.merge.every_steps == 10 and cfg.merge.quantization == "int8" and cfg.train.lr == 1e-3
    assert cfg.train.batch_size == 8                       # the rest of the section comes from the file
    for bad in ("merge", "every_steps=3", ".x=1", "merge.=1"):
        with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
            parse_sets([bad])


def test_localnet_stages_default_to_the_configs_and_must_fit_its_layer_split(tmp_path):
    """``iota-subnet localnet`` without ``--stages`` runs the config's own ``pipeline.stages`` (3 for
    configs/tiny.yaml, what ``make localnet`` runs; 4 for a run YAML that says 4: the CLI's old default
    of 3 overrode it); a ``--stages`` that a ``pipeline.layer_split`` of the config cannot serve is a
    one-line error (exit 2) before anything is set up."""
    import argparse

    from iota_subnet.cli import main as cli_main
    from iota_subnet.config import ConfigError
    from iota_subnet.network.cli import register
    from iota_subnet.network.localnet import LocalNet
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    a = parser.parse_args(["localnet"])
    assert a.stages is None and a.wire_dtype is None
    ln = LocalNet(stages=a.stages, replicas=2, validators=1, config=a.config, data=None, steps=2, out=tmp_path / "a")
    assert ln.stages == ln.cfg.pipeline.stages == 3
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    four, split = tmp_path / "four.yaml", tmp_path / "split.yaml"
    four.write_text(yaml.safe_dump({**raw, "pipeline": {**raw["pipeline"], "stages": 4}}))
    split.write_text(yaml.safe_dump({**raw, "pipeline": {**raw["pipeline"], "stages": 2, "layer_split": [5, 3]}}))
    assert LocalNet(replicas=1, validators=1, config=str(four), data=None, steps=2, out=tmp_path / "b").stages == 4
    assert LocalNet(stages=2, replicas=1, validators=1, config=str(four), data=None, steps=2,
                    out=tmp_path / "c").cfg.pipeline.stages == 2          # no layer_split: --stages wins
    ln = LocalNet(replicas=1, validators=1, config=str(split), data=None, steps=2, out=tmp_path / "d")
    assert ln.stages == 2 and ln.cfg.pipeline.layer_split == [5, 3]
    with pytest.raises(ConfigError, match=r"--stages 3 conflicts with pipeline.layer_split \[5, 3\] .*\(2 stages\)"):
        LocalNet(stages=3, replicas=1, validators=1, config=str(split), data=None, steps=2, out=tmp_path / "e")
    ln = LocalNet(stages=3, replicas=1, validators=1, config=str(split), data=None, steps=2, out=tmp_path / "f",
                  overrides={"pipeline": {"layer_split": [3, 3, 2]}})   # a --set split for 3 stages fits
    assert ln.stages == 3 and ln.cfg.pipeline.layer_split == [3, 3, 2]
    with pytest.raises(ConfigError, match="--stages, --replicas and --validators must each be >= 1"):
        LocalNet(stages=0, replicas=1, validators=1, config=str(four), data=None, steps=2, out=tmp_path / "g")
    assert cli_main(["localnet", "--config", str(split), "--stages", "3", "--out", str(tmp_path / "h")]) == 2
    assert not any((tmp_path / d).exists() for d in "abcdefgh")


def test_localnet_refuses_unknown_adversary_and_poison_without_three_replicas(tmp_path):
    from iota_subnet.config import ConfigError
    from iota_subnet.network.localnet import LocalNet
    with pytest.raises(ConfigError, match="unknown --adversary 'nosuch'"):
        LocalNet(stages=3, replicas=3, validators=1, config="configs/tiny.yaml", data=None, steps=2,
                 out=tmp_path / "a", adversary="nosuch")
    with pytest.raises(ConfigError, match="needs --replicas 3"):
        LocalNet(stages=3, replicas=2, validators=1, config="configs/tiny.yaml", data=None, steps=2,
                 out=tmp_path / "b", adversary="poison")
    ln = LocalNet(stages=3, replicas=3, validators=1, config="configs/tiny.yaml", data=None, steps=2,
                  out=tmp_path / "c", adversary="poison")
    assert ln.cfg.merge.every_steps == 10              # merging is on by default: the config's H stays
    ln = LocalNet(stages=3, replicas=3, validators=1, config="configs/tiny.yaml", data=None, steps=2,
                  out=tmp_path / "d", adversary="poison", overrides={"merge": {"every_steps": 0}})
    assert ln.cfg.merge.every_steps == 5               # poison turns merging on when the config has it off
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
