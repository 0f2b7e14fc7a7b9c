"""`sbatch slurm/train_70b.sh` on a real one-node Slurm cluster, with the tiny CPU configuration through
overrides at the 70B config's topology in miniature (a world of 5: Megatron TP2 x PP2, an embedded engine
on every policy rank, so engines on both pipeline stages, and the draft slice of one rank learning from
all four engines, with `aware` speculation): the job's exit code, its
MLflow run and checkpoint; a second submission resumes; a cancelled job checkpoints and the next
submission resumes from it; the time-limit warning (USR1 to the batch shell) checkpoints, requeues the
job and the requeued job resumes and finishes. Run by `make test-slurm` (FASTGRPO_TEST_SLURM=1)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from fastgrpo.tracking import default_tracking_uri
from tests.conftest import tiny_overrides
from tests.slurm.cluster import LocalSlurm, require

if os.environ.get("CI") != "true":  # under CI a missing megatron-core fails the tier (its import below)
    pytest.importorskip("megatron.core")
import megatron.core  # noqa: E402,F401
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 600


@pytest.fixture(scope="session")  # session: set up before the session's policy, so a failed require() is quick
def slurm(tmp_path_factory):
    require()
    with LocalSlurm(tmp_path_factory.mktemp("cluster"), kill_wait_s=90) as cluster:
        yield cluster


def run_overrides(tmp: Path, policy: Path, draft: Path, steps: int) -> list[str]:
    """The tiny run as key=value arguments of the sbatch script (run_dir comes from FASTGRPO_RUN_DIR)."""
    args = tiny_overrides(tmp, policy, **{
        "trainer.backend": "megatron", "parallel.tensor": 2, "parallel.pipeline": 2, "parallel.draft_ranks": 1,
        "threads": 1, "grpo.steps": steps, "checkpoint.every": 1, "draft.path": draft, "speculation.policy": "aware",
        "draft.online": "async", "draft.async_publish_s": 0.5, "eval.at_start": "false", "task.eval_size": 4})
    return [a for a in args if not a.startswith("run_dir=")]


def submit(slurm: LocalSlurm, tmp: Path, run_dir: Path, args: list[str], wait: bool = True) -> str:
    """sbatch the 70B script with the tiny config: the #SBATCH header overridden for one CPU node."""
    env = slurm.env(FASTGRPO_HOME=str(REPO), FASTGRPO_VENV=sys.prefix, FASTGRPO_CONFIG="configs/tiny_cpu_plain.yaml",
                    FASTGRPO_RUN_DIR=str(run_dir), FASTGRPO_NPROC_PER_NODE="5", FASTGRPO_GPU_MEMORY_GB="8",
                    FASTGRPO_STOP_GRACE_S="60", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--time=20", f"--output={tmp}/job-%j.out",
            *(["--wait"] if wait else []), str(REPO / "slurm" / "train_70b.sh"), *args]
    done = slurm.run(*argv, check=False, cwd=tmp, env=env, timeout=JOB_TIMEOUT_S)
    job = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
    assert job.isdigit(), f"sbatch printed no job id: {done.stdout}\n{done.stderr}"
    if wait:
        assert done.returncode == 0, f"job {job} failed ({done.returncode}):\n{output(tmp, job)[-5000:]}"
    return job


