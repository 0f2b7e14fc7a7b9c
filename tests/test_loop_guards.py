"""The GRPO loop's guards: groups whose rewards are all equal carry no signal and leave the batch (the
default), a step with nothing to train still pushes weights and goes on, and a rollout whose engines
hold different weight versions stops the run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.batch import training_batch
from fastgrpo.train import rollout, train
from fastgrpo.tasks.problems import Problem
from fastgrpo.tasks.source import EncodedProblem
from fastgrpo.types import Completion
from tests.conftest import tiny_config
from tests.test_train import history

G = 4


def _problems(n: int) -> list[EncodedProblem]:
    return [EncodedProblem(Problem(f"p{i}", "1"), [1, 5 + i, 6]) for i in range(n)]


def _completions(n: int) -> list[Completion]:
    return [Completion([7 + i % 5, 8], [-0.5, -0.6], "stop") for i in range(n)]


def test_groups_with_equal_rewards_leave_the_batch_by_default():
    problems, completions = _problems(3), _completions(3 * G)
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    prompts = [p.prompt_ids for p in problems]
    batch, kept = training_batch(prompts, completions, rewards, GRPOConfig(drop_equal_reward_groups=True))
    assert kept == 1 and batch.input_ids.shape[0] == G  # only the second group's samples
    assert batch.input_ids[0, 1].item() == problems[1].prompt_ids[1]
    adv = batch.advantages.flatten()
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-5) and adv.abs().min() > 0  # centred, all informative
    batch, kept = training_batch(prompts, completions, rewards, GRPOConfig(drop_equal_reward_groups=False))
    assert kept == 3 and batch.input_ids.shape[0] == 3 * G  # kept, with zero advantage
    none, kept = training_batch(prompts[:1], completions[:G], rewards[:1], GRPOConfig(drop_equal_reward_groups=True))
    assert none is None and kept == 0


def test_a_step_with_nothing_to_train_pushes_and_goes_on(tmp_path, tiny_policy, monkeypatch):
    """Every reward equal: no batch, no update, the weights unchanged, and the engines still get the
    step's version (the run's steps stay in lockstep with the pushes)."""
    import fastgrpo.train as loop

    monkeypatch.setattr(loop, "score_completions", lambda run, problems, completions: (torch.zeros(len(problems), G), 0, ""))
    cfg = tiny_config(tmp_path, tiny_policy, **{"grpo.steps": 2, "rollout.group_size": G, "eval.at_start": "false"})
    before = load_file(tiny_policy / "model.safetensors")
    result = train(cfg)
    assert [r.policy["updates"] for r in result.steps] == [0.0, 0.0]
    assert [r.groups_kept for r in result.steps] == [0, 0]
    assert history(tmp_path / "run", "weights_version") == {1: 0.0, 2: 1.0}
    after = load_file(tmp_path / "run" / "checkpoints" / "step_00000002" / "policy" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in after)


class _Engine:
    def __init__(self, version):
        self.version = version

    def generate(self, requests, sampling, seed=0, capture=False, routing=False):
        return _completions(len(requests))

    def stats(self):
        return {"weights_version": self.version}


class _World:
    """Rank 0 of two engines, the other engine's answers arriving with `other_version`."""

    size, engine, main = 2, 0, True

    def __init__(self, other_version):
        self.other_version = other_version

    def share(self, items):
        return 0, items[: len(items) // 2]

    def gather(self, mine):
        theirs = (_completions(len(mine[0])), torch.zeros(len(mine[0]) // G, G), {"weights_version": self.other_version},
                  0, "")
        return [mine, theirs]


@pytest.mark.parametrize("other, fails", [(3, False), (2, True), (None, True)])
def test_engines_holding_different_weight_versions_stop_the_rollout(monkeypatch, other, fails):
    import fastgrpo.train as loop

    monkeypatch.setattr(loop, "score_completions", lambda run, problems, completions: (torch.zeros(len(problems), G), 0, ""))
    cfg = SimpleNamespace(rollout=SimpleNamespace(group_size=G, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8),
                          trainer=SimpleNamespace(routing_replay="off"))
    run = SimpleNamespace(cfg=cfg, world=_World(other), engine=_Engine(3), draft_learner=None)
    if fails:
        with pytest.raises(RuntimeError, match="the engines hold different weight versions"):
            rollout(run, _problems(4), seed=0)
    else:
        answers = rollout(run, _problems(4), seed=0)
        assert len(answers.completions) == 4 * G and answers.rewards.shape == (4, G)


def test_a_step_record_is_its_metrics_and_comes_back_from_them():
    """What MLflow and a checkpoint's history get (flat, by the metric names), and the record a resume
    reads back from it."""
    from fastgrpo.grpo.record import StepRecord, rollout_record

    stats = [{"weights_version": 3, "tokens_per_s": 100.0, "sequences": 8, "spec_steps": 2, "decode_steps": 4,
              "spec_emitted": 9, "spec_seq_steps": 6, "mean_running": 4.0, "draft_version": 2},
             {"weights_version": 3, "tokens_per_s": 60.0, "sequences": 8, "spec_steps": 0, "decode_steps": 4,
              "spec_emitted": 0, "spec_seq_steps": 0, "mean_running": 2.0, "draft_version": 1}]
    record = rollout_record(4, _completions(2 * G), torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0] * G]), stats, 1)
    record.rollout_s, record.weight_sync_bytes = 1.5, 1024
    record.policy, record.draft = {"loss": 0.1, "updates": 1.0}, {"draft_train_s": 0.2, "draft_lag": 1.0}
    m = record.metrics()
    assert m["reward_mean"] == 0.25 and m["accuracy"] == 0.25 and m["groups_kept"] == 1.0
    assert m["gen_tokens_per_s"] == 160.0 and m["engine_tokens_per_s_min"] == 60.0 and m["accept_len"] == 1.5
    assert m["engine_draft_version_min"] == 1.0 and m["weights_version"] == 3.0 and m["rollout_engines"] == 2.0
    assert m["loss"] == 0.1 and m["draft_lag"] == 1.0 and "step" not in m
    assert all(isinstance(v, float) for v in m.values())
    assert StepRecord.from_metrics(4, m) == record
    alone = rollout_record(1, _completions(G), torch.zeros(1, G), stats[1:], 0)
    assert "accept_len" not in alone.metrics() and "engine_tokens_per_s_min" not in alone.metrics()
