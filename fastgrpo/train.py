"""The GRPO training loop: each step samples prompts, rolls them out on the engines, scores the
answers with the task's reward (more prompts while too few groups carry a signal, when
`rollout.refill_rounds` allows), trains the policy on the informative groups, pushes the new weights
to every engine (and to the draft learner, which then learns from the rollout's states), logs,
evaluates now and then and checkpoints. This module is that orchestration only: a run is set up in
`fastgrpo.run_setup` (layout checks, reward, trainer, engine, draft learner, bridge, tracker, resume),
its state is `fastgrpo.run_state.Run`, its checkpoints are written and read in
`fastgrpo.run_checkpoint`; the reward is `fastgrpo.tasks.rewards.Reward` (`task.reward`), the batch
and its group advantages are made in `fastgrpo.grpo.batch`, the step's record is
`fastgrpo.grpo.record.StepRecord`, and what the run reports (the step line, the summary and its
learning curve) is made in `fastgrpo.grpo.report`. Which process does what in a torchrun world (a
draft rank serves the draft slice instead) is decided by the `fastgrpo train` command (`fastgrpo.cli`).

The same loop runs in one process and on every policy rank of a torchrun world (`trainer.backend=
megatron` or `deepspeed`): every rank draws the same prompts; the rollout engines tile the policy ranks
(`engine.tensor` ranks each, whatever the trainer's layout: every policy GPU samples), and each
engine's leading rank rolls out and scores its share of the prompts; every rank receives all answers
(token ids, log-probabilities, rewards: small next to the weights) and builds the same batch, of
which the trainer's data-parallel ranks each train their part; the weight push reaches every engine.
Rank 0 alone prints, tracks, evaluates and writes the run's files. SIGTERM checkpoints at the next
step boundary and ends the run."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from fastgrpo.config import Config
from fastgrpo.device import thread_count
from fastgrpo.distributed import StopRequest
from fastgrpo.grpo.advantages import informative_groups
from fastgrpo.grpo.batch import training_batch
from fastgrpo.grpo.evaluate import evaluate
from fastgrpo.grpo.record import StepRecord, merged_stats, rollout_record
from fastgrpo.grpo.report import print_step, rollout_stats, write_summary
from fastgrpo.run_checkpoint import save_checkpoint
from fastgrpo.run_setup import preflight, setup_run
from fastgrpo.run_state import Run, TrainResult
from fastgrpo.tasks.rewards import check_not_all_failed, score_answers
from fastgrpo.tasks.source import EncodedProblem
from fastgrpo.types import Completion, EngineStats, Request, RolloutBatch, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One step's answers: every engine's, in prompt order (completions[i * G + j] answers prompt i)."""

    completions: list[Completion]
    rewards: torch.Tensor  # [prompts, G]
    engine_stats: list[EngineStats]  # one per engine, in engine order
    local: list[Completion] = field(default_factory=list)  # this engine's own, with captured states (its leader)
    mine: list[EncodedProblem] = field(default_factory=list)  # the prompts `local` answers, in its order
    reward_errors: int = 0  # answers whose verifier failed (scored 0), over every engine
    first_reward_error: str = ""

    def joined(self, more: Rollout) -> Rollout:
        """These answers, then `more`'s (a refill round's): its prompts follow these in the step."""
        return Rollout(self.completions + more.completions, torch.cat([self.rewards, more.rewards]),
                       [merged_stats(a, b) for a, b in zip(self.engine_stats, more.engine_stats, strict=True)],
                       self.local + more.local, self.mine + more.mine, self.reward_errors + more.reward_errors,
                       self.first_reward_error or more.first_reward_error)


def train(cfg: Config, resume: bool = False) -> TrainResult:
    """A GRPO run of `cfg` on this process, a policy rank (the `fastgrpo train` command sends a draft
    rank of a torchrun world to the draft slice instead); `resume`: from the latest checkpoint."""
    preflight(cfg)  # the layout and this machine's device and precision, before any work
    stop = StopRequest()
    try:
        with thread_count(cfg.threads):  # the process's count, back to what it was when the run ends
            return _train(setup_run(cfg, resume), stop)
    finally:
        stop.restore()