def output(tmp: Path, job: str) -> str:
    path = tmp / f"job-{job}.out"
    return path.read_text() if path.exists() else ""


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def logged(run_dir: Path, key: str) -> dict[int, float]:
    """One metric of the one MLflow run, by step (a resume logs into the same run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(run_dir))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, key)}


def logged_steps(run_dir: Path) -> list[int]:
    return sorted(logged(run_dir, "reward_mean"))


def test_sbatch_runs_the_job_and_a_second_submission_resumes(slurm, tmp_path, tiny_policy, tiny_draft):
    run_dir = tmp_path / "run"
    job = submit(slurm, tmp_path, run_dir, run_overrides(tmp_path, tiny_policy, tiny_draft, steps=2))
    info = slurm.job(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
    log = output(tmp_path, job)
    assert "no checkpoint in" in log and "run finished" in log and "fits" in log  # fastgrpo plan ran first
    assert checkpoint_steps(run_dir)[-1] == 2 and (run_dir / "summary.json").exists()
    assert logged_steps(run_dir) == [1, 2]
    assert "engine 3: ranks 3 on node 0, led by rank 3" in log  # the plan's engine map: one per policy rank
    assert logged(run_dir, "rollout_engines") == {1: 4.0, 2: 4.0}
    assert logged(run_dir, "weights_version") == {1: 0.0, 2: 1.0}  # every engine served every push

    again = submit(slurm, tmp_path, run_dir, run_overrides(tmp_path, tiny_policy, tiny_draft, steps=3))
    log = output(tmp_path, again)
    assert f"resuming from {run_dir}/checkpoints/step_00000002" in log and "at step 2" in log, log[-3000:]
    assert checkpoint_steps(run_dir)[-1] == 3
    assert logged_steps(run_dir) == [1, 2, 3]  # one MLflow run, continued


def wait_for_step(tmp: Path, job: str, step: int, timeout_s: float = JOB_TIMEOUT_S) -> None:
    """Until the job's output shows a finished GRPO step >= `step`."""
    deadline = time.monotonic() + timeout_s
    while not any(int(n) >= step for n in re.findall(r"^step\s+(\d+)/", output(tmp, job), flags=re.M)):
        assert time.monotonic() < deadline, f"job {job} reached no step {step}:\n{output(tmp, job)[-3000:]}"
        time.sleep(1.0)


def test_scancel_checkpoints_and_the_next_submission_resumes(slurm, tmp_path, tiny_policy, tiny_draft):
    run_dir = tmp_path / "run"
    job = submit(slurm, tmp_path, run_dir, run_overrides(tmp_path, tiny_policy, tiny_draft, steps=40), wait=False)
    wait_for_step(tmp_path, job, 1)
    t0 = time.monotonic()
    slurm.run("scancel", job)
    info = slurm.wait_for(job, ("CANCELLED", "COMPLETED", "FAILED"), timeout_s=120)
    assert info["JobState"] == "CANCELLED", info
    ended_s = time.monotonic() - t0
    log = output(tmp_path, job)
    stopped = checkpoint_steps(run_dir)
    assert stopped and 1 <= stopped[-1] < 40, (stopped, log[-3000:])
    assert f"SIGTERM: stopped after step {stopped[-1]}" in log, log[-3000:]  # the ranks' own clean stop
    assert ended_s < 90, f"the cancelled job took {ended_s:.0f} s to end"

    resumed = submit(slurm, tmp_path, run_dir, run_overrides(tmp_path, tiny_policy, tiny_draft, steps=stopped[-1] + 1))
    log = output(tmp_path, resumed)
    assert f"resumed from {run_dir}/checkpoints/step_{stopped[-1]:08d}" in log, log[-3000:]
    assert checkpoint_steps(run_dir)[-1] == stopped[-1] + 1
    assert logged_steps(run_dir) == list(range(1, stopped[-1] + 2))


def test_the_time_limit_warning_checkpoints_requeues_and_resumes(slurm, tmp_path, tiny_policy, tiny_draft):
    """`--signal=B:USR1@600` in the script's header, delivered now (`scancel --batch --signal=USR1`):
    the ranks checkpoint, the job requeues itself, and its second start resumes and finishes."""
    run_dir = tmp_path / "run"
    job = submit(slurm, tmp_path, run_dir, run_overrides(tmp_path, tiny_policy, tiny_draft, steps=5), wait=False)
    wait_for_step(tmp_path, job, 1)
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    info = slurm.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout_s=JOB_TIMEOUT_S)
    log = output(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    stop = re.search(r"stopped at .*step_(\d{8}); requeueing", log)
    assert stop, log[-4000:]
    assert "(restart 1)" in log and f"resumed from {run_dir}/checkpoints/step_{stop.group(1)}" in log
    assert checkpoint_steps(run_dir)[-1] == 5 and logged_steps(run_dir) == [1, 2, 3, 4, 5]
