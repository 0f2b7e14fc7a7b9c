"""MLflow tracking that never stops training: every failure becomes a warning.

`MlflowClient` is used instead of `mlflow.start_run` so that no global "active run" exists and
several trackers can coexist in one process (tests, evaluation next to training).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WARN_EVERY = 50  # failed log calls per warning: a dead server must not flood the console


def default_tracking_uri(run_dir: Path) -> str:
    """An absolute sqlite path, so the store does not depend on the working directory."""
    return f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """MLflow params are flat strings; nested sections become dotted keys (`grpo.group_size`)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _fail_fast_http() -> None:
    """MLflow's HTTP defaults (7 retries with exponential backoff, 120 s timeout) make a dead
    server block training for minutes per call; one retry and a 10 s timeout cost seconds.
    `setdefault` so that a user's own settings win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class Tracker:
    """One MLflow run. No method raises: tracking problems must never cost a training run."""

    def __init__(self, uri: str, experiment: str, artifact_dir: Path, enabled: bool = True) -> None:
        self.uri = uri
        self.experiment = experiment
        self.artifact_dir = Path(artifact_dir)
        self.enabled = enabled
        self._client: Any = None  # set only once start() succeeded
        self._run_id: str | None = None
        self._failures = 0

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def start(self, run_name: str, params: dict[str, Any], config_yaml: str, run_id: str | None = None) -> str | None:
        """Opens a new run, or re-opens `run_id` when resuming so one training run stays one MLflow run."""
        if not self.enabled:
            return None
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

            _fail_fast_http()
            client = MlflowClient(self.uri)
            exp = client.get_experiment_by_name(self.experiment)
            if exp is None:  # without an explicit location, artifacts land in ./mlruns of the cwd
                exp_id = client.create_experiment(self.experiment, artifact_location=self.artifact_dir.resolve().as_uri())
            else:
                exp_id = exp.experiment_id
            if run_id is None:
                run_id = client.create_run(exp_id, run_name=run_name).info.run_id
                items = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in _flatten(params).items()]
                for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
                    client.log_batch(run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])
                client.log_text(run_id, config_yaml, "config.yaml")
            else:
                # params are write-once in MLflow (a changed value raises), so they are not re-logged;
                # the resumed config is kept next to the original instead of overwriting it
                client.update_run(run_id, status="RUNNING")
                client.log_text(run_id, config_yaml, f"config_resumed_{time.strftime('%Y%m%d-%H%M%S')}.yaml")
        except Exception as e:
            log.warning("MLflow tracking disabled for this run (training goes on): %s: %s", type(e).__name__, e)
            self.enabled = False
            return None
        self._client, self._run_id = client, run_id
        return run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Drops NaN/inf: MLflow would store NaN and clamp inf to the largest float, spoiling the plots."""
        if self._client is None:
            return
        try:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = []
            for key, value in metrics.items():
                if math.isfinite(value := float(value)):
                    batch.append(Metric(key, value, now, step))
                else:
                    log.debug("metric %s=%s at step %d is not finite: not logged", key, value, step)
            if batch:
                self._client.log_batch(self._run_id, metrics=batch)
        except Exception as e:
            self._warn("log_metrics", e)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self._client is None:
            return
        try:
            self._client.log_artifact(self._run_id, str(path), artifact_path)
        except Exception as e:
            self._warn("log_artifact", e)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        """JSON or YAML by the file's extension (MLflow's own serialisation)."""
        if self._client is None:
            return
        try:
            self._client.log_dict(self._run_id, data, artifact_file)
        except Exception as e:
            self._warn("log_dict", e)

    def end(self, status: str = "FINISHED") -> None:
        if self._client is None:
            return
        try:
            self._client.set_terminated(self._run_id, status=status)
        except Exception as e:
            self._warn("end", e)

    def _warn(self, what: str, e: Exception) -> None:
        self._failures += 1
        if (self._failures - 1) % WARN_EVERY == 0:
            log.warning("MLflow %s failed (training goes on; %d failures so far, warning once per %d): %s: %s",
                        what, self._failures, WARN_EVERY, type(e).__name__, e)
