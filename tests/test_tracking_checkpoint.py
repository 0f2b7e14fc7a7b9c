"""MLflow tracking on a real sqlite store, and atomic checkpoints on disk."""

import math

import pytest
from mlflow.tracking import MlflowClient

from fastgrpo.checkpoint import CheckpointManager
from fastgrpo.tracking import Tracker, default_tracking_uri


def test_metrics_params_artifact_and_resume(tmp_path):
    uri = default_tracking_uri(tmp_path)
    t = Tracker(uri, "exp", tmp_path / "art")
    run_id = t.start("r", {"grpo.steps": 3, "model.path": "x"}, "grpo:\n  steps: 3\n")
    t.log_metrics({"reward_mean": 0.5, "loss": float("nan")}, step=1)
    t.end()
    t2 = Tracker(uri, "exp", tmp_path / "art")
    assert t2.start("r", {"grpo.steps": 3}, "", run_id=run_id) == run_id
    t2.log_metrics({"reward_mean": 0.75}, step=2)
    t2.end()
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert len(runs) == 1 and runs[0].data.params["grpo.steps"] == "3"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward_mean")] == [(1, 0.5), (2, 0.75)]
    assert client.get_metric_history(run_id, "loss") == []  # NaN dropped, not sent
    assert (tmp_path / "art").exists() and any(p.name == "config.yaml" for p in (tmp_path / "art").rglob("*"))


@pytest.mark.parametrize("kind", ["unwritable", "scheme"])
def test_bad_uri_warns_and_training_goes_on(tmp_path, kind, caplog):
    (tmp_path / "a_file").write_text("")
    uri = f"sqlite:///{tmp_path}/a_file/mlflow.db" if kind == "unwritable" else "nosuchscheme://x"
    t = Tracker(uri, "exp", tmp_path / "art")
    with caplog.at_level("WARNING"):
        assert t.start("r", {}, "") is None
    assert "training goes on" in caplog.text
    t.log_metrics({"a": 1.0}, step=1)  # no raise
    t.end()


def test_disabled_tracker_writes_nothing(tmp_path):
    t = Tracker(default_tracking_uri(tmp_path), "exp", tmp_path / "art", enabled=False)
    assert t.start("r", {}, "") is None
    t.log_metrics({"a": 1.0}, step=1)
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    cm = CheckpointManager(tmp_path, keep_last=2)
    assert cm.latest() is None
    for step in (9, 10, 11):
        cm.save(step, lambda d, s=step: (d / "x.txt").write_text(str(s)))
    assert [p.name for p in cm.checkpoints()] == ["step_00000010", "step_00000011"]
    assert (cm.latest() / "x.txt").read_text() == "11"

    def crash(d):
        (d / "x.txt").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        cm.save(12, crash)
    assert cm.latest().name == "step_00000011"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    (tmp_path / ".tmp-step_00000013-abc").mkdir()  # left by a killed process
    assert cm.latest().name == "step_00000011"
    cm.save(11, lambda d: (d / "x.txt").write_text("again"))
    assert (cm.latest() / "x.txt").read_text() == "again"
    assert not (tmp_path / ".tmp-step_00000013-abc").exists()
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)
