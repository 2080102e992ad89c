"""Containers and process managers. No Docker daemon or registry is reachable here, so the
Dockerfile's install step (deploy/install.sh) runs in a fresh virtual environment instead, and the
entry point, compose file, pm2 file and systemd unit are checked against the CLI they drive."""
from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def _entry(env: dict) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": "/home/op", "IOTA_DRY_RUN": "1"}
    return subprocess.run(["sh", str(DEPLOY / "entrypoint.sh")], env={**base, **env}, capture_output=True, text=True,
                          timeout=30)


def _parse(argv: list[str]):
    from iota_subnet.cli import _load_extra_commands, build_parser
    _load_extra_commands()
    return build_parser().parse_args(argv)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_install_script_in_a_fresh_virtualenv(tmp_path):
    """The Dockerfile's RUN step, as it is, into a new environment (CPU variant; torch from this
    machine's wheel): the package with its dashboard assets and remote model code installs and runs."""
    venv = tmp_path / "venv"
    python = getattr(sys, "_base_executable", None) or shutil.which("python3.11") or "python3"
    env = {**os.environ, "VARIANT": "cpu", "PYTHON": python, "TORCH_SPEC": "torch==2.13.0"}
    r = subprocess.run(["sh", str(DEPLOY / "install.sh"), str(venv)], env=env, capture_output=True, text=True,
                       timeout=840)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "iota-subnet installed" in r.stdout
    exe = venv / "bin" / "iota-subnet"
    help_text = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120).stdout
    for cmd in ("miner", "validator", "localnet", "doctor", "export", "generate", "eval"):
        assert cmd in help_text
    check = ("import iota_subnet.dashboard.server as s, iota_subnet.hf.export as e; "
             "assert (s.STATIC / 'index.html').is_file() and (s.STATIC / 'vendor' / 'uPlot.iife.min.js').is_file(); "
             "assert (e.REMOTE / 'modeling_iota.py').is_file(); print(s.STATIC)")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0 and str(venv) in out.stdout, out.stderr     # installed, not the source tree
    doc = subprocess.run([str(exe), "doctor", "--wallet-name", "none", "--wallet-path", str(tmp_path / "w"),
                          "--network", "devnet", "--chain-db", str(tmp_path / "none.db")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert doc.returncode == 1 and "PASS  packages" in doc.stdout and "FAIL  wallet" in doc.stdout, doc.stdout


def test_install_script_refuses_a_bad_variant(tmp_path):
    r = subprocess.run(["sh", str(DEPLOY / "install.sh"), str(tmp_path / "v")], env={**os.environ, "VARIANT": "rocm"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "VARIANT must be cpu or cuda" in r.stderr
    assert not (tmp_path / "v").exists()


def test_entrypoint_turns_the_environment_into_valid_cli_arguments():
    r = _entry({"IOTA_ROLE": "miner", "IOTA_NETWORK": "test", "IOTA_EXTERNAL_IP": "203.0.113.7", "IOTA_STAGE": "2",
                "IOTA_PORT": "9000", "IOTA_DASHBOARD_PORT": "9001", "IOTA_WALLET_HOTKEY": "m1",
                "IOTA_EXTRA_ARGS": "--checkpoint-every 5 --log-level DEBUG"})
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split("\n")[:-1]
    assert argv[0] == "iota-subnet"
    a = _parse(argv[1:])
    assert (a.command, a.network, a.external_ip, a.stage, a.port, a.dashboard_port) == ("miner", "test", "203.0.113.7",
                                                                                          2, 9000, 9001)
    assert (a.wallet_hotkey, a.wallet_path, a.out, a.checkpoint_every, a.log_level) == (
        "m1", "/home/op/.bittensor/wallets", "/data/miner", 5, "DEBUG")
    r = _entry({"IOTA_ROLE": "validator", "IOTA_NETWORK": "devnet", "IOTA_CHAIN_DB": "/data/chain.db",
                "IOTA_DATA": "/data/corpus.txt", "IOTA_STAGE": "1"})
    v = _parse(r.stdout.split("\n")[1:-1])
    assert (v.command, v.chain_db, v.data) == ("validator", "/data/chain.db", "/data/corpus.txt")
    assert "--stage" not in r.stdout                         # a miner-only option is not passed to a validator


def test_entrypoint_refuses_missing_settings_with_the_fix():
    r = _entry({})
    assert r.returncode == 2 and "set IOTA_ROLE to miner or validator" in r.stderr
    r = _entry({"IOTA_ROLE": "miner", "IOTA_NETWORK": "finney"})
    assert r.returncode == 2 and "IOTA_EXTERNAL_IP" in r.stderr


def test_dockerfile_builds_both_variants_through_the_install_script():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert "FROM base-${VARIANT}" in text and "AS base-cpu" in text and "AS base-cuda" in text
    assert "sh deploy/install.sh /opt/iota" in text
    assert 'ENTRYPOINT ["sh", "/app/deploy/entrypoint.sh"]' in text
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (REPO / src).exists(), src


def test_compose_starts_a_miner_and_a_validator_from_the_environment():
    c = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    s = c["services"]
    assert s["miner"]["environment"]["IOTA_ROLE"] == "miner"
    assert s["validator"]["environment"]["IOTA_ROLE"] == "validator"
    assert s["miner"]["build"]["args"]["VARIANT"] == "cpu" and s["miner-cuda"]["build"]["args"]["VARIANT"] == "cuda"
    assert s["miner"]["env_file"] == ".env"
    env_keys = {line.split("=")[0].lstrip("# ") for line in (DEPLOY / "iota-subnet.env.example").read_text().splitlines()
                if "=" in line}
    documented = set(re.findall(r"IOTA_[A-Z_]+", (DEPLOY / "entrypoint.sh").read_text()))
    assert env_keys <= documented


def test_pm2_ecosystem_runs_the_entrypoint():
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node: cannot load the pm2 file")
    out = subprocess.run([node, "-e", f"console.log(JSON.stringify(require({str(DEPLOY / 'ecosystem.config.js')!r})))"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    apps = {a["name"]: a for a in json.loads(out.stdout)["apps"]}
    assert set(apps) == {"iota-miner", "iota-validator"}
    for role, a in (("miner", apps["iota-miner"]), ("validator", apps["iota-validator"])):
        assert Path(a["script"]) == DEPLOY / "entrypoint.sh" and a["interpreter"] == "sh"
        assert a["env"]["IOTA_ROLE"] == role and a["autorestart"] and a["kill_timeout"] >= 30000


def test_systemd_unit_runs_the_entrypoint_per_role():
    p = configparser.ConfigParser(strict=False, interpolation=None)
    p.optionxform = str
    p.read_string((DEPLOY / "systemd" / "iota-subnet@.service").read_text())
    svc = p["Service"]
    assert svc["ExecStart"] == "/bin/sh /opt/iota-subnet/deploy/entrypoint.sh"
    assert svc["EnvironmentFile"] == "/etc/iota-subnet/%i.env" and svc["KillSignal"] == "SIGTERM"
    assert svc["Restart"] == "on-failure" and p["Install"]["WantedBy"] == "multi-user.target"
