"""The GRPO training loop: sample prompts, roll out, score, compute advantages, train the policy,
sync weights, log, checkpoint.

The same loop runs in one process and on every rank of a torchrun world (`trainer.backend=megatron`
or `deepspeed`): every rank draws the same prompts; the rollout engines tile the policy ranks
(`engine.tensor` ranks each, whatever the trainer's layout: every policy GPU samples), and each
engine's leading rank rolls out and scores its share of the prompts; every rank receives all answers
(token ids, log-probabilities, rewards: small next to the weights) and builds the same batch, of
which the trainer's data-parallel ranks each train their part; the weight push reaches every engine. Rank 0 alone prints, tracks, evaluates
and writes the run's files. SIGTERM checkpoints at the next step boundary and ends the run."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from fastgrpo.engines import build_engine

from fastgrpo.trainers import build_trainer
from fastgrpo.engines.embedded.build import draft_dir
from fastgrpo.protocols import DraftLearner, Engine, PolicyTrainer
from fastgrpo.bridge import WeightBridge
from fastgrpo.checkpoint import CheckpointManager
from fastgrpo.config import Config, ConfigError, flatten, to_yaml
from fastgrpo.device import resolve
from fastgrpo.distributed import StopRequest, World, init_world, is_draft_rank, launched_rank, launched_world_size
from fastgrpo.draft_learning.async_learner import AsyncDraftClient, serve_draft_slice
from fastgrpo.draft_learning.online import OnlineDraftLearner
from fastgrpo.grpo.advantages import group_advantages, informative_groups
from fastgrpo.grpo.batch import build_batch
from fastgrpo.grpo.evaluate import evaluate
from fastgrpo.grpo.report import print_step, rollout_stats, step_metrics, write_summary
from fastgrpo.models.tokenizer import decode_response, load_tokenizer
from fastgrpo.engines.embedded.draft import DraftHead
from fastgrpo.tasks.rewards import score, step_credit
from fastgrpo.tasks.source import EncodedProblem, PromptSource, encode_problems, load_task
from fastgrpo.tracking import Tracker, default_tracking_uri
from fastgrpo.types import Completion, Request, RolloutBatch, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: list[dict[str, float]]  # the metrics of every step this call ran
    evals: dict[int, dict[str, float]]  # eval results by step
    checkpoint: Path | None = None  # the last checkpoint this call saved
    stopped: bool = False  # ended early by SIGTERM, after checkpointing


@dataclass
class Rollout:
    """One step's answers: every engine's, in prompt order (completions[i * G + j] answers prompt i)."""

    completions: list[Completion]
    rewards: torch.Tensor  # [prompts, G]
    engine_stats: list[dict]  # one per engine, in engine order
    local: list[Completion] = field(default_factory=list)  # this engine's own, with captured states (its leader)


@dataclass
class Run:
    cfg: Config
    tokenizer: PreTrainedTokenizerBase
    trainer: PolicyTrainer
    engine: Engine | None  # on the ranks that lead an engine
    bridge: WeightBridge
    data: PromptSource
    eval_problems: list[EncodedProblem]
    tracker: Tracker
    checkpoints: CheckpointManager
    draft_learner: DraftLearner | None = None
    world: World = field(default_factory=World)
    step: int = 0
    history: TrainResult = field(default_factory=lambda: TrainResult([], {}))  # every step so far, resumes too


def train(cfg: Config, resume: bool = False) -> TrainResult:
    check_layout(cfg)
    resolve(cfg)  # a device or precision this machine lacks fails here, before any work
    if is_draft_rank(cfg.parallel.draft_ranks):  # a rank of the reserved draft slice: it serves the engines
        serve_draft_slice(cfg, init_world(cfg.parallel.draft_ranks))
        # its receiving threads stay blocked in the store's C++ receive; an interpreter exit that
        # destroys them can abort the rank ("terminate called without an active exception", seen
        # under load): its work is done and saved, so it leaves at once
        _leave()
    stop = StopRequest()
    try:
        result = _train(setup_run(cfg, resume), stop)
    finally:
        stop.restore()
    if cfg.trainer.backend == "deepspeed" and launched_rank() > 0:
        # the same abort at the interpreter's exit hit a ZeRO-3 DP2 policy rank (twice in a row in the
        # suite under load) after its last checkpoint: rank 0 writes what is left, the others leave.
        # DeepSpeed runs only: under Slurm with the other trainers, a rank leaving early held up the
        # job's end by ~45 s (a 2-step job: 85 s -> 181 s), and they never showed the abort
        _leave()
    return result


def _leave() -> None:
    """Exit this rank now, without the interpreter's teardown (its work is done and saved)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train(run: Run, stop: StopRequest) -> TrainResult:
    cfg = run.cfg
    first_step, steps_before = run.step, len(run.history.steps)
    checkpoint, stopped = None, False
    if run.step == 0 and cfg.eval.at_start:
        log_eval(run, step=0)
    for step in range(run.step, cfg.grpo.steps):
        t_step = time.perf_counter()
        problems = run.data.next_batch(cfg.rollout.prompts_per_step)

        t0 = time.perf_counter()
        answers = rollout(run, problems, seed=cfg.seed * 1_000_003 + step)
        completions, rewards = answers.completions, answers.rewards
        rollout_s = time.perf_counter() - t0

        batch, kept_groups = training_batch(run, problems, completions, rewards)

        t0 = time.perf_counter()
        if run.engine is not None:  # colocated: the engine's GPU memory goes to training meanwhile
            run.engine.release_memory()
        train_metrics = run.trainer.train_step(batch) if batch is not None else {"updates": 0.0}
        if run.engine is not None:
            run.engine.resume_memory()
        train_s = time.perf_counter() - t0

        sync = run.bridge.push(run.trainer.export_weights(), version=step + 1)
        draft_metrics = learn_draft(run, run.world.share(problems)[1], answers.local, policy_version=step,
                                    budget_s=cfg.draft.sync_budget * (rollout_s + train_s))

        run.step = step + 1
        metrics = step_metrics(completions, rewards, answers.engine_stats, kept_groups) | train_metrics | draft_metrics
        metrics |= {"rollout_s": rollout_s, "train_s": train_s, "weight_sync_s": sync.seconds,
                    "weight_sync_bytes": float(sync.bytes), "step_s": time.perf_counter() - t_step}
        run.history.steps.append(metrics)
        if run.world.main:
            run.tracker.log_metrics(metrics, step=run.step)
            if cfg.speculation.policy != "off":
                stats = [rollout_stats(s) for s in answers.engine_stats]
                run.tracker.log_dict(stats[0] if len(stats) == 1 else {"engines": stats},
                                     f"rollout_stats/step_{run.step:06d}.json")
            print_step(run.step, cfg.grpo.steps, metrics)

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


