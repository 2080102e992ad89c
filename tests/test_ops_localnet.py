"""The operator's view against a running local network (2 stages x 2 replicas, 1 validator):

* the validator's dashboard in a real headless Chromium (Debian's chromium + chromium-driver, put
  there by `make browser`, which `make setup` and .ci/run run): the page loads with no request
  leaving 127.0.0.1, every plot holds at least 3 points, the pipeline shows every miner, the
  verification table the explained scores, and a screenshot has more than 1% non-background pixels;
* the dashboard is read-only and shows no secret;
* `/metrics` of the validator and of a miner carry the documented families with live values, and a
  miner serves its own dashboard;
* `iota-subnet doctor` prints no FAIL against it, and FAIL with the fix (exit code 1) for a wrong
  wallet name.

About 1.5 minutes on 2 cores (start-up dominates).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

from iota_subnet.cli import main as cli_main
from iota_subnet.network.localnet import LocalNet

pytestmark = pytest.mark.timeout(420)

CFG = {"model": {"name": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 512},
       "pipeline": {"stages": 2, "compression_ratio": 4},
       "data": {"vocab_size": 512, "seq_len": 32},
       "train": {"batch_size": 8, "micro_batch_size": 4, "lr": 1.0e-2, "warmup_steps": 2, "eval_batches": 2}}


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _get(url: str, method: str = "GET") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture(scope="module")
def net(tmp_path_factory, wikitext_path, cache_dir):
    tmp = tmp_path_factory.mktemp("opsnet")
    with pytest.MonkeyPatch.context() as mp:
        (tmp / "home").mkdir()
        mp.setenv("HOME", str(tmp / "home"))
        mp.setenv("IOTA_CACHE", str(cache_dir))
        cfg = tmp / "cfg.yaml"
        cfg.write_text(yaml.safe_dump(CFG))
        ln = LocalNet(stages=2, replicas=2, validators=1, config=str(cfg), data=str(wikitext_path), steps=2000,
                      out=tmp / "ln", block_time=0.5, tempo=5, progress=False, timeout_s=400,
                      extra_validator_args=["--clasp-interval", "1"], extra_miner_args=["--dashboard-port", "0"])
        box: dict = {}
        th = threading.Thread(target=lambda: box.update(summary=ln.run()), daemon=True)
        th.start()
        vstatus = tmp / "ln" / "validators" / "validator0" / "status.json"
        deadline = time.monotonic() + 240
        st: dict = {}
        while time.monotonic() < deadline and th.is_alive():
            st = _status(vstatus)
            if st.get("dashboard") and min((st.get("steps_done") or {"0": 0}).values()) >= 3 and st.get("scores"):
                break
            time.sleep(0.5)
        assert th.is_alive() and st.get("dashboard"), f"the localnet did not come up; see {tmp / 'ln' / 'logs'}"
        ln.dashboard_url = st["dashboard"]
        yield ln
        ln.request_stop()
        th.join(timeout=120)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Selenium on Debian's headless chromium, or a skip that says why (no browser installed)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.skip("no browser: Debian's chromium and chromium-driver are not installed and could not be "
                    "(`make browser` installs them with apt-get as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
              "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1400,2000", f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
              # offline: any host but 127.0.0.1 fails to resolve, so a CDN asset could not load
              "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(executable_path=driver_bin), options=opts)
    yield d
    d.quit()


def _non_background_fraction(png: bytes) -> float:
    from PIL import Image
    img = Image.open(io.BytesIO(png)).convert("RGB")
    counts = Counter(img.getdata())
    background, n = counts.most_common(1)[0]
    return 1.0 - n / sum(counts.values())


def test_dashboard_in_a_real_browser(net, browser, tmp_path):
    d = browser
    d.get(net.dashboard_url)
    assert d.title == "iota-subnet dashboard"
    deadline = time.monotonic() + 120
    counts: dict = {}
    while time.monotonic() < deadline:
        counts = d.execute_script("return window.iotaDashboard && window.iotaDashboard.pointCounts()") or {}
        cells = d.execute_script("return document.querySelectorAll('#pipeline .cell').length")
        rows = d.execute_script("return document.querySelectorAll('#verification tbody tr').length")
        if len(counts) >= 3 and min(counts.values()) >= 3 and cells == 4 and rows >= 4:
            break
        time.sleep(1)
    assert set(counts) >= {"loss", "tokens_per_s", "work"}, counts
    assert min(counts.values()) >= 3, counts
    # every plot is drawn (a uPlot canvas with its data), not just counted
    drawn = d.execute_script("return Object.fromEntries(Object.entries(window.iotaDashboard.plots)"
                             ".map(([k, p]) => [k, p.data[0].length]))")
    assert all(drawn.get(k, 0) >= 2 for k in counts), drawn
    assert d.execute_script("return document.querySelectorAll('.plot-card canvas').length") >= 3
    assert d.execute_script("return document.querySelectorAll('#pipeline .cell').length") == 4
    stages = d.execute_script("return Array.from(document.querySelectorAll('#pipeline .col h3')).map(e => e.textContent)")
    assert stages == ["stage 0", "stage 1"]
    # the verification table shows the explained scores (the rows `iota-subnet scores` prints) it was given
    why, expected = d.execute_script(
        "return [Array.from(document.querySelectorAll('#verification td.why')).map(e => e.textContent),"
        " window.iotaDashboard.snapshot().scores.miners.map(m => (m.why || []).join('; '))]")
    assert why == expected and any(why), (why, expected)
    assert all("sampled hops replayed" in w or "flagged" in w or "verified work" in w for w in why), why
    assert "block" in d.find_element("id", "chain").text
    png = d.get_screenshot_as_png()
    (tmp_path / "dashboard.png").write_bytes(png)
    frac = _non_background_fraction(png)
    assert frac > 0.01, f"screenshot is {frac:.2%} non-background"
    severe = [e for e in d.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, severe                               # no failed loads, no CSP violations, no script errors


def test_dashboard_is_read_only_offline_and_keeps_secrets(net):
    url = net.dashboard_url
    status, headers, html = _get(url)
    assert status == 200 and b"<script src=\"static/app.js\">" in html
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for asset in ("static/app.js", "static/style.css", "static/vendor/uPlot.iife.min.js", "static/vendor/uPlot.min.css"):
        s, _, body = _get(url + asset)
        assert s == 200 and body
        assert b"https://cdn" not in body and b"//fonts.googleapis" not in body
    assert b"http://" not in html and b"https://" not in html
    for method in ("POST", "PUT", "DELETE"):
        assert _get(url + "api/snapshot", method)[0] == 405
        assert _get(url, method)[0] == 405
    assert _get(url + "static/../../../etc/passwd")[0] in (403, 404)
    # no secret of any wallet of the network, nor where the wallets live
    blob = b"".join(_get(url + p)[2] for p in ("", "api/snapshot", "metrics"))
    secrets = []
    for f in (net.out / "wallets").rglob("*"):
        if f.is_file():
            try:
                d = json.loads(f.read_text())
            except ValueError:
                continue
            secrets += [str(d[k]) for k in ("privateKey", "secretPhrase", "secretSeed") if d.get(k)]
    assert secrets
    assert not [s for s in secrets if s.encode() in blob]
    assert str(net.out / "wallets").encode() not in blob


def _metric_value(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not exported")


def test_metrics_of_the_validator_and_a_miner(net):
    v = _get(net.dashboard_url + "metrics")[2].decode()
    assert _metric_value(v, "iota_validator_tokens_total") > 0
    assert _metric_value(v, "iota_validator_loss") > 0
    assert 'iota_hop_latency_seconds_bucket{le="0.1",route="/tickets"}' in v          # control plane
    assert 'iota_http_served_requests_total{outcome="OK",route="/receipts"}' in v
    assert "iota_audit_checks_total" in v and "iota_miner_weight" in v
    m = net.miner("miner-s1-r0")
    port = _status(m.out / "status.json")["port"]
    text = _get(f"http://127.0.0.1:{port}/metrics")[2].decode()
    assert _metric_value(text, "iota_miner_inner_step") >= 1
    assert _metric_value(text, "iota_miner_activation_cache_bytes") >= 0
    assert 'iota_http_served_requests_total{outcome="OK",route="/hop"}' in text        # data plane, served
    assert _metric_value(text, "iota_hop_sent_bytes_total") > 0                         # ... and sent on
    assert 'iota_hop_latency_seconds_count{route="/receipts"}' in text
    assert _metric_value(text, "iota_miner_tokens_total") > 0
    # the miner's own (optional) dashboard
    url = _status(m.out / "status.json")["dashboard"]
    snap = json.loads(_get(url + "api/snapshot")[2])
    assert snap["role"] == "miner" and snap["identity"]["stage"] == 1 and snap["totals"]["inner_step"] >= 1
    assert len(snap["series"]["inner_step"]["lines"]["inner step"]) >= 1
    assert _get(url)[0] == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doctor_against_the_running_localnet(net, wikitext_path, cache_dir, capsys):
    common = ["doctor", "--network", "devnet", "--chain-db", str(net.chain_db), "--netuid", "9",
              "--wallet-path", str(net.out / "wallets"), "--config", str(net.config_path),
              "--data", str(wikitext_path), "--cache-dir", str(cache_dir), "--out", str(net.out),
              "--host", "127.0.0.1", "--port", str(_free_port()), "--external-ip", "127.0.0.1"]
    code = cli_main(common + ["--wallet-name", "validator0", "--role", "validator"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert not [l for l in out.splitlines() if l.startswith("FAIL")], out
    status = {line.split()[1]: line.split()[0] for line in out.splitlines()
              if line[:4] in ("PASS", "WARN", "FAIL", "SKIP")}
    for name in ("python", "packages", "config", "disk", "wallet", "chain", "registration", "stake", "clock", "port",
                 "data"):
        assert status[name] == "PASS", (name, out)
    assert status["gpu"] == "SKIP" and status["reachability"] == "SKIP"   # no GPU; peers only on 127.0.0.1

    # a miner asked explicitly: it dials our port back and serves a download
    miner_port = _status(net.miner("miner-s0-r0").out / "status.json")["port"]
    code = cli_main(common + ["--wallet-name", "miner-s0-r1", "--peer", f"127.0.0.1:{miner_port}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert any(l.startswith("PASS  reachability") for l in out.splitlines()), out
    assert any(l.startswith(("PASS  bandwidth", "WARN  bandwidth")) for l in out.splitlines()), out

    code = cli_main(common + ["--wallet-name", "nobody"])
    out = capsys.readouterr().out
    assert code == 1
    lines = out.splitlines()
    i = next(i for i, l in enumerate(lines) if l.startswith("FAIL  wallet"))
    assert "fix: btcli wallet new_coldkey --wallet nobody" in lines[i + 1]
    assert os.path.exists(net.chain_db)