def _train(run: Run, stop: StopRequest) -> TrainResult:
    """Steps from `run.step` to `grpo.steps`, evaluating every `eval.every` steps and at the end,
    checkpointing every `checkpoint.every` steps, at the end and when SIGTERM stops the run."""
    cfg = run.cfg
    first_step, steps_before = run.step, len(run.history.steps)
    checkpoint, stopped = None, False
    if run.step == 0 and cfg.eval.at_start:
        log_eval(run, step=0)
    for step in range(run.step, cfg.grpo.steps):
        run_step(run, step)
        if cfg.eval.every and run.step % cfg.eval.every == 0 and run.step < cfg.grpo.steps:
            log_eval(run, run.step)
        stopped = run.world.any(stop.requested)  # every rank stops after the same step
        if run.step % cfg.checkpoint.every == 0 or run.step == cfg.grpo.steps or stopped:
            checkpoint = save_checkpoint(run)
        if stopped:
            if run.world.main:
                print(f"SIGTERM: stopped after step {run.step} of {cfg.grpo.steps}; `--resume` continues from "
                      f"{checkpoint}", flush=True)
            break
    if not stopped:
        log_eval(run, run.step)
        if run.world.main:
            write_summary(cfg, run.history.steps, run.history.evals, len(run.eval_problems))
    run.tracker.end("KILLED" if stopped else "FINISHED")
    if run.draft_learner is not None:
        run.draft_learner.close()
    return TrainResult(run.history.steps[steps_before:],
                       {s: e for s, e in run.history.evals.items() if s >= first_step}, checkpoint, stopped)


def run_step(run: Run, step: int) -> StepRecord:
    """One step of the run: roll out the step's prompts (refilled while too few groups carry a signal,
    when `rollout.refill_rounds` allows), train the policy on the informative groups (the GRPO update
    itself is the trainer's, `fastgrpo.grpo.step`), push the new weights, let the draft learn from the
    rollout; its record joins the run's history (rank 0 tracks and prints it)."""
    cfg = run.cfg
    t_step = time.perf_counter()

    t0 = time.perf_counter()
    problems, answers, refills = sample_step(run, step)
    rollout_s = time.perf_counter() - t0
    check_not_all_failed(run.reward, len(answers.completions), answers.reward_errors, answers.first_reward_error,
                         f"step {step + 1}")
    if answers.reward_errors and run.world.main:
        log.warning("step %d: the reward %s raised on %d of %d answers (scored 0); the first: %s", step + 1,
                    run.reward.name, answers.reward_errors, len(answers.completions), answers.first_reward_error)

    wanted = cfg.rollout.prompts_per_step
    batch, kept_groups = training_batch([p.prompt_ids for p in problems], answers.completions, answers.rewards,
                                        cfg.grpo, max_groups=wanted)
    t0 = time.perf_counter()
    policy_report = train_policy(run, batch)
    train_s = time.perf_counter() - t0

    sync = run.bridge.push(run.trainer.export_weights(), version=step + 1)
    draft_report = learn_draft(run, answers.mine, answers.local, policy_version=step,
                               budget_s=cfg.draft.sync_budget * (rollout_s + train_s))

    run.step = step + 1
    record = dataclasses.replace(
        rollout_record(run.step, answers.completions, answers.rewards, answers.engine_stats, kept_groups),
        reward_errors=answers.reward_errors, refill_rounds=refills,
        refill_short=max(wanted - kept_groups, 0) if cfg.rollout.refill_rounds else 0,
        rollout_s=rollout_s, train_s=train_s, weight_sync_s=sync.seconds, weight_sync_bytes=sync.bytes,
        step_s=time.perf_counter() - t_step, policy=policy_report, draft=draft_report)
    run.history.steps.append(record)
    if run.world.main:
        log_step(run, record, answers.engine_stats)
    return record


def sample_step(run: Run, step: int) -> tuple[list[EncodedProblem], Rollout, int]:
    """The step's prompts and their scored answers, and how many refill rounds it took: a batch of
    `rollout.prompts_per_step` prompts; then DAPO's dynamic sampling (Yu et al. arXiv 2503.14476; veRL's
    filter_groups): while fewer than prompts_per_step groups are informative (rewards not all equal),
    another batch, at most `rollout.refill_rounds` times. Every rank sees the same rewards, so every
    rank refills alike; a refill's sample j of its prompt i is keyed as if the step had drawn all its
    prompts at once."""
    cfg = run.cfg
    wanted, seed = cfg.rollout.prompts_per_step, cfg.seed * 1_000_003 + step
    problems = run.data.next_batch(wanted)
    answers = rollout(run, problems, seed)
    rounds = 0
    while rounds < cfg.rollout.refill_rounds and int(informative_groups(answers.rewards).sum()) < wanted:
        rounds += 1
        more = run.data.next_batch(wanted)
        answers = answers.joined(rollout(run, more, seed, first=len(problems)))
        problems = problems + more
    return problems, answers, rounds


def train_policy(run: Run, batch: RolloutBatch | None) -> dict[str, float]:
    """The trainer's step on `batch` (none when every group was dropped: the step goes on, untrained)."""
    if run.engine is not None:  # colocated: the engine's GPU memory goes to training meanwhile
        run.engine.release_memory()
    train_metrics = run.trainer.train_step(batch) if batch is not None else {"updates": 0.0}
    if run.engine is not None:
        run.engine.resume_memory()
    return train_metrics


