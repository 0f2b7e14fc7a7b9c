"""The distributed GRPO run on gloo, launched as on a cluster: `torchrun -m fastgrpo train` with the
Megatron trainer (TP, PP, DP), an embedded rollout engine on every policy rank fed by the weight push,
rank 0 tracking and checkpointing for all; and how it ends: resumed (at the same layout, bit for bit,
and at another), stopped by SIGTERM, failed on one rank."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from fastgrpo.distributed import free_port
from fastgrpo.local_world import kill_tree, run_world
from tests.conftest import tiny_overrides
from tests.test_train import history

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # torchrun worlds of 2-5 processes: `make test-slow`

STEP_KEYS = ("loss", "grad_norm", "entropy", "reward_mean", "response_len_mean")


def overrides(tmp: Path, policy: Path, draft: Path, **extra) -> list[str]:
    """A deterministic tiny run: a frozen draft with fixed trees (speculation without timing)."""
    return tiny_overrides(tmp, policy, **{
        "trainer.backend": "megatron", "draft.path": draft, "speculation.policy": "static", "draft.online": "off",
        "grpo.drop_equal_reward_groups": "false", "eval.at_start": "false", "task.eval_size": 4,
        "checkpoint.every": 1, "threads": 1} | extra)


class Torchrun:
    """`torchrun --nproc-per-node N -m fastgrpo train ...` in a session of its own; whatever of it is
    still alive at the end is ended by pid."""

    def __init__(self, nproc: int, args: list[str], log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "--log-dir", str(log.with_name(log.name + ".torchelastic")),  # (default: a new folder in /tmp, kept)
             "-m", "fastgrpo", "train", *args],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})

    def wait(self, timeout: float = 240.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            kill_tree(self.proc.pid)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, f"the run ended before {text!r}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout:.0f}s"
            time.sleep(0.5)

    def workers(self) -> list[psutil.Process]:
        """The ranks, by their RANK: torchrun's own children only (a rank's forked helpers, such as
        the checkpoint writer's manager, carry the same RANK and command line)."""
        ranks = {}
        for child in psutil.Process(self.proc.pid).children(recursive=False):
            try:
                rank, command = child.environ().get("RANK"), " ".join(child.cmdline())
            except psutil.NoSuchProcess:  # a short-lived helper process that ended meanwhile
                continue
            if rank is not None and "fastgrpo" in command:
                ranks[int(rank)] = child
        return [ranks[r] for r in sorted(ranks)]


def run(nproc: int, args: list[str], log: Path) -> str:
    launch = Torchrun(nproc, args, log)
    assert launch.wait() == 0, launch.output()[-4000:]
    return launch.output()


def _push_and_compare(rank, world, args):
    """Two GRPO steps through the loop's own pieces: every rollout's tokens, the first step's training
    metrics, and after every weight push the engine's tensors against what the trainer exports (full
    Hugging Face tensors)."""
    from fastgrpo.config import load_config
    from fastgrpo.run_setup import setup_run
    from fastgrpo.grpo.batch import training_batch
    from fastgrpo.train import rollout

    run = setup_run(load_config(None, args), resume=False)
    initial = {n: t.clone() for n, t in run.trainer.export_weights()}
    seen, tokens, metrics = [], [], []
    for step in range(2):
        problems = run.data.next_batch(run.cfg.rollout.prompts_per_step)
        answers = rollout(run, problems, seed=step)
        tokens.append([c.token_ids for c in answers.completions])
        batch, _ = training_batch([p.prompt_ids for p in problems], answers.completions, answers.rewards,
                                  run.cfg.grpo)
        metrics.append(run.trainer.train_step(batch))
        run.bridge.push(run.trainer.export_weights(), version=step + 1)
        exported = {n: t.clone() for n, t in run.trainer.export_weights()}
        if run.engine is not None:
            held = dict(run.engine.model.named_weights())
            seen.append({"version": run.engine.weights_version, "tensors": len(held),
                         "bit_exact": all(torch.equal(t, exported[n]) for n, t in held.items()),
                         "moved": max(float((exported[n] - initial[n]).abs().max()) for n in held)})
    return {"engine": run.world.engine, "engines": run.world.engines.engines, "seen": seen, "tokens": tokens,
            "metrics": metrics}