def check_layout(cfg: Config) -> None:
    """The launched world against the configured layout, on every rank before any group is made."""
    if launched_world_size() > 1 and cfg.trainer.backend == "torch":
        raise ConfigError(f"trainer.backend=torch trains in one process, but this is a world of "
                          f"{launched_world_size()} ranks: use trainer.backend=megatron or deepspeed under torchrun")
    model_parallel = cfg.parallel.tensor * cfg.parallel.pipeline
    policy_ranks = launched_world_size() - cfg.parallel.draft_ranks
    world = (f"a world of {launched_world_size()} ranks, {cfg.parallel.draft_ranks} reserved by "
             f"parallel.draft_ranks")
    if policy_ranks < 1 or policy_ranks % model_parallel:
        raise ConfigError(f"parallel.tensor x parallel.pipeline = {model_parallel} ranks per replica does not divide "
                          f"the {policy_ranks} policy ranks ({world})")
    if policy_ranks % cfg.engine.tensor:
        raise ConfigError(f"engine.tensor={cfg.engine.tensor} does not divide the {policy_ranks} policy ranks ({world})")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", launched_world_size()))
    if per_node % cfg.engine.tensor:
        raise ConfigError(f"engine.tensor={cfg.engine.tensor} does not divide the {per_node} ranks per node: an "
                          f"engine would span two nodes")


def require_policy(cfg: Config) -> None:
    """A run starts from the policy at model.path, which `fastgrpo sft` builds: without it, say so (not
    the Hugging Face hub's error for a model name it cannot download)."""
    if not (Path(cfg.model.path) / "config.json").is_file():
        raise FileNotFoundError(
            f"no policy at model.path={cfg.model.path} (no config.json there). Build it first: `make policy`, "
            f"or `fastgrpo sft --config CONFIG` then `fastgrpo draft-pretrain --config CONFIG` with this run's "
            f"config and overrides (`make train` does both, then trains)")