def log_step(run: Run, record: StepRecord, engine_stats: list[EngineStats]) -> None:
    """Rank 0: the step's record tracked (its metrics) and printed, and (when speculating) each engine's
    speculation record tracked."""
    cfg = run.cfg
    run.tracker.log_metrics(record.metrics(), step=run.step)
    if cfg.speculation.policy != "off":
        stats = [rollout_stats(s) for s in engine_stats]
        run.tracker.log_dict(stats[0] if len(stats) == 1 else {"engines": stats},
                             f"rollout_stats/step_{run.step:06d}.json")
    print_step(cfg.grpo.steps, record)


def rollout(run: Run, problems: list[EncodedProblem], seed: int, first: int = 0) -> Rollout:
    """G samples of every prompt, scored. Each engine answers its share of the prompts, and sample j
    of prompt i is keyed (first + i) * G + j with the step's seed on whichever engine runs it (`first`:
    the step's prompts before these, a refill's): keyed sampling makes the answers those of one engine
    answering all. Every rank gets every engine's answers."""
    r, world = run.cfg.rollout, run.world
    start, mine = world.share(problems)
    local = None
    if run.engine is not None:
        G = r.group_size
        requests = [Request(p.prompt_ids, key=(first + start + i) * G + j) for i, p in enumerate(mine)
                    for j in range(G)]
        # with a draft learner, keep the target states rollout computes anyway
        completions = run.engine.generate(requests, SamplingParams.of(r), seed=seed,
                                          capture=run.draft_learner is not None,
                                          routing=run.cfg.trainer.routing_replay == "rollout")
        rewards, errors, first_error = score_completions(run, mine, completions)
        local = (completions, rewards, run.engine.stats(), errors, first_error)
    if world.size == 1:
        parts = [local]
    else:  # hidden states stay where they were captured (the draft learner's rank)
        parts = world.gather(None if local is None else (
            [dataclasses.replace(c, hidden=None) for c in local[0]], *local[1:]))
        if local is not None:
            parts[world.engine] = local
            remember_other_shares(run, problems, parts)
    versions = {part[2]["weights_version"] for part in parts}
    if len(versions) != 1:  # the push reaches every engine or the run stops
        raise RuntimeError(f"the engines hold different weight versions: {sorted(versions, key=str)}")
    return Rollout([c for part in parts for c in part[0]], torch.cat([part[1] for part in parts]),
                   [part[2] for part in parts], local[0] if local is not None else [], mine,
                   sum(part[3] for part in parts), next((part[4] for part in parts if part[4]), ""))


def remember_other_shares(run: Run, problems: list[EncodedProblem], parts: list) -> None:
    """This engine keeps the other engines' answers as their prompts' history (an engine drafting from
    a suffix index, `speculation.drafts: index | hybrid`): a prompt's next visit may land on any engine."""
    remember = getattr(run.engine, "remember", None)
    if remember is None:
        return
    G = run.cfg.rollout.group_size
    for e, part in enumerate(parts):
        if e != run.world.engine:
            lo, hi = run.world.engines.bounds(len(problems), e)
            remember([p.prompt_ids for p in problems[lo:hi] for _ in range(G)], part[0])


def learn_draft(run: Run, problems: list[EncodedProblem], completions: list[Completion], policy_version: int,
                budget_s: float) -> dict[str, float]:
    """Online draft learning on this rollout's states (sync: here, within the budget; async: on the
    draft rank); the engine gets the new version before or during the next rollout."""
    if run.draft_learner is None:
        return {}
    G = run.cfg.rollout.group_size
    prompts = [problems[i // G].prompt_ids for i in range(len(completions))]
    return run.draft_learner.learn(prompts, completions, policy_version, budget_s)


def score_completions(run: Run, problems: list[EncodedProblem],
                      completions: list[Completion]) -> tuple[torch.Tensor, int, str]:
    """The task's training reward of every answer (`Reward.for_training`), [prompts, G]; with the number
    of answers whose verifier failed (scored 0) and the first one's message."""
    G = run.cfg.rollout.group_size
    scored = score_answers(run.reward, [run.text.response_text(c.token_ids) for c in completions],
                           [problems[i // G].problem for i in range(len(completions))])
    return torch.tensor(scored.rewards, dtype=torch.float32).view(len(problems), G), scored.errors, scored.first_error


def log_eval(run: Run, step: int) -> dict[str, float] | None:
    """Rank 0's engine evaluates (the others go on to the next collective and wait there)."""
    if not run.world.main:
        return None
    c = run.cfg
    t0 = time.perf_counter()
    result = evaluate(run.engine, run.text, run.eval_problems, c.eval.samples, SamplingParams.of(c.rollout),
                      run.reward, seed=c.seed)
    result = {f"eval/{k}": v for k, v in result.items()}
    run.tracker.log_metrics(result, step=step)
    run.history.evals[step] = result
    print(f"eval at step {step} ({c.eval.split}, {len(run.eval_problems)} problems): "
          + ", ".join(f"{k[5:]} {v:.3f}±{result[k + '_se']:.3f}" for k, v in result.items() if not k.endswith("_se"))
          + f" ({time.perf_counter() - t0:.0f}s)", flush=True)
    return result