def test_a_tp2_pp2_world_runs_an_engine_on_every_rank_and_equals_one_process(tmp_path, tiny_policy, tiny_draft):
    """TP2 x PP2 (a world of 4, one trainer replica): an embedded engine on each of the 4 ranks (on both
    pipeline stages), each holding exactly the tensors the trainer exports (TP shards gathered, stages
    broadcast, Megatron names made Hugging Face ones) at the same version after every push; the
    prompts dealt over the 4 engines give token for token the rollouts of one process's one engine
    (keyed sampling), and the first step's loss and gradient norm are that process's."""
    args = overrides(tmp_path, tiny_policy, tiny_draft, **{"parallel.tensor": 2, "parallel.pipeline": 2,
                                                           "tracking.enabled": "false"})
    results = run_world(_push_and_compare, 4, tmp_path / "world", args, timeout_s=300.0)
    one = run_world(_push_and_compare, 1, tmp_path / "one", [*args, "trainer.backend=torch", "parallel.tensor=1",
                                                              "parallel.pipeline=1", f"run_dir={tmp_path / 'one'}"])[0]
    assert [r["engine"] for r in results] == [0, 1, 2, 3] and all(r["engines"] == 4 for r in results)
    for r in results:
        assert [s["version"] for s in r["seen"]] == [1, 2]
        assert all(s["bit_exact"] and s["tensors"] >= 9 for s in r["seen"])
        assert r["seen"][-1]["moved"] > 1e-4  # two updates at lr 1e-3 moved the weights the engines serve
        assert r["tokens"][0] == one["tokens"][0]  # step 0: the same weights, the same samples
    first = results[0]["metrics"][0]
    # the loss is a mean of O(1) per-token terms that nearly cancel (about -2e-3 here): held in absolute
    # terms to fp32's few ulps of 1 (Megatron's sums run in another order: 5e-9 apart on an AMD EPYC)
    assert first["loss"] == pytest.approx(one["metrics"][0]["loss"], rel=1e-6, abs=1e-7)
    assert first["grad_norm"] == pytest.approx(one["metrics"][0]["grad_norm"], rel=1e-6)
    assert all(r["metrics"][0]["grad_norm"] == first["grad_norm"] for r in results)


def test_torchrun_run_equals_one_process_and_resumes_exactly_and_at_another_layout(tmp_path, tiny_policy, tiny_draft):
    """TP2 under torchrun, one replica: its first rollout is the single-process run's (the same seeds
    and the same weights: the engine does not know who trains); 2 steps + `--resume` + 1 step equals 3
    steps (losses, gradient norms, rollouts), in one MLflow run; the 2-step checkpoint resumes at PP2."""
    from fastgrpo.cli import main

    assert main(["train", *overrides(tmp_path / "one", tiny_policy, tiny_draft, **{"trainer.backend": "torch",
                                                                                   "grpo.steps": 1})]) == 0
    straight = tmp_path / "straight"
    run(2, overrides(straight, tiny_policy, tiny_draft, **{"parallel.tensor": 2, "grpo.steps": 3}), tmp_path / "straight.log")
    for key in ("reward_mean", "response_len_mean", "response_len_max", "truncated_fraction", "accept_len"):
        assert history(straight / "run", key)[1] == history(tmp_path / "one" / "run", key)[1], key
    for key in ("grad_norm", "entropy"):  # one process's torch trainer, the same batch
        assert history(straight / "run", key)[1] == pytest.approx(history(tmp_path / "one" / "run", key)[1], rel=1e-4), key

    resumed = tmp_path / "resumed"
    run(2, overrides(resumed, tiny_policy, tiny_draft, **{"parallel.tensor": 2, "grpo.steps": 2}), tmp_path / "a.log")
    shutil.copytree(resumed / "run" / "checkpoints" / "step_00000002", tmp_path / "pp2" / "run" / "checkpoints" / "step_00000002")
    out = run(2, ["--resume", *overrides(resumed, tiny_policy, tiny_draft, **{"parallel.tensor": 2, "grpo.steps": 3})],
              tmp_path / "b.log")
    assert "resumed from" in out and "step 3/3" in out
    for key in STEP_KEYS:
        assert history(resumed / "run", key) == history(straight / "run", key), key
    assert (resumed / "run" / "checkpoints" / "step_00000003" / "megatron" / "fastgrpo.json").is_file()
    assert (resumed / "run" / "summary.json").is_file()

    out = run(2, ["--resume", *overrides(tmp_path / "pp2", tiny_policy, tiny_draft, **{
        "parallel.pipeline": 2, "grpo.steps": 3, "tracking.enabled": "false"})], tmp_path / "pp2.log")
    assert "resumed from" in out and "step 3/3" in out and "checkpoint:" in out


