"""A GRPO step's record (`StepRecord`): what the loop fills each step and the run's report, its
summary and the benchmarks read by attribute. MLflow gets it flat under the metric names of
`StepRecord.metrics` (the rollout's and the loop's fields by their own names, then the trainer's and
the draft learner's reports as they name them)."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

import torch

from fastgrpo.types import Completion, EngineStats, padding_shares

# the record's own fields that metrics() leaves out (the step is MLflow's step, not a metric)
_NOT_METRICS = ("step", "policy", "draft")
# the record's fields a trainer's report fills (StepRecord.__post_init__)
_FROM_TRAINER = ("expert_load_max_over_mean", "expert_idle_fraction")


@dataclass
class StepRecord:
    """One GRPO step of a run. Rollout throughput is the engines' total (they run side by side), with
    the slowest engine's alongside when there are several."""

    step: int  # the step just completed, from 1 (its weights are version `step`)
    # -- the rollout: the answers, their rewards, the engines' work
    reward_mean: float
    reward_std: float
    accuracy: float  # share of answers with reward >= 1
    response_len_mean: float  # tokens
    response_len_max: float
    truncated_fraction: float  # answers cut at rollout.max_new_tokens
    gen_tokens_per_s: float  # the engines' total
    mean_running: float  # sequences per decode step, mean over engines
    spec_step_fraction: float  # decode steps that speculated
    groups_kept: int  # groups trained on (the others had all-equal rewards, or were beyond a refill's need)
    rollout_engines: int
    weights_version: int  # the policy version the engines rolled out with (the same on every engine)
    accept_len: float | None = None  # tokens per sequence per verify, when some step speculated
    engine_tokens_per_s_min: float | None = None  # with several engines: the slowest engine's throughput
    engine_draft_version_min: int | None = None  # with several engines: the oldest draft among them
    reward_errors: int = 0  # answers whose reward's verifier failed (scored 0; all of them stops the run)
    # rollout.refill_rounds (DAPO's dynamic sampling): the extra rounds of prompts this step rolled out, and
    # how many informative groups it still lacked of rollout.prompts_per_step when the bound stopped it
    refill_rounds: int = 0
    refill_short: int = 0
    # -- the step's times (seconds) and the weight push
    rollout_s: float = 0.0
    train_s: float = 0.0  # the policy's update
    weight_sync_s: float = 0.0
    weight_sync_bytes: int = 0
    step_s: float = 0.0
    # -- a mixture-of-experts policy's routing over the step's training forwards (None for a dense policy):
    # the busiest expert's routed tokens over the mean, averaged over sparse layers (1: balanced; at most
    # E / k), and the share of (layer, expert) pairs that got no token
    expert_load_max_over_mean: float | None = None
    expert_idle_fraction: float | None = None
    # -- the components' own reports: the trainer's update (`PolicyTrainer.train_step`: loss, grad_norm,
    # clip_fraction, entropy, kl_ref, kl_engine_trainer, updates, ...; {"updates": 0} when no group was
    # kept) and the draft learner's (`DraftLearner.learn`, every name draft_*; empty without one)
    policy: dict[str, float] = field(default_factory=dict)
    draft: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """What the trainer reports under one of `_FROM_TRAINER`'s names (the expert load, which
        `PolicyTrainer.train_step` of a mixture of experts returns) fills that field and leaves the
        report: the field is where it is read, and MLflow gets it once."""
        lifted = {k: v for k, v in self.policy.items() if k in _FROM_TRAINER}
        if lifted:
            self.policy = {k: v for k, v in self.policy.items() if k not in lifted}  # the caller's dict untouched
            for name, value in lifted.items():
                setattr(self, name, float(value))

    def metrics(self) -> dict[str, float]:
        """The step as MLflow metrics: each field by its name (those without a value left out), the
        trainer's and the draft learner's reports by theirs."""
        own = {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in _NOT_METRICS and getattr(self, f.name) is not None}
        return own | self.policy | self.draft

    @classmethod
    def from_metrics(cls, step: int, metrics: dict[str, float]) -> StepRecord:
        """The record back from its metrics() (a checkpoint's history): the fields by name, draft_*
        names the draft learner's, the rest the trainer's."""
        types = {f.name: f.type for f in dataclasses.fields(cls) if f.name not in _NOT_METRICS}
        own = {k: (int(v) if types[k].startswith("int") else v) for k, v in metrics.items() if k in types}
        rest = {k: v for k, v in metrics.items() if k not in types}
        return cls(step, **own, policy={k: v for k, v in rest.items() if not k.startswith("draft_")},
                   draft={k: v for k, v in rest.items() if k.startswith("draft_")})


