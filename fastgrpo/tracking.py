"""MLflow tracking that never stops training: every failure becomes a warning."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# a dead tracking server must cost seconds, not minutes of retries
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


class Tracker:
    def __init__(self, uri: str, experiment: str, artifact_dir: Path, enabled: bool = True) -> None:
        self.uri = uri
        self.experiment = experiment
        self.artifact_dir = Path(artifact_dir)
        self.enabled = enabled
        self._client: Any = None
        self._run_id: str | None = None
        self._failures = 0

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def _warn(self, what: str, e: Exception) -> None:
        if self._failures % 50 == 0:
            log.warning("MLflow %s failed (training goes on): %s: %s", what, type(e).__name__, e)
        self._failures += 1

    def start(self, run_name: str, params: dict[str, Any], config_yaml: str, run_id: str | None = None) -> str | None:
        if not self.enabled:
            return None
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(self.uri)
            exp = client.get_experiment_by_name(self.experiment)
            if exp is None:
                self.artifact_dir.mkdir(parents=True, exist_ok=True)
                exp_id = client.create_experiment(self.experiment, artifact_location=self.artifact_dir.resolve().as_uri())
            else:
                exp_id = exp.experiment_id
            if run_id is not None:
                client.update_run(run_id, status="RUNNING")
            else:
                run_id = client.create_run(exp_id, run_name=run_name).info.run_id
                from mlflow.entities import Param

                items = [Param(k, str(v)[:6000]) for k, v in params.items()]
                for i in range(0, len(items), 100):
                    client.log_batch(run_id, params=items[i : i + 100])
                with tempfile.TemporaryDirectory() as d:
                    (Path(d) / "config.yaml").write_text(config_yaml)
                    client.log_artifact(run_id, str(Path(d) / "config.yaml"))
            self._client, self._run_id = client, run_id
            return run_id
        except Exception as e:
            log.warning("MLflow tracking disabled for this run (training goes on): %s: %s", type(e).__name__, e)
            self.enabled = False
            return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._active():
            return
        try:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(float(v))]
            self._client.log_batch(self._run_id, metrics=batch)
        except Exception as e:
            self._warn("log_metrics", e)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self._active():
            try:
                self._client.log_artifact(self._run_id, str(path), artifact_path)
            except Exception as e:
                self._warn("log_artifact", e)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        if self._active():
            try:
                self._client.log_text(self._run_id, json.dumps(data, indent=2), artifact_file)
            except Exception as e:
                self._warn("log_dict", e)

    def end(self, status: str = "FINISHED") -> None:
        if self._active():
            try:
                self._client.set_terminated(self._run_id, status=status)
            except Exception as e:
                self._warn("end", e)

    def _active(self) -> bool:
        return self.enabled and self._client is not None and self._run_id is not None