def setup_run(cfg: Config, resume: bool) -> Run:
    check_layout(cfg)
    require_policy(cfg)
    channel = init_world(cfg.parallel.draft_ranks)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    run_dir = Path(cfg.run_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last)
    latest = checkpoints.latest() if resume else None
    if resume and latest is None:
        log.warning("--resume: no checkpoint in %s, starting from step 0", checkpoints.root)

    # input errors (a missing dataset, no usable rows) surface before any model is built
    tokenizer = load_tokenizer(cfg.model.path)
    train_problems, eval_problems = load_task(cfg.task, cfg.eval.split)
    data = PromptSource(encode_problems(train_problems, tokenizer, cfg.model.max_context, "train"), cfg.seed)
    evals = encode_problems(eval_problems, tokenizer, cfg.model.max_context, "eval")

    trainer = build_trainer(cfg)  # the policy of model.path; a resume loads its checkpoint over it
    world = World.of(trainer.placement(), cfg.engine.tensor)
    if cfg.rollout.prompts_per_step < world.placement.replicas:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} leaves a data-parallel replica "
                          f"of the trainer without prompts ({world.placement.replicas} replicas)")
    if cfg.draft.online == "sync" and world.engines.engines > 1:
        raise ConfigError(f"draft.online=sync learns beside one engine, but this run has {world.engines.engines} "
                          f"engines: use draft.online=async with parallel.draft_ranks=1, or off")
    model_config = AutoConfig.from_pretrained(cfg.model.path)
    engine = None
    if world.leads_engine:  # its weights come with the bridge's first push
        engine = build_engine(cfg, model_config, tokenizer)
    engine_ranks = world.engines.leaders() if channel is not None else None
    draft_learner: DraftLearner | None = None
    if cfg.draft.online != "off" and engine is not None:
        draft = DraftHead.load(draft_dir(cfg), model_config, cfg.model.max_context)
        device = resolve(cfg).device  # beside the engine whose states it learns from
        if cfg.draft.online == "sync":
            draft_learner = OnlineDraftLearner(draft, cfg.draft, [engine], seed=cfg.seed, device=device)
        else:  # a draft rank of its own; the engine picks up its versions between decode steps
            draft_ranks = list(range(world.size, world.size + cfg.parallel.draft_ranks)) if channel else None
            draft_learner = AsyncDraftClient(draft, cfg.draft, [engine], cfg.seed, channel=channel,
                                             draft_ranks=draft_ranks, engine_ranks=engine_ranks, device=str(device))
            engine.draft_source = draft_learner.poll
    # the draft's embedding and LM head are the policy's: it gets them with every push, as engines do
    # (every policy rank takes part in a push: it gathers the shards; a rank that leads no engine drops
    # them as they pass, so no rank holds more than a bucket beyond its own shards)
    bridge = WeightBridge([c for c in (engine, draft_learner) if c is not None])

    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(cfg.tracking.uri or default_tracking_uri(run_dir), cfg.tracking.experiment,
                      run_dir / "mlartifacts", enabled=cfg.tracking.enabled and world.main)
    run = Run(cfg, tokenizer, trainer, engine, bridge, data, evals, tracker, checkpoints, draft_learner, world)
    run_id = None
    if latest is not None:
        run_id = restore_checkpoint(run, latest)
        if world.main:
            print(f"resumed from {latest} at step {run.step}")
    tracker.start(cfg.tracking.run_name or run_dir.name, flatten(cfg), to_yaml(cfg), run_id=run_id)
    bridge.push(trainer.export_weights(), version=run.step)
    return run


def rollout(run: Run, problems: list[EncodedProblem], seed: int) -> Rollout:
    """G samples of every prompt, scored. Each engine answers its share of the prompts, and sample j
    of prompt i is keyed i * G + j with the step's seed on whichever engine runs it: keyed sampling
    makes the answers those of one engine answering all. Every rank gets every engine's answers."""
    r, world = run.cfg.rollout, run.world
    start, mine = world.share(problems)
    local = None
    if run.engine is not None:
        G = r.group_size
        requests = [Request(p.prompt_ids, key=(start + i) * G + j) for i, p in enumerate(mine) for j in range(G)]
        # with a draft learner, keep the target states rollout computes anyway
        completions = run.engine.generate(requests, SamplingParams.of(r), seed=seed,
                                          capture=run.draft_learner is not None)
        local = (completions, score_completions(run, mine, completions), run.engine.stats())
    if world.size == 1:
        parts = [local]
    else:  # hidden states stay where they were captured (the draft learner's rank)
        parts = world.gather(None if local is None else (
            [dataclasses.replace(c, hidden=None) for c in local[0]], *local[1:]))
        if local is not None:
            parts[world.engine] = local
    versions = {part[2]["weights_version"] for part in parts}
    if len(versions) != 1:  # the push reaches every engine or the run stops
        raise RuntimeError(f"the engines hold different weight versions: {sorted(versions, key=str)}")
    return Rollout([c for part in parts for c in part[0]], torch.cat([part[1] for part in parts]),
                   [part[2] for part in parts], local[0] if local is not None else [])


