"""MLflow tracking on a real sqlite store, read back with MlflowClient; failures must never raise."""

import json
import logging
import math
import shutil
import socket
import time

import pytest
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from fastgrpo.tracking import WARN_EVERY, Tracker, default_tracking_uri

CONFIG = "grpo:\n  group_size: 8\n"


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory):
    """MLflow spends ~6 s migrating the schema of each new sqlite file: migrate once, copy per test."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def uri(tmp_path, migrated_db):
    shutil.copy(migrated_db, tmp_path / "mlflow.db")
    return default_tracking_uri(tmp_path)


def only_run(client, experiment):
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return runs[0]


def history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_default_uri_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri("run") == f"sqlite:///{tmp_path.resolve()}/run/mlflow.db"


def test_metrics_params_and_artifacts(tmp_path, uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")  # truncation is ours, not MLflow's default
    art = tmp_path / "art"
    t = Tracker(uri, "exp", art)
    params = {"grpo": {"group_size": 8, "eps": 0.2}, "model.path": "p", "notes": "x" * (MAX_PARAM_VAL_LENGTH + 50)}
    run_id = t.start("my-run", params, CONFIG)
    assert run_id is not None and t.run_id == run_id
    t.log_metrics({"reward_mean": 0.25, "loss": 1.5}, step=1)
    t.log_metrics({"reward_mean": 0.75}, step=2)
    t.log_dict({"rows": [[1, 2]]}, "tables/stats.json")
    extra = tmp_path / "notes.txt"
    extra.write_text("hello")
    t.log_artifact(extra, "misc")
    t.end()

    client = MlflowClient(uri)
    run = only_run(client, "exp")
    assert run.info.run_id == run_id and run.info.run_name == "my-run" and run.info.status == "FINISHED"
    p = run.data.params
    assert (p["grpo.group_size"], p["grpo.eps"], p["model.path"]) == ("8", "0.2", "p")
    assert p["notes"] == "x" * MAX_PARAM_VAL_LENGTH
    assert history(client, run_id, "reward_mean") == [(1, 0.25), (2, 0.75)]
    assert history(client, run_id, "loss") == [(1, 1.5)]
    files = {p.relative_to(art).parts[-2:]: p for p in art.rglob("*") if p.is_file()}  # art/<exp>/<run>/artifacts/...
    assert files[("artifacts", "config.yaml")].read_text() == CONFIG
    assert json.loads(files[("tables", "stats.json")].read_text()) == {"rows": [[1, 2]]}
    assert files[("misc", "notes.txt")].read_text() == "hello"


def test_resume_appends_to_the_same_run(tmp_path, uri):
    t = Tracker(uri, "exp", tmp_path / "art")
    run_id = t.start("r", {"grpo": {"steps": 3}}, CONFIG)
    t.log_metrics({"reward_mean": 0.5}, step=1)
    t.end()

    t2 = Tracker(uri, "exp", tmp_path / "art")
    # a changed param value would make MLflow raise if it were re-logged
    assert t2.start("r", {"grpo": {"steps": 6}}, "grpo:\n  steps: 6\n", run_id=run_id) == run_id
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    t2.log_metrics({"reward_mean": 0.75}, step=2)
    t2.end()

    run = only_run(client, "exp")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.params["grpo.steps"] == "3"
    assert history(client, run_id, "reward_mean") == [(1, 0.5), (2, 0.75)]
    artifacts = sorted(f.path for f in client.list_artifacts(run_id))
    assert artifacts[0] == "config.yaml" and artifacts[1].startswith("config_resumed_") and len(artifacts) == 2


def test_non_finite_metrics_dropped(tmp_path, uri, caplog):
    t = Tracker(uri, "exp", tmp_path / "art")
    run_id = t.start("r", {}, CONFIG)
    with caplog.at_level(logging.DEBUG, logger="fastgrpo.tracking"):
        t.log_metrics({"ok": 2.0, "nan": float("nan"), "inf": math.inf}, step=3)
    client = MlflowClient(uri)
    assert history(client, run_id, "ok") == [(3, 2.0)]
    assert history(client, run_id, "nan") == [] and history(client, run_id, "inf") == []
    assert "nan=nan" in caplog.text and "inf=inf" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", ["unwritable", "scheme"])
def test_bad_uri_warns_once_and_training_goes_on(tmp_path, kind, caplog):
    (tmp_path / "a_file").write_text("")  # a directory that cannot be created, even by root
    uri = f"sqlite:///{tmp_path}/a_file/sub/mlflow.db" if kind == "unwritable" else "nosuchscheme://x"
    t = Tracker(uri, "exp", tmp_path / "art")
    with caplog.at_level(logging.WARNING, logger="fastgrpo.tracking"):
        assert t.start("r", {"a": 1}, CONFIG) is None
        for step in range(120):
            t.log_metrics({"a": 1.0}, step=step)
        t.log_dict({"a": 1}, "a.json")
        t.log_artifact(tmp_path / "a_file")
        t.end("FAILED")
    warnings = [r for r in caplog.records if r.name == "fastgrpo.tracking"]
    assert len(warnings) == 1 and "training goes on" in warnings[0].getMessage()
    expected = "a_file" if kind == "unwritable" else "nosuchscheme"
    assert expected in warnings[0].getMessage()  # the exception text is in the warning
    assert t.run_id is None and not t.enabled
    assert not (tmp_path / "art").exists()


def test_dead_http_server_fails_fast(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    with socket.socket() as s:  # a port that was just free: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = Tracker(f"http://127.0.0.1:{port}", "exp", tmp_path / "art")
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastgrpo.tracking"):
        assert t.start("r", {}, CONFIG) is None
    assert time.monotonic() - began < 10  # MLflow's defaults retry for minutes
    assert "training goes on" in caplog.text


def test_failing_log_calls_warn_once_per_50(tmp_path, uri, caplog):
    t = Tracker(uri, "exp", tmp_path / "art")
    run_id = t.start("r", {}, CONFIG)
    MlflowClient(uri).delete_run(run_id)  # MLflow now rejects every write to this run
    with caplog.at_level(logging.WARNING, logger="fastgrpo.tracking"):
        for step in range(2 * WARN_EVERY + 1):
            t.log_metrics({"a": 1.0}, step=step)
        t.end()
    warnings = [r.getMessage() for r in caplog.records if r.name == "fastgrpo.tracking"]
    assert len(warnings) == 3 and all("log_metrics" in w for w in warnings)
    assert t.run_id == run_id


def test_disabled_tracker_does_nothing(tmp_path):
    t = Tracker(default_tracking_uri(tmp_path), "exp", tmp_path / "art", enabled=False)
    assert t.start("r", {"a": 1}, CONFIG) is None and t.run_id is None
    t.log_metrics({"a": 1.0}, step=1)
    t.log_dict({"a": 1}, "a.json")
    t.end()
    assert list(tmp_path.iterdir()) == []
