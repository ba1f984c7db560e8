"""Studies: shipped definitions, one worker end to end, failures, dead workers, a report mid-study, PostgreSQL workers."""

import os
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pytest
import yaml

from archlab.spec import SpecError
from archlab.study.definition import STUDIES, load_study
from archlab.study.report import report
from archlab.study.runner import StudyChanged, check_unchanged, join, run_trial, settled, storage_url
from conftest import ROOT

SHIPPED = sorted(p.stem for p in STUDIES.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("scale", ["tiny", "gpu"])
def test_shipped_studies_validate(name, scale):
    study = load_study(name, scale)
    assert study.definition.baseline in study.specs
    assert len(study.plan()) == len(study.specs) * len(study.definition.seeds) * study.definition.lr.points


def test_the_shipped_studies_are_the_papers():
    assert set(SHIPPED) == {"loop-position", "loop-count", "esa-kind", "architectures", "window"}
    positions = {v: s.loop.position for v, s in load_study("loop-position").specs.items()}
    assert positions == {"yoco": "none", "yoco-u": "lower", "upper-loop": "upper", "upper-loop-no-shared-kv": "upper", "deeper": "none"}
    assert [s.loop.times for s in load_study("loop-count").specs.values()] == [1, 2, 3, 5]
    assert [s.layout.self_decoder.blocks[0].window for s in load_study("window", "gpu").specs.values()] == [128, 256, 512, 1024]


def mini(tmp_path, name="mini", variants=None, steps=4, **extra):
    definition = {
        "schema_version": 1, "name": name, "baseline": "yoco",
        "variants": variants or {"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}},
        "seeds": [0], "lr": {"low": 0.002, "high": 0.004, "points": 2}, **extra,
        "scales": {"tiny": {"specs": str(ROOT / "specs" / "tiny"), "train": {
            "steps": steps, "batch_size": 4, "micro_batch_size": 4, "seq_len": 32, "eval_interval": 2, "eval_batches": 1,
            "log_interval": 1, "checkpoint_interval": 1000, "keep_checkpoints": 1,
            "data": {"source": "stdlib", "max_bytes": 200_000}}}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(definition))
    return path


def archlab(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "archlab", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "200"}, **kwargs)


def trials_of(url, name):
    return optuna.load_study(study_name=f"{name}-tiny", storage=url).get_trials()


def test_a_study_runs_every_planned_trial_once_and_reports(tmp_path):
    out = tmp_path / "out"
    result = archlab("study", "run", mini(tmp_path), "--out", out)
    assert result.returncode == 0, result.stderr
    trials = trials_of(f"sqlite:///{out / 'optuna.db'}", "mini")
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)
    assert sorted(settled(trials)) == [("yoco", 0, 0), ("yoco", 0, 1), ("yoco-u", 0, 0), ("yoco-u", 0, 1)]
    assert all(sorted(t.intermediate_values) == [2, 4] for t in trials)  # reported for the pruner
    assert "| yoco-u |" in result.stdout and "vs baseline" in result.stdout and "4 complete" in result.stdout
    assert sum(line.startswith("trial ") and ": complete, val_loss " in line for line in result.stderr.splitlines()) == 4  # a log, not a terminal
    for png in ("curves.png", "loss_vs_flops.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    again = archlab("study", "report", mini(tmp_path), "--out", out)  # the report alone, from the storage
    assert again.returncode == 0 and again.stdout == result.stdout
    rerun = archlab("study", "run", mini(tmp_path), "--out", out)  # a finished study runs nothing again
    assert rerun.returncode == 0 and len(trials_of(f"sqlite:///{out / 'optuna.db'}", "mini")) == 4


def test_a_failing_trial_is_recorded_and_the_study_goes_on(tmp_path):
    variants = {"yoco": {"spec": "yoco.yaml"}, "exploding": {"spec": "yoco.yaml", "set": {"init_std": 1.0e30}}}
    path = mini(tmp_path, "failing", variants, steps=6)
    out = tmp_path / "out"
    result = archlab("study", "run", path, "--out", out)
    assert result.returncode == 0, result.stderr
    trials = trials_of(f"sqlite:///{out / 'optuna.db'}", "failing")
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert failed and all("loss became" in t.user_attrs["failure"] for t in failed)
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2  # the other variant still ran
    assert "0/2" in result.stdout  # pruned/failed column of the failing variant
    assert "4 planned: 2 complete, 0 running, 0 waiting, 2 failed, 0 pruned" in result.stdout and "incomplete" not in result.stdout
    listed = result.stdout.split("## Failed trials")[1]
    assert all(f"| {t.number} | exploding | 0 | {t.user_attrs['lr']:.2g} | TrainError: loss became" in listed for t in failed)


def test_a_study_whose_every_trial_failed_fails(tmp_path):
    variants = {"yoco": {"spec": "yoco.yaml", "set": {"init_std": 1.0e30}}}
    out = tmp_path / "out"
    result = archlab("study", "run", mini(tmp_path, "doomed", variants, steps=2, lr={"low": 0.003, "high": 0.003, "points": 1}), "--out", out)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "notice" not in result.stderr
    assert f"no trial succeeded (1 of 1 failed); why each failed is under Failed trials in {out / 'report.md'}" in result.stderr
    assert "TrainError: loss became" in (out / "report.md").read_text()


def test_an_unreachable_storage_is_named(tmp_path):
    url = "postgresql://nobody@127.0.0.1:1/none"  # nothing listens on port 1
    for command in ("run", "report"):
        result = archlab("study", command, mini(tmp_path), "--storage", url, "--out", tmp_path / "out")
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"cannot open the study storage {url}" in result.stderr or "no database driver for postgresql" in result.stderr


def test_a_killed_worker_is_detected_and_its_trial_retried(tmp_path):
    path, out = mini(tmp_path, "killed", steps=150), tmp_path / "out"
    url = f"sqlite:///{out / 'optuna.db'}"
    worker = subprocess.Popen([sys.executable, "-m", "archlab", "study", "run", str(path), "--out", str(out), "--grace-period", "4"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and worker.poll() is None:
        try:
            running = [t for t in trials_of(url, "killed") if t.state.name == "RUNNING" and t.intermediate_values]
        except Exception:  # the storage is still being created
            running = []
        if running:
            break
        time.sleep(0.1)
    worker.send_signal(signal.SIGKILL)
    assert worker.wait() == -signal.SIGKILL
    result = archlab("study", "run", path, "--out", out, "--grace-period", "4")
    assert result.returncode == 0, result.stderr
    trials = trials_of(url, "killed")
    stale = [t for t in trials if t.state.name == "FAIL"]
    assert len(stale) == 1
    done = settled(trials)
    assert len(done) == 4 and all(t.state.name == "COMPLETE" for t in done.values())
    retry = [t for t in done.values() if t.system_attrs.get("failed_trial") == stale[0].number]
    assert len(retry) == 1
    # the report counts the planned trial once, by its retry, and says what became of the first attempt
    assert "4 planned: 4 complete, 0 running, 0 waiting, 0 failed, 0 pruned; 1 lost their worker" in result.stdout
    assert result.stdout.count("| 0/0 |") == 2
    assert f"| {stale[0].number} | {stale[0].params['variant']} |" in result.stdout
    assert "stopped sending heartbeats after step" in result.stdout and f"| trial {retry[0].number}, complete |" in result.stdout


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_a_report_mid_study_says_it_is_incomplete(tmp_path):
    study = load_study(str(mini(tmp_path, "partial")))
    out = tmp_path / "out"
    url = storage_url(study, out, None)
    optuna_study = join(study, out, url, grace_period=60)
    run_trial(study, optuna_study, optuna_study._pop_waiting_trial_id(), out)
    optuna_study._pop_waiting_trial_id()  # claimed by a worker still training it
    text = report(study, optuna_study, out, url)
    assert "4 planned: 1 complete, 1 running, 2 waiting, 0 failed, 0 pruned; **incomplete**: the table covers only the 1 of 4 that have finished" in text
    assert "Failed trials" not in text


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options
def test_trials_trained_under_another_definition_are_not_reported_as_this_ones(tmp_path):
    path, out = mini(tmp_path, "edited", steps=2), tmp_path / "out"
    study = load_study(str(path))
    url = storage_url(study, out, None)
    optuna_study = join(study, out, url, grace_period=60)
    run_trial(study, optuna_study, optuna_study._pop_waiting_trial_id(), out)  # yoco, seed 0, lr slot 0 (lr 0.002)
    trained = optuna_study.get_trials()[0]

    def edit(**changes):
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **changes}))
        return load_study(str(path))

    edit(lr={"low": 0.001, "high": 0.004, "points": 2})
    for command in ("run", "report"):
        result = archlab("study", command, path, "--out", out)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert "holds 1 trial that trained under another definition" in result.stderr
        assert "yoco seed 0 lr slot 0: lr 0.002 -> 0.001" in result.stderr
    after = trials_of(url, "edited")
    assert len(after) == 4 and after[0].state.name == "COMPLETE" and after[0].value == trained.value  # kept as it was
    # a change that no started trial trained under, and a new seed, are fine: the new seed's trials are planned
    edited = edit(lr={"low": 0.002, "high": 0.008, "points": 2}, seeds=[0, 1])
    check_unchanged(edited, optuna_study)
    assert len(join(edited, out, url, grace_period=60).get_trials()) == 8
    edited = edit(variants={"yoco": {"spec": "yoco.yaml", "set": {"init_std": 0.01}}, "yoco-u": {"spec": "yoco-u.yaml"}})
    with pytest.raises(StudyChanged, match=r"spec\.init_std 0\.02 -> 0\.01"):
        check_unchanged(edited, optuna_study)
    # a trial recorded before trials kept their setup is checked by the lr and steps it kept
    legacy = optuna.create_study(study_name="edited-tiny")
    legacy.add_trial(optuna.trial.create_trial(
        params={"variant": "yoco", "seed": 0, "slot": 1}, value=2.0, user_attrs={"lr": 0.004, "steps": 2},
        distributions={"variant": optuna.distributions.CategoricalDistribution(["yoco", "yoco-u"]),
                       "seed": optuna.distributions.CategoricalDistribution([0, 1]), "slot": optuna.distributions.IntDistribution(0, 1)}))
    with pytest.raises(StudyChanged, match=r"yoco seed 0 lr slot 1: lr 0\.004 -> 0\.008\n"):
        check_unchanged(edited, legacy)


def test_two_workers_share_a_postgresql_study(tmp_path):
    url = os.environ.get("ARCHLAB_TEST_POSTGRES")
    if not url:
        pytest.skip("ARCHLAB_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
    name = f"pg{uuid.uuid4().hex[:8]}"
    variants = {v: {"spec": f"{v}.yaml"} for v in ("yoco", "yoco-u", "upper-loop", "deeper")}
    path = mini(tmp_path, name, variants, steps=8)
    command = [sys.executable, "-m", "archlab", "study", "run", str(path), "--storage", url]
    workers = [subprocess.Popen([*command, "--out", str(tmp_path / f"w{i}")], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in range(2)]
    for worker in workers:
        _, stderr = worker.communicate(timeout=600)
        assert worker.returncode == 0, stderr
    trials = trials_of(url, name)
    keys = [(t.params["variant"], t.params["seed"], t.params["slot"]) for t in trials]
    assert len(trials) == 8 and len(set(keys)) == 8  # every planned trial once: none lost, none duplicated
    assert all(t.state.name == "COMPLETE" for t in trials)
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # both workers took trials


def test_bad_study_definitions_are_named(tmp_path):
    path = mini(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["baseline"] = "gpt"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match="'gpt' is not one of the variants"):
        load_study(str(path))
    path.write_text(yaml.safe_dump({**data, "baseline": "yoco", "seeds": [0, -1]}))
    with pytest.raises(SpecError, match=r"seeds\[1\]: Input should be greater than or equal to 0"):
        load_study(str(path))
    with pytest.raises(SpecError, match="no scale 'huge'"):
        load_study("loop-position", "huge")
    with pytest.raises(SpecError, match="no shipped study of that name"):
        load_study("loop-placement")
    result = archlab("study", "run", "loop-placement")
    assert result.returncode == 1 and "shipped:" in result.stderr and "Traceback" not in result.stderr


def test_a_shipped_study_is_a_command():
    result = archlab("study", "window", "--help")
    assert result.returncode == 0 and "Run (or join, or resume) a study" in result.stdout
    listed = archlab("study", "--help")
    assert all(name in listed.stdout for name in SHIPPED)