def test_sigterm_checkpoints_at_the_step_boundary_exits_zero_and_resumes(tmp_path, tiny_policy, tiny_draft):
    """SIGTERM to every process of the ranks, helpers included (Slurm signals every process of a job;
    checkpoints were written before, so dist_checkpointing's writer server is running): the ranks agree
    to stop after the same step, checkpoint it and exit 0; `--resume` continues from there."""
    args = overrides(tmp_path, tiny_policy, tiny_draft, **{"grpo.steps": 200, "checkpoint.every": 1})
    launch = Torchrun(2, args, tmp_path / "term.log")  # DP2: two replicas
    launch.wait_for("step 2/200")
    workers = launch.workers()
    processes = [p for w in workers for p in [w, *w.children(recursive=True)]]
    assert len(processes) > len(workers)  # the checkpoint writer's server
    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:  # a short-lived helper that ended after it was listed (failed CI once)
            pass
    assert launch.wait(timeout=120) == 0, launch.output()[-4000:]
    out = launch.output()
    assert "SIGTERM: stopped after step" in out
    stopped_at = int(out.split("SIGTERM: stopped after step ")[1].split()[0])
    assert stopped_at >= 2
    assert (tmp_path / "run" / "checkpoints" / f"step_{stopped_at:08d}" / "state.json").is_file()
    assert len(history(tmp_path / "run", "loss")) == stopped_at
    resumed = run(2, ["--resume", *overrides(tmp_path, tiny_policy, tiny_draft, **{"grpo.steps": stopped_at + 1})],
                  tmp_path / "resume.log")
    assert f"at step {stopped_at}" in resumed and f"step {stopped_at + 1}/{stopped_at + 1}" in resumed
    assert sorted(history(tmp_path / "run", "loss")) == list(range(1, stopped_at + 2))


SLICE = {"parallel.draft_ranks": 1, "draft.online": "async", "speculation.policy": "aware"}


def test_the_draft_trains_on_its_reserved_slice_and_reaches_every_engine(tmp_path, tiny_policy, tiny_draft):
    """DP2 + 2 draft ranks (a world of 4): each engine sends its rollouts' states to a draft rank of its
    own, the two train one draft data-parallel and publish its versions, which both engines swap in;
    the policy and the draft (each draft rank's buffer too) are checkpointed together and resume
    together. (One draft rank: the killed-rank test below, and the spawned draft rank of test_draft_learning.)"""
    two = SLICE | {"parallel.draft_ranks": 2, "draft.async_publish_s": 0.5}  # short rounds: versions within 4 steps
    args = overrides(tmp_path, tiny_policy, tiny_draft, **two, **{"grpo.steps": 4, "checkpoint.every": 2})
    out = run(4, args, tmp_path / "slice.log")
    assert "step 4/4" in out and "summary:" in out
    assert history(tmp_path / "run", "weights_version") == {1: 0.0, 2: 1.0, 3: 2.0, 4: 3.0}  # both engines
    versions = history(tmp_path / "run", "draft_version")
    assert versions[4] >= 1 and list(versions.values()) == sorted(versions.values())
    assert history(tmp_path / "run", "engine_draft_version_min")[4] >= 1  # the other engine swapped drafts too
    saved = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert (saved / "draft" / "draft.safetensors").is_file() and (saved / "megatron" / "fastgrpo.json").is_file()
    assert {p.name for p in (saved / "draft").glob("draft_sampler*.pt")} == {"draft_sampler.pt", "draft_sampler.shard1.pt"}
    resumed = run(4, ["--resume", *overrides(tmp_path, tiny_policy, tiny_draft, **two, **{"grpo.steps": 5})],
                  tmp_path / "resume.log")
    assert "at step 4" in resumed and "step 5/5" in resumed
    assert history(tmp_path / "run", "draft_version")[5] >= 1  # the restored draft was published again