def learn_draft(run: Run, problems: list[EncodedProblem], completions: list[Completion], policy_version: int,
                budget_s: float) -> dict[str, float]:
    """Online draft learning on this rollout's states (sync: here, within the budget; async: on the
    draft rank); the engine gets the new version before or during the next rollout."""
    if run.draft_learner is None:
        return {}
    G = run.cfg.rollout.group_size
    prompts = [problems[i // G].prompt_ids for i in range(len(completions))]
    return run.draft_learner.learn(prompts, completions, policy_version, budget_s)


def score_completions(run: Run, problems: list[EncodedProblem], completions: list[Completion]) -> torch.Tensor:
    """1 for a correct answer; a wrong one gets `task.step_credit` x the share of the worked
    solution's steps it got right before its first mistake (0 when step_credit is 0)."""
    G, task = run.cfg.rollout.group_size, run.cfg.task
    rewards = []
    for i, c in enumerate(completions):
        text, problem = decode_response(run.tokenizer, c.token_ids), problems[i // G].problem
        r = score(text, problem.answer, task.reward_timeout_s)
        if r < 1.0 and task.step_credit > 0 and problem.solution:
            r = task.step_credit * step_credit(text, problem.solution)
        rewards.append(r)
    return torch.tensor(rewards, dtype=torch.float32).view(len(problems), G)


def training_batch(run: Run, problems: list[EncodedProblem], completions: list[Completion],
                   rewards: torch.Tensor) -> tuple[RolloutBatch | None, int]:
    """Advantages per group; groups with all-equal rewards are dropped (they would add zero gradient)."""
    g = run.cfg.grpo
    G = run.cfg.rollout.group_size
    advantages = group_advantages(rewards, g.scale_by_std)
    keep = informative_groups(rewards) if g.drop_equal_reward_groups else torch.ones(len(problems), dtype=torch.bool)
    rows = [i * G + j for i in range(len(problems)) if keep[i] for j in range(G)]
    if not rows:
        return None, 0
    batch = build_batch([problems[i // G].prompt_ids for i in rows], [completions[i].token_ids for i in rows],
                        [completions[i].logprobs for i in rows], advantages.flatten()[rows],
                        pad_id=run.tokenizer.pad_token_id, sample_sets=[completions[i].sample_sets for i in rows])
    return batch, int(keep.sum())


def log_eval(run: Run, step: int) -> dict[str, float] | None:
    """Rank 0's engine evaluates (the others go on to the next collective and wait there)."""
    if not run.world.main:
        return None
    c = run.cfg
    t0 = time.perf_counter()
    result = evaluate(run.engine, run.tokenizer, run.eval_problems, c.eval.samples, SamplingParams.of(c.rollout),
                      c.task.reward_timeout_s, seed=c.seed)
    result = {f"eval/{k}": v for k, v in result.items()}
    run.tracker.log_metrics(result, step=step)
    run.history.evals[step] = result
    print(f"eval at step {step} ({c.eval.split}, {len(run.eval_problems)} problems): "
          + ", ".join(f"{k[5:]} {v:.3f}±{result[k + '_se']:.3f}" for k, v in result.items() if not k.endswith("_se"))
          + f" ({time.perf_counter() - t0:.0f}s)", flush=True)
    return result


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng_rank{rank}.pt"


def save_checkpoint(run: Run) -> Path:
    """On every rank (collective): the trainer's state (a Megatron trainer's ranks write their shards),
    the draft's, every rank's RNG state; rank 0 the tokenizer, the data position (one prompt stream,
    the same on every rank) and the run's history."""
    def write(d: Path) -> None:
        run.trainer.save(d)
        if run.draft_learner is not None:
            run.draft_learner.save(d / "draft")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, d / rng_file(run.world.rank))
        if not run.world.main:
            return
        run.tokenizer.save_pretrained(d / "policy")
        state = {"step": run.step, "data": run.data.state_dict(), "mlflow_run_id": run.tracker.run_id,
                 "weights_version": run.bridge.version, "world_size": run.world.size,
                 "history": {"steps": run.history.steps, "evals": run.history.evals}}
        (d / "state.json").write_text(json.dumps(state, indent=2))

    path = run.checkpoints.save(run.step, write)
    if run.world.main:
        print(f"checkpoint: {path}", flush=True)
    return path


def restore_checkpoint(run: Run, path: Path) -> str | None:
    state = json.loads((path / "state.json").read_text())
    run.trainer.load(path)
    if run.draft_learner is not None:
        if not (path / "draft").is_dir():
            raise FileNotFoundError(f"checkpoint {path} holds no draft state, but draft.online={run.cfg.draft.online}")
        run.draft_learner.load(path / "draft")
    rng_path = path / rng_file(run.world.rank)
    if rng_path.is_file():  # a rank of a larger world than the checkpoint's has none: its seeds are explicit
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    run.data.load_state_dict(state["data"])
    run.step = int(state["step"])
    history = state.get("history", {"steps": [], "evals": {}})
    run.history = TrainResult(history["steps"], {int(k): v for k, v in history["evals"].items()})
    return state.get("mlflow_run_id")
