"""How the churn benchmark adds up runs made in different sittings (scripts/bench_churn.py; the runs
themselves are the benchmark, not a test): a finished run's result is reused when its parameters
match, from ``OUT/NAME/bench_run.json`` or from the committed ``--keep`` folder, and the figures are
computed over the runs finished so far."""
from __future__ import annotations

import json

import pytest
from support.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_churn")


def _result(bench, argv, name, chaos, val_loss, events=0):
    """A result as ``run_one`` writes it, for the parameters ``argv`` parses to."""
    a = bench.build_parser().parse_args(argv)
    return {"name": name, "params": bench.run_params(a, chaos), "chaos": chaos, "timed_out": False,
            "val_loss": val_loss, "final_loss": val_loss, "wall_s": 1.0, "events": events,
            "events_by_kind": {"kill": events} if chaos else {}, "skipped_by_kind": {}, "unrecovered": [],
            "microbatches_lost": 0 if chaos else None, "samples_repeated": 0 if chaos else None,
            "samples_skipped": 0 if chaos else None, "merges_applied": 10, "mismatch_reports": 0,
            "audits": {"audits": 5, "audits_failed": 0, "flagged": []}, "curve": [[0, 9.0], [1, val_loss]]}


def undisturbed_only(tmp_path, n: int) -> tuple:
    """A ``--keep`` folder (created) and the arguments of a plan of ``n`` undisturbed runs, starting none."""
    keep = tmp_path / "keep"
    keep.mkdir()
    return keep, ["--out", str(tmp_path / "out"), "--keep", str(keep), "--undisturbed", str(n), "--seeds", "",
                  "--max-runs", "0", "--json"]


def test_kept_results_add_up_and_only_matching_parameters_are_reused(bench, tmp_path, capsys):
    keep, out = tmp_path / "keep", tmp_path / "out"
    argv = ["--out", str(out), "--keep", str(keep), "--seeds", "1,2", "--max-runs", "0", "--json"]
    seed1 = f"{bench.DEFAULT_CHAOS},seed=1,min_live=2"
    keep.mkdir()
    (keep / "undisturbed0.json").write_text(json.dumps(_result(bench, argv, "undisturbed0", None, 5.50)))
    (keep / "chaos-seed1.json").write_text(json.dumps(_result(bench, argv, "chaos-seed1", seed1, 5.61, events=44)))
    # a result of another setting (other steps) is not this benchmark's: not reused
    other = _result(bench, argv + ["--steps", "20"], "undisturbed1", None, 7.0)
    (out / "undisturbed1").mkdir(parents=True)
    (out / "undisturbed1" / bench.RESULT).write_text(json.dumps(other))

    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["runs_left"] == ["undisturbed1", "chaos-seed2"]          # --max-runs 0: nothing started
    assert res["val_loss_per_run"] == {"undisturbed0": 5.50, "chaos-seed1": 5.61}
    assert res["events"] == 44 and res["events_by_kind"] == {"chaos-seed1": {"kill": 44}}
    assert res["relative_gap"] == pytest.approx(0.11 / 5.50)
    assert res["per_seed_gap"] == {"chaos-seed1": pytest.approx(0.11 / 5.50)}
    assert not (out / "undisturbed0").exists()                          # reused, not re-run


def test_a_timed_out_stopped_or_unreadable_result_is_run_again(bench, tmp_path, capsys):
    """Timed out, stopped before its final evaluation (the bench killed mid-run wrote a result with no
    val loss, 2026-12-03), or unreadable: none is reused."""
    keep, argv = undisturbed_only(tmp_path, 3)
    timed_out = {**_result(bench, argv, "undisturbed0", None, 5.5), "timed_out": True}
    (keep / "undisturbed0.json").write_text(json.dumps(timed_out))
    (keep / "undisturbed1.json").write_text("{not json")
    stopped = {**_result(bench, argv, "undisturbed2", None, 5.5), "val_loss": None, "final_loss": None}
    (tmp_path / "out" / "undisturbed2").mkdir(parents=True)
    (tmp_path / "out" / "undisturbed2" / bench.RESULT).write_text(json.dumps(stopped))
    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["runs_left"] == ["undisturbed0", "undisturbed1", "undisturbed2"] and res["val_loss_undisturbed"] is None
    assert res["plot"] is None                                          # nothing finished: nothing to draw


def test_a_run_of_other_code_is_not_reused(bench, tmp_path, capsys, monkeypatch):
    """The acceptance compares runs of one code version: a kept run made on other code (another tree of
    iota_subnet, neurons or configs) is listed as left, not added up."""
    keep, argv = undisturbed_only(tmp_path, 2)
    (keep / "undisturbed0.json").write_text(json.dumps(_result(bench, argv, "undisturbed0", None, 5.5)))
    monkeypatch.setattr(bench, "code_version", lambda: "0123456789ab-other-code")
    (keep / "undisturbed1.json").write_text(json.dumps(_result(bench, argv, "undisturbed1", None, 5.6)))
    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["code"] == "0123456789ab-other-code"
    assert res["runs_left"] == ["undisturbed0"] and res["val_loss_per_run"] == {"undisturbed1": 5.6}


def test_the_code_version_names_the_trees_the_runs_execute(bench):
    if not (bench.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ids = bench.code_version().split("+")[0].split("-")
    assert len(ids) == len(bench.CODE_PATHS) and all(len(i) == 12 and int(i, 16) >= 0 for i in ids)


def test_a_run_whose_code_changed_while_it_ran_is_not_reused(bench, tmp_path, capsys):
    keep, argv = undisturbed_only(tmp_path, 1)
    mixed = {**_result(bench, argv, "undisturbed0", None, 5.5), "code_changed_during_run": True}
    (keep / "undisturbed0.json").write_text(json.dumps(mixed))
    assert bench.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["runs_left"] == ["undisturbed0"]


@pytest.mark.parametrize("argv, msg", [
    (["--chaos", "explode=1/min"], "unknown kind 'explode'"),
    (["--seeds", "a,b"], "--seeds: a comma-separated list of integers"),
    (["--replicas", "2", "--chaos", "kill=1/min"], "would never run"),     # min_live=2 of 2 replicas, no joins
])
def test_a_bad_chaos_spec_or_seed_list_is_told_before_any_run(bench, tmp_path, capsys, argv, msg):
    """Before, a typo in --chaos surfaced as a traceback when the first chaos run started, after the
    undisturbed runs (about 45 minutes on 2 cores)."""
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--out", str(tmp_path / "runs")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