def test_a_world_of_five_tp2_pp2_and_a_draft_rank(tmp_path, tiny_policy, tiny_draft):
    """TP2 x PP2 + 1 draft rank (a world of 5, the largest the tests use): 6 GRPO steps with `aware`
    speculation and the draft learning on its rank from all four engines (one per policy rank); every
    engine serves every pushed version, and they swap in the draft rank's versions; a checkpoint of both."""
    args = overrides(tmp_path, tiny_policy, tiny_draft, **SLICE, **{
        "parallel.tensor": 2, "parallel.pipeline": 2, "grpo.steps": 6, "checkpoint.every": 6,
        "draft.async_publish_s": 0.5})  # five processes on two cores: a step takes ~0.7 s, and the first
    # version reached the engine at step 3 or 4 when measured (the draft rank shares the cores)
    out = run(5, args, tmp_path / "five.log")
    assert "step 6/6" in out and "summary:" in out
    assert history(tmp_path / "run", "weights_version") == {s: float(s - 1) for s in range(1, 7)}
    assert set(history(tmp_path / "run", "rollout_engines").values()) == {4.0}
    versions = history(tmp_path / "run", "draft_version")
    assert versions[6] >= 1 and list(versions.values()) == sorted(versions.values()), versions
    saved = tmp_path / "run" / "checkpoints" / "step_00000006"
    assert (saved / "draft" / "draft.safetensors").is_file() and (saved / "megatron" / "fastgrpo.json").is_file()


def _kill_and_wait(launch: Torchrun, victim: int) -> None:
    """SIGKILL rank `victim` (no chance to say goodbye): torchrun ends the others and exits non-zero
    well within 60 s, and none of the run's processes is left behind."""
    processes = [psutil.Process(launch.proc.pid), *psutil.Process(launch.proc.pid).children(recursive=True)]
    t0 = time.monotonic()
    launch.workers()[victim].kill()
    code = launch.proc.wait(timeout=120)
    elapsed = time.monotonic() - t0
    kill_tree(launch.proc.pid)
    print(f"killed rank {victim}: torchrun exited {code} after {elapsed:.1f} s")
    assert code != 0 and elapsed < 60, (code, elapsed)
    # a rank's helpers (its checkpoint writer's server, multiprocessing's resource tracker) end when it
    # does, each a moment later on a loaded machine: a hang guard, not a timing
    _, alive = psutil.wait_procs(processes, timeout=30)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append((p.pid, " ".join(p.cmdline())[:160]))
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {left}"


def test_a_killed_rank_of_a_tp2_pp2_world_ends_it_and_resume_continues(tmp_path, tiny_policy, tiny_draft):
    """A stage-1 policy rank (an engine's too) of TP2 x PP2 + the draft slice killed mid-run: the world
    ends within the bound, and `--resume` continues from the last complete checkpoint to the end."""
    layout = SLICE | {"parallel.tensor": 2, "parallel.pipeline": 2}
    launch = Torchrun(5, overrides(tmp_path, tiny_policy, tiny_draft, **layout, **{
        "grpo.steps": 200, "checkpoint.every": 1}), tmp_path / "kill.log")
    launch.wait_for("step 2/200")
    _kill_and_wait(launch, victim=3)
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved and saved[-1] >= 1
    out = run(5, ["--resume", *overrides(tmp_path, tiny_policy, tiny_draft, **layout, **{
        "grpo.steps": saved[-1] + 1})], tmp_path / "resume.log")
    assert f"at step {saved[-1]}" in out and f"step {saved[-1] + 1}/{saved[-1] + 1}" in out, out[-3000:]


def test_a_killed_draft_rank_ends_every_rank_within_a_bound(tmp_path, tiny_policy, tiny_draft):
    """The draft rank of a DP2 + 1 draft rank world killed mid-run ends the world within the bound."""
    launch = Torchrun(3, overrides(tmp_path, tiny_policy, tiny_draft, **SLICE, **{
        "grpo.steps": 200, "checkpoint.every": 1000}), tmp_path / "kill.log")
    launch.wait_for("step 1/200")
    _kill_and_wait(launch, victim=2)