_COUNTS = ("sequences", "tokens", "seconds", "decode_steps", "prefill_s", "decode_s", "spec_steps", "spec_seq_steps",
           "spec_emitted", "policy_s", "ahead_s", "wait_s", "capture_s", "static_steps", "token_slots", "padded_slots",
           "positions_read", "positions_needed")


def merged_stats(first: EngineStats, then: EngineStats) -> EngineStats:
    """One engine's statistics over two generate calls of one step (a refilled step rolls out again):
    counts and times add up, the rates are those of the sums (throughput, mean running sequences per
    decode step, accepted length), the traces follow each other, and the versions are the later call's."""
    out: dict = dict(then)
    for key in _COUNTS:
        if key in first or key in then:
            out[key] = first.get(key, 0) + then.get(key, 0)
    if out.get("seconds"):
        out["tokens_per_s"] = out.get("tokens", 0) / out["seconds"]
    if "mean_running" in first or "mean_running" in then:
        steps = out.get("decode_steps", 0)
        out["mean_running"] = ((first.get("mean_running", 0.0) * first.get("decode_steps", 0)
                                + then.get("mean_running", 0.0) * then.get("decode_steps", 0)) / steps if steps else 0.0)
    if "accept_len" in first or "accept_len" in then:
        out["accept_len"] = out["spec_emitted"] / out["spec_seq_steps"] if out.get("spec_seq_steps") else 1.0
    if "token_slots" in out:
        out |= padding_shares(out["token_slots"], out["padded_slots"], out["positions_read"], out["positions_needed"])
    if "config_by_concurrency" in first or "config_by_concurrency" in then:
        joined: dict[str, dict[str, int]] = {}
        for part in (first.get("config_by_concurrency", {}), then.get("config_by_concurrency", {})):
            for bucket, shapes in part.items():
                for shape, n in shapes.items():
                    joined.setdefault(bucket, {})[shape] = joined.get(bucket, {}).get(shape, 0) + n
        out["config_by_concurrency"] = joined
    if "trace" in first or "trace" in then:
        out["trace"] = list(first.get("trace", [])) + list(then.get("trace", []))
    return out  # type: ignore[return-value]


def rollout_record(step: int, completions: list[Completion], rewards: torch.Tensor, engine_stats: list[EngineStats],
                   kept_groups: int) -> StepRecord:
    """The record of step `step` as its rollout leaves it (the loop adds the times and the reports)."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    spec_steps = sum(s.get("spec_steps", 0) for s in engine_stats)
    decode_steps = sum(s.get("decode_steps", 0) for s in engine_stats)
    throughput = [s.get("tokens_per_s", 0.0) for s in engine_stats if s.get("sequences", 1)]
    several = len(engine_stats) > 1
    return StepRecord(
        step=step,
        reward_mean=rewards.mean().item(),
        reward_std=rewards.std().item(),
        accuracy=(rewards >= 1.0).float().mean().item(),
        response_len_mean=lengths.mean().item(),
        response_len_max=lengths.max().item(),
        truncated_fraction=sum(c.finish_reason != "stop" for c in completions) / len(completions),
        gen_tokens_per_s=sum(throughput),
        mean_running=statistics.mean(s.get("mean_running", 0.0) for s in engine_stats),
        spec_step_fraction=spec_steps / max(decode_steps, 1),
        groups_kept=kept_groups,
        rollout_engines=len(engine_stats),
        weights_version=engine_stats[0].get("weights_version", -1),  # the same on every engine
        # accepted length is only defined when some step speculated; plain steps emit one token by
        # construction. Over engines: tokens emitted per sequence per verify, from the engines' totals (the
        # same totals, so the same figure, whichever engines ran which sequences)
        accept_len=(sum(s["spec_emitted"] for s in engine_stats) / sum(s["spec_seq_steps"] for s in engine_stats)
                    if spec_steps else None),
        # the slowest engine, and the engine furthest behind on drafts
        engine_tokens_per_s_min=min(throughput, default=0.0) if several else None,
        engine_draft_version_min=min(s.get("draft_version", -1) for s in engine_stats) if several else None)
