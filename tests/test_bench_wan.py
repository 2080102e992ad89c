"""The WAN bench's row definitions, its ideal throughput, and how it reads a localnet's results
(scripts/bench_wan.py; the runs themselves are the benchmark, not a test)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.scripts import load_script

from iota_subnet.hardware import GPUS, parse_accelerator
from iota_subnet.network.localnet_args import emulation_argv
from iota_subnet.config import ConfigError
from iota_subnet.plan import plan, stage_timings
from iota_subnet.transport.shaping import LINK_PROFILES, parse_link

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_wan")


def test_rows_are_the_issues_table(bench):
    rows = bench.rows()
    names = [r.name for r in rows]
    assert len(set(names)) == len(names)
    tiny = [r for r in rows if r.mode == "train"]
    assert [(r.stages, r.replicas, r.link) for r in tiny] == [(3, 2, "loopback"), (3, 2, "100mbit:50ms")]
    assert all(r.config.endswith("tiny_merge.yaml") and r.run_config().merge.enabled for r in tiny)
    big = [r for r in rows if r.config.endswith("8b.yaml")]
    assert {(r.compression_ratio, r.link) for r in big} == {(c, l) for c in (64, 8) for l in LINK_PROFILES}
    for r in big:
        cfg = r.run_config()
        assert (r.mode, r.gpu, r.stages, r.replicas, r.wire_dtype) == ("emulated", "a100", 8, 2, "bf16")
        assert cfg.pipeline.compression_ratio == r.compression_ratio and cfg.data.seq_len == 2048
        assert cfg.train.micro_batch == r.rows_per_microbatch == 1
        assert cfg.data.tokenizer is None               # emulation needs no hub tokenizer
    one_b, public, home = [r for r in rows if r.config.endswith("1b.yaml")]
    assert (one_b.gpu, one_b.stages, one_b.replicas, one_b.link) == ("4090", 4, 4, "100mbit:50ms")
    # Train at Home: the same row with public miners, and with one replica of every stage behind a relay
    assert [(r.gpu, r.stages, r.replicas, r.link, r.home_replicas) for r in (public, home)] == \
        [("4090", 4, 2, "20mbit:100ms", 0), ("4090", 4, 2, "20mbit:100ms", 1)]
    assert "--home-replicas" not in bench.localnet_argv(public, Path("o"), "d")
    assert bench.localnet_argv(home, Path("o"), "d")[-2:] == ["--home-replicas", "1"]
    checked = set()
    for r in rows:
        parse_link(r.link)
        if r.mode == "emulated":        # every emulated stage fits its GPU (the emulator would refuse it)
            assert r.time_scale >= 1 and r.mfu == (0.47 if r.config.endswith("100b.yaml") else 0.5)
            key = (r.config, r.compression_ratio, r.gpu)
            if key not in checked:
                checked.add(key)
                assert all(p.fits for p in plan(r.run_config(), parse_accelerator(r.gpu).memory_bytes))
    assert len(checked) == 4
    # the whole-system rows: merges every 10 lane steps, overlapped, inside 31 steps (3 per stage)
    merging = {r.name: r for r in rows if r.name.endswith("-merge10")}
    assert set(merging) == {"8b-a100-r64-100mbit:50ms-merge10", "100b-h200-r144-1gbit:10ms-merge10"}
    for r in merging.values():
        cfg = r.run_config()
        assert cfg.merge.enabled and cfg.merge.every_steps == 10 and cfg.merge.overlap and r.steps == 31
        assert cfg.merge.quantization == "int8" and cfg.train.total_steps == 31 and r.join_at == "3:0"
        argv = bench.localnet_argv(r, Path("o"), "d")
        assert argv[argv.index("--join-at") + 1] == "3:0"
    assert (merging["100b-h200-r144-1gbit:10ms-merge10"].stages, merging["100b-h200-r144-1gbit:10ms-merge10"].replicas) \
        == (16, 2)


def test_a_bad_set_is_one_line_and_exit_2(bench, capsys):
    assert bench.main(["--list", "--set", "merge.bogus=1"]) == 2
    assert "unknown key(s) ['bogus']" in capsys.readouterr().err
    assert bench.main(["--list", "--set", "merge"]) == 2
    assert "SECTION.KEY=VALUE" in capsys.readouterr().err


def test_merge_fields_read_the_miners_merge_status(bench):
    st = [{"stage": 0, "merge": {"merges": 3, "abandoned": 0, "virtual": {"scale": 2048},
                                 "last": {"bytes_sent": 1.6e9, "wall_s": 600.0}}},
          {"stage": 0, "merge": {"merges": 2, "abandoned": 1, "last": {"bytes_sent": 1.5e9, "wall_s": 660.0}}},
          {"stage": 1, "merge": {"merges": 3, "abandoned": 0, "last": None}}, {"stage": 1}]
    f = bench.merge_fields(st, time_scale=6.0)
    assert f == {"merges_applied_min": {"0": 2, "1": 3}, "merges_abandoned": 1, "merge_bytes_sent_last_max": 1.6e9,
                 "merge_s_last_max": 110.0, "merge_virtual_scale": 2048}
    assert set(bench.merge_fields([{"stage": 0}]).values()) == {None}


def test_ideal_is_replicas_over_the_slowest_stage(bench):
    row = next(r for r in bench.rows() if r.name == "8b-a100-r64-100mbit:50ms")
    cfg = row.run_config()
    tim = stage_timings(cfg, GPUS["a100"], 0.5)
    step_tokens = cfg.train.batch_size * cfg.data.seq_len          # the optimizer step is shared by a lane step's tokens
    per_token = max(t.forward_s + t.backward_s + t.step_s / step_tokens for t in tim)
    assert bench.ideal_tokens_per_s(row) == pytest.approx(2 / per_token)
    # ~16.5k tokens/s per A100 replica: 156 TFLOP/s over the 5-block stage's ~9.4 GFLOP/token
    assert 30_000 < bench.ideal_tokens_per_s(row) < 36_000
    one_b = next(r for r in bench.rows() if r.config.endswith("1b.yaml"))
    cfg1 = one_b.run_config()
    assert bench.ideal_tokens_per_s(one_b) == pytest.approx(
        4 / max(t.per_token(cfg1.train.batch_size * cfg1.data.seq_len) for t in stage_timings(cfg1, GPUS["4090"], 0.5)))
    tiny = bench.rows()[0]
    assert bench.ideal_tokens_per_s(tiny) is None
    assert bench.ideal_tokens_per_s(tiny, [1e-4, 2e-4, 1.5e-4]) == pytest.approx(2 / 2e-4)


def test_proc_stat_busy_fraction(bench):
    a = bench.read_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    b = bench.read_proc_stat("cpu  160 0 90 900 50 0 0 0 0 0\n")
    assert a == (150, 1000) and b == (250, 1200)
    assert bench.busy_fraction(a, b) == pytest.approx(0.5)
    busy, total = bench.read_proc_stat()             # this machine
    assert 0 <= busy <= total


def test_result_row_from_a_summary(bench):
    row = next(r for r in bench.rows() if r.name == "8b-a100-r64-100mbit:50ms")
    summary = {"tokens": 40960, "tokens_per_s": 100.0, "train_s": 50.0, "final_loss": 11.76, "val_loss": 11.76,
               "validator_bytes_per_token": 3.0, "miner_bytes_per_token": 500.0, "verification_bytes": 4096}
    metrics = [{"step": 0, "tokens": 8192, "elapsed_s": 20.0}, {"step": 1, "tokens": 16384, "elapsed_s": 30.0},
               {"step": 2, "tokens": 24576, "elapsed_s": 40.0}]
    miners = [{"busy_s": 20.0}, {"busy_s": 30.0}, {}]
    out = bench.result_row(row, summary, miners, metrics, ideal=1000.0, host_cpu_busy=0.4, own_cpu_busy=0.3,
                           wall_s=99.0)
    assert out["mode"] == "emulated" and "EMULATION" in out["emulation"] and out["time_scale"] == 2.0
    assert out["tokens_per_s"] == pytest.approx(2 * 16384 / 20)        # after the first step, emulated time
    assert out["tokens_per_s_run"] == 200.0 and out["fraction_of_ideal"] == pytest.approx(1.6384)
    assert out["stage_utilisation"] == pytest.approx((0.4 + 0.6) / 2)
    assert out["verification_bytes_per_token"] == pytest.approx(0.1)
    assert out["final_loss"] is None and out["val_loss"] is None      # emulated rows learn nothing
    assert out["data_plane"] == "miner to miner" and out["validator_bytes_per_token"] == 3.0
    # the data plane before issue 9: only wire bytes, all relayed by the validator
    old = bench.result_row(bench.rows()[0], {"tokens": 10, "wire_bytes_per_token": 1052.0, "final_loss": 5.6},
                           [], [], ideal=None, host_cpu_busy=None, own_cpu_busy=None, wall_s=None, error="boom")
    assert old["validator_bytes_per_token"] == 1052.0 and old["miner_bytes_per_token"] == 0.0
    assert old["final_loss"] == 5.6 and old["tokens_per_s"] is None and old["stage_utilisation"] is None
    assert old["error"] == "boom" and "relays" in old["data_plane"]
    for k in ("mode", "config", "stages", "replicas", "compression_ratio", "wire_dtype", "link", "tokens_per_s",
              "stage_utilisation", "ideal_tokens_per_s", "validator_bytes_per_token", "miner_bytes_per_token",
              "final_loss", "host_cpu_busy"):
        assert k in out and k in old
    json.dumps(out)


def test_emulated_rows_report_the_modelled_update_store_checkpoints_and_block_time(bench):
    row = next(r for r in bench.rows() if r.name == "8b-a100-r64-100mbit:50ms")
    store = {"max_host_bytes": 50, "plan_host_bytes": 40, "last_d2h_bytes": 16, "settle_wait_s": 0.5}
    miners = [{"modelled": {"update_store": store, "checkpoints": {"writes": 1, "write_bytes": 12, "write_s": 3.0}}},
              {"modelled": {"update_store": {**store, "max_host_bytes": 70, "settle_wait_s": 0.0},
                            "checkpoints": {"writes": 2, "write_bytes": 24, "write_s": 6.0}}},
              {}]                                       # a miner without a status: left out
    out = bench.result_row(row, {"block_time_s": {"wall": 2.0, "emulated": 1.0}}, miners, [], ideal=None,
                           host_cpu_busy=None, own_cpu_busy=None, wall_s=None)
    assert out["update_store_host_bytes_max"] == 70 and out["update_store_plan_host_bytes"] == 40
    assert out["update_store_d2h_bytes_per_step"] == 16 and out["update_store_settle_wait_s"] == 0.5
    assert out["checkpoint_writes"] == 3 and out["checkpoint_bytes"] == 36 and out["checkpoint_write_s"] == 6.0
    assert out["block_time_s"] == {"wall": 2.0, "emulated": 1.0}
    empty = bench.result_row(row, {}, [], [], ideal=None, host_cpu_busy=None, own_cpu_busy=None, wall_s=None)
    assert empty["update_store_host_bytes_max"] is None and empty["checkpoint_writes"] is None


def test_training_window(bench):
    assert bench.training_window([]) == (False, False)
    assert bench.training_window([{"steps_done": {"0": 0}}]) == (False, False)
    assert bench.training_window([{"steps_done": {"0": 1}}, {"steps_done": {}}]) == (True, False)
    assert bench.training_window([{"steps_done": {"0": 3}, "done": True}]) == (True, True)


def test_localnet_argv_carries_link_and_emulation(bench):
    row = next(r for r in bench.rows() if r.name == "8b-a100-r8-20mbit:100ms")
    argv = bench.localnet_argv(row, Path("/tmp/x"), "data.txt")
    s = " ".join(argv)
    assert "--link 20mbit:100ms" in s and "--emulate-gpu a100" in s and "--time-scale 2.0" in s
    assert "--set data.tokenizer=null" in s and "--set pipeline.compression_ratio=8" in s
    assert "--wire-dtype bf16" in s
    tiny = bench.localnet_argv(bench.rows()[1], Path("/tmp/x"), "data.txt")
    assert "--emulate-gpu" not in tiny and "100mbit:50ms" in tiny and "--wire-dtype bf16" in " ".join(tiny)


def test_wire_dtype_is_the_one_the_validators_used(bench, monkeypatch, capsys):
    """``--wire-dtype`` sets every row's, which the localnet is given; the row reports the dtype the
    summary (the validators' status) says was used, the row's only when the summary has none."""
    import argparse

    from iota_subnet.network.cli import register
    seen = []
    monkeypatch.setattr(bench, "run_row", lambda r, *a, **k: seen.append(r) or {"name": r.name})
    monkeypatch.setattr(bench, "cpu_stage_seconds_per_token", lambda cfg: [1.0])
    assert bench.main(["--rows", "tiny-train-loopback,8b-a100-r8-20mbit:100ms", "--wire-dtype", "fp8", "--json"]) == 0
    assert [r.wire_dtype for r in seen] == ["fp8", "fp8"]
    argv = bench.localnet_argv(seen[0], Path("/tmp/x"), "data.txt")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(argv[3:]).wire_dtype == "fp8"          # after: python -m iota_subnet.cli
    with pytest.raises(SystemExit):
        bench.main(["--list", "--wire-dtype", "fp4"])
    capsys.readouterr()
    assert bench.main(["--list", "--rows", "tiny-train-loopback"]) == 0
    assert json.loads(capsys.readouterr().out)["wire_dtype"] == "bf16"
    kw = dict(ideal=None, host_cpu_busy=None, own_cpu_busy=None, wall_s=None)
    assert bench.result_row(seen[0], {"wire_dtype": "int8"}, [], [], **kw)["wire_dtype"] == "int8"
    assert bench.result_row(seen[0], {}, [], [], **kw)["wire_dtype"] == "fp8"


def test_localnet_emulation_plumbing():
    link, emu, miner, validator = emulation_argv("100mbit:50ms", "a100", None, None, 2.0)
    assert link == "100mbit:50ms" and emu["emulation"] and emu["accelerator"]["name"] == "A100-SXM4-80GB"
    assert miner[:4] == ["--link", "100mbit:50ms", "--time-scale", "2.0"] and "--emulate-gpu" in miner
    assert "--no-audits" in validator and "--emulate-gpu" not in validator
    assert emulation_argv("loopback", None, None, None, 1.0)[1] is None
    for bad in (("fast", None, None, None, 1.0), ("loopback", "tpu", None, None, 1.0),
                ("loopback", None, 0.5, None, 1.0), ("loopback", "a100", 1.5, None, 1.0),
                ("loopback", "2e14", None, None, 1.0), ("loopback", "a100", None, None, 0.0)):
        with pytest.raises(ConfigError):
            emulation_argv(*bad)


def test_home_rows_take_the_relays_link_and_per_peer_cap(bench, monkeypatch, capsys):
    """``--validator-link`` puts every row's validators (the relay of the ``-home`` rows) on their own
    link, ``--relay-rate`` caps the relay of the rows with home miners; both reach the localnet's command
    line (which parses them) and every result says which links and cap it ran with."""
    import argparse

    from iota_subnet.network.cli import register
    names = "1b-4090-r64-20mbit:100ms,1b-4090-r64-20mbit:100ms-home"
    seen = []
    monkeypatch.setattr(bench, "run_row", lambda r, *a, **k: seen.append(r) or {"name": r.name})
    assert bench.main(["--rows", names, "--validator-link", "1GBIT:10ms", "--relay-rate", "2.5e6", "--json"]) == 0
    public, home = seen
    assert (public.validator_link, public.relay_rate) == ("1gbit:10ms", None)        # no relay to cap
    assert (home.validator_link, home.relay_rate, home.home_replicas) == ("1gbit:10ms", 2.5e6, 1)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    a = parser.parse_args(bench.localnet_argv(home, Path("o"), "d")[3:])          # after: python -m iota_subnet.cli
    assert (a.link, a.validator_link, a.relay_rate, a.home_replicas) == ("20mbit:100ms", "1gbit:10ms", 2.5e6, 1)
    plain = next(r for r in bench.rows() if r.name == "1b-4090-r64-20mbit:100ms")
    assert "--validator-link" not in bench.localnet_argv(plain, Path("o"), "d")
    kw = dict(ideal=None, host_cpu_busy=None, own_cpu_busy=None, wall_s=None)
    assert {k: bench.result_row(home, {}, [], [], **kw)[k] for k in ("link", "validator_link", "relay_rate_bytes_per_s")} \
        == {"link": "20mbit:100ms", "validator_link": "1gbit:10ms", "relay_rate_bytes_per_s": 2.5e6}
    assert bench.result_row(plain, {}, [], [], **kw)["validator_link"] == "20mbit:100ms"
    capsys.readouterr()
    assert bench.main(["--list", "--rows", names, "--validator-link", "1gbit:10ms"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["validator_link"], r["home_replicas"], r["relay_rate_bytes_per_s"]) for r in listed] == \
        [("1gbit:10ms", 0, None), ("1gbit:10ms", 1, None)]
    for bad, msg in ((["--validator-link", "1gbit:10"], "--validator-link '1gbit:10': bad delay"),
                     (["--relay-rate", "0"], "--relay-rate 0.0 must be > 0")):
        assert bench.main(["--list", *bad]) == 2
        assert msg in capsys.readouterr().err


def test_joiner_fields_from_a_summary(bench):
    """A row's result carries the ``--join-at`` joiner's figures (emulated seconds), none without a joiner."""
    j = {"at_step": 3, "stage": 0, "joined": True, "joined_at_step": 4, "joined_emulated_s": 40.0, "synced_at_emulated_s": 60.0, "in_sync": True,
         "synced": True, "sync_emulated_s": 12.5, "join_to_sync_emulated_s": 20.0, "sync_bytes": 12_900_000_000,
         "sync_donors": 2}
    f = bench.joiner_fields({"joiner": j})
    assert f == {"joiner_at_step": 3, "joiner_stage": 0, "joiner_joined_at_step": 4, "joiner_joined_s": 40.0, "joiner_synced_at_s": 60.0,
                 "joiner_in_sync": True, "joiner_sync_s": 12.5, "joiner_join_to_sync_s": 20.0,
                 "joiner_sync_bytes": 12_900_000_000, "joiner_sync_donors": 2}
    assert bench.joiner_fields({}) == {}
    assert not bench.joiner_fields({"joiner": {**j, "synced": False}})["joiner_in_sync"]
    row = bench.rows()[0]
    out = bench.result_row(row, {"joiner": j}, [], [], ideal=None, host_cpu_busy=None, own_cpu_busy=None, wall_s=None)
    assert out["joiner_sync_s"] == 12.5 and out["joiner_in_sync"]
    assert "joiner_sync_s" not in bench.result_row(row, {}, [], [], ideal=None, host_cpu_busy=None,
                                                   own_cpu_busy=None, wall_s=None)