@pytest.mark.parametrize("expert_tensor", [2, 1], ids=["experts-split-over-tp", "experts-whole"])
def test_fastgrpo_train_runs_a_moe_at_tp2_x_ep2_under_torchrun(tmp_path, expert_tensor):
    """`fastgrpo train` on a tiny Qwen3-MoE (every layer sparse) in a torchrun world of 4: Megatron at TP2 x
    data 2 with the experts split over 2 expert-parallel ranks, an embedded engine on every rank fed by the
    push (experts gathered from their ranks), routing replay on (each engine records its tokens' experts,
    each TP rank replays its shard of the sequence); 3 steps whose trainer log-probabilities are the
    engines' (the same weights, both sides' MoE forward, fp32: a misplaced record would move them), with
    the expert load and routing_mismatch (both fp32: next to none) logged every step and a checkpoint; with
    each expert's weights split over the TP ranks (expert TP 2) and whole on one rank (expert TP 1)."""
    from fastgrpo.bench.family_checkpoints import MOE_EXPERTS, MOE_FAMILY, MOE_TOP_K, write_family_checkpoint
    from tests.test_real_checkpoints import family_run

    path = write_family_checkpoint(MOE_FAMILY, tmp_path / "moe", mlp_only_layers=[])
    args = family_run(tmp_path, path, "trainer.backend=megatron", "parallel.tensor=2", "parallel.expert=2",
                      "speculation.policy=off", "draft.online=off", "rollout.prompts_per_step=4", "grpo.steps=3",
                      "checkpoint.every=3", "tracking.enabled=true", "trainer.routing_replay=rollout",
                      f"parallel.expert_tensor={expert_tensor}")
    out = run(4, args, tmp_path / "moe.log")
    assert "step 3/3" in out
    kl = history(tmp_path / "run", "kl_engine_trainer")
    assert sorted(kl) == [1, 2, 3] and all(abs(value) < 1e-5 for value in kl.values()), kl
    load = history(tmp_path / "run", "expert_load_max_over_mean")
    assert sorted(load) == [1, 2, 3] and all(1.0 <= value <= MOE_EXPERTS / MOE_TOP_K for value in load.values()), load
    mismatch = history(tmp_path / "run", "routing_mismatch")
    assert sorted(mismatch) == [1, 2, 3] and all(0.0 <= value < 0.01 for value in mismatch.values()), mismatch
    assert (tmp_path / "run" / "checkpoints" / "step_00000003" / "policy" / "config.json").is_file()


def _indexed_histories(rank, world, args):
    """One rollout of a step's prompts over the world's engines (drafts: hybrid): every prompt's
    history in this engine's index, against every engine's answers."""
    from fastgrpo.config import load_config
    from fastgrpo.run_setup import setup_run
    from fastgrpo.train import rollout

    run = setup_run(load_config(None, args), resume=False)
    problems = run.data.next_batch(run.cfg.rollout.prompts_per_step)
    answers = rollout(run, problems, seed=0)
    G = run.cfg.rollout.group_size
    start, mine = run.world.share(problems)
    return {"mine": [p.prompt_ids for p in mine],
            "answers": {tuple(p.prompt_ids): [c.token_ids for c in answers.completions[i * G:(i + 1) * G]]
                        for i, p in enumerate(problems)},
            # as indexed: each response after its prompt's tail (stripped here)
            "history": {key: [h[len(run.engine.index.prompts[key].tail):] for h in run.engine.index.history(key)]
                        for key in (tuple(p.prompt_ids) for p in problems)}}


def test_each_engine_keeps_every_engines_answers_as_its_prompts_history(tmp_path, tiny_policy, tiny_draft):
    """Two engines (Megatron DP2), hybrid drafts: after a rollout each engine's index holds, for every
    prompt of the step, its group's answers: its own share as written, the other engine's remembered
    (a prompt's next visit may land on either engine)."""
    args = overrides(tmp_path, tiny_policy, tiny_draft, **{"speculation.drafts": "hybrid", "rollout.prompts_per_step": 4,
                                                           "tracking.enabled": "false"})
    results = run_world(_indexed_histories, 2, tmp_path / "world", args, timeout_s=300.0)
    assert results[0]["mine"] != results[1]["mine"] and results[0]["answers"] == results[1]["answers"]
    for r in results:
        assert set(r["history"]) == set(r["answers"]) and len(r["answers"]) == 4
        for key, responses in r["answers"].items():
            assert sorted(r["history"][key]) == sorted(responses), key
