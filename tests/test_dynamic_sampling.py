"""DAPO's dynamic sampling with refill (`rollout.refill_rounds`, arXiv 2503.14476) and rewards that never
fail silently: a step refills until it has `rollout.prompts_per_step` informative groups or stops at its
bound and says how many it lacked; the built-in math reward counts its verifier's failures per step
(`reward_errors`), and a step where every answer's reward raised stops the run naming the reward.
The loop runs on stand-ins for the engine, trainer and bridge (its own code, nothing mocked inside
it); one test runs `fastgrpo train` itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fastgrpo.tasks.rewards as rewards_module
from fastgrpo.config import load_config
from fastgrpo.distributed import World
from fastgrpo.grpo.record import merged_stats
from fastgrpo.run_state import TrainResult
from fastgrpo.tasks.problems import Problem
from fastgrpo.tasks.rewards import RewardError, VerifierError, math_reward, score, score_answers
from fastgrpo.tasks.source import EncodedProblem
from fastgrpo.train import run_step
from fastgrpo.types import Completion

G = 4


class _Data:
    """Problems numbered in the order they are drawn (prompt [1, id])."""

    def __init__(self):
        self.position = 0

    def next_batch(self, k):
        batch = [EncodedProblem(Problem(f"p{self.position + j}", "7"), [1, self.position + j]) for j in range(k)]
        self.position += k
        return batch


class _Engine:
    """Answers request key k with the tokens [k, 2]; reports a generate call's counts."""

    def __init__(self):
        self.keys: list[list[int]] = []

    def generate(self, requests, sampling, seed=0, capture=False, routing=False):
        self.keys.append([r.key for r in requests])
        return [Completion([r.key, 2], [-0.5, -0.6], "stop") for r in requests]

    def stats(self):
        n = len(self.keys[-1])
        return {"weights_version": 0, "sequences": n, "tokens": 2 * n, "seconds": 0.5, "tokens_per_s": 4 * n,
                "decode_steps": 2, "mean_running": float(n), "spec_steps": 0, "spec_seq_steps": 0, "spec_emitted": 0}

    def release_memory(self):
        pass

    def resume_memory(self):
        pass


class _Trainer:
    def __init__(self):
        self.batches = []

    def train_step(self, batch):
        self.batches.append(batch)
        return {"updates": 1.0, "loss": 0.0}

    def export_weights(self):
        return iter(())


def _run(tmp_path, informative, answer_text=None, **overrides):
    """A run of the loop's own code on stand-ins; `informative(prompt id)`: whether that prompt's group
    gets rewards 1, 0, 0, 0 (else all 0), through the real math reward: a boxed 7 or a boxed 0."""
    cfg = load_config(None, [f"run_dir={tmp_path}", "rollout.prompts_per_step=4", f"rollout.group_size={G}",
                             "speculation.policy=off", "draft.online=off"]
                      + [f"{k}={v}" for k, v in overrides.items()])

    def text(ids):
        key = ids[0]
        prompt, j = divmod(key, G)
        return answer_text(key) if answer_text else "\\boxed{7}" if informative(prompt) and j == 0 else "\\boxed{0}"

    return SimpleNamespace(cfg=cfg, world=World(), engine=_Engine(), draft_learner=None, data=_Data(),
                           trainer=_Trainer(), text=SimpleNamespace(response_text=text), reward=math_reward(),
                           bridge=SimpleNamespace(push=lambda weights, version: SimpleNamespace(seconds=0.0, bytes=0)),
                           tracker=SimpleNamespace(log_metrics=lambda *a, **k: None), history=TrainResult([], {}),
                           step=0)


def test_refill_reaches_the_informative_groups_the_step_asks_for(tmp_path, capsys):
    """Prompts 0, 3, 6, 9, ... carry a signal: the first batch has 2 of the 4 wanted, a refill 1 more, a
    second 1 more; the step stops there and trains on exactly 4 groups (0, 3, 6, 9)."""
    run = _run(tmp_path, lambda prompt: prompt % 3 == 0, **{"rollout.refill_rounds": 5})
    record = run_step(run, 0)
    assert record.refill_rounds == 2 and record.refill_short == 0 and record.groups_kept == 4
    assert run.data.position == 12
    # a refill's sample j of its prompt i is keyed as if the step had drawn all 12 prompts at once
    assert run.engine.keys == [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))]
    (batch,) = run.trainer.batches
    assert batch.input_ids[::G, 1].tolist() == [0, 3, 6, 9] and batch.size == 4 * G
    # the record is every answer the step sampled, its engine counts those of the three calls
    assert record.reward_mean == pytest.approx(4 / 48) and record.gen_tokens_per_s == pytest.approx(96 / 1.5)
    assert record.metrics()["refill_rounds"] == 2.0 and record.metrics()["refill_short"] == 0.0
    assert "refill 2 round(s), 0 group(s) short" in capsys.readouterr().out


def test_refill_stops_at_its_bound_and_says_how_many_groups_it_lacked(tmp_path, capsys):
    run = _run(tmp_path, lambda prompt: prompt == 5, **{"rollout.refill_rounds": 2})
    record = run_step(run, 0)
    assert record.refill_rounds == 2 and record.groups_kept == 1 and record.refill_short == 3
    assert run.data.position == 12 and len(run.engine.keys) == 3
    assert "refill 2 round(s), 3 group(s) short" in capsys.readouterr().out


def test_without_refill_the_step_trains_on_what_it_has(tmp_path):
    run = _run(tmp_path, lambda prompt: prompt == 1)
    record = run_step(run, 0)
    assert (record.refill_rounds, record.refill_short, record.groups_kept) == (0, 0, 1)
    assert run.data.position == 4 and len(run.engine.keys) == 1


def test_merged_engine_stats_are_the_sums_and_their_rates():
    a = {"weights_version": 3, "sequences": 8, "tokens": 100, "seconds": 2.0, "tokens_per_s": 50.0,
         "decode_steps": 10, "mean_running": 8.0, "spec_steps": 4, "spec_seq_steps": 20, "spec_emitted": 50,
         "accept_len": 2.5, "config_by_concurrency": {"8": {"a": 4}}, "trace": [(8, "a", 2, 0.1)], "draft_version": 1}
    b = {"weights_version": 3, "sequences": 8, "tokens": 60, "seconds": 2.0, "tokens_per_s": 30.0,
         "decode_steps": 30, "mean_running": 4.0, "spec_steps": 2, "spec_seq_steps": 20, "spec_emitted": 30,
         "accept_len": 1.5, "config_by_concurrency": {"8": {"a": 1, "b": 2}}, "trace": [(4, "b", 1, 0.1)],
         "draft_version": 2}
    # the embedded engine's padding counts: 10 of 40 slots padded and 300 of 400 positions needed, then 0 of 60
    # and 500 of 600: the shares of the sums, 10 / 100 and 1 - 800 / 1000 (not the mean of the calls' shares)
    a |= {"token_slots": 40, "padded_slots": 10, "pad_row_share": 0.25, "positions_read": 400, "positions_needed": 300,
          "pad_kv_share": 0.25, "capture_s": 0.5, "static_steps": 10}
    b |= {"token_slots": 60, "padded_slots": 0, "pad_row_share": 0.0, "positions_read": 600, "positions_needed": 500,
          "pad_kv_share": 1 / 6, "capture_s": 0.0, "static_steps": 30}
    m = merged_stats(a, b)
    assert m["pad_row_share"] == pytest.approx(0.1) and m["pad_kv_share"] == pytest.approx(0.2)
    assert m["capture_s"] == 0.5 and m["static_steps"] == 40
    assert m["tokens"] == 160 and m["tokens_per_s"] == 40.0 and m["sequences"] == 16
    assert m["mean_running"] == (8.0 * 10 + 4.0 * 30) / 40 and m["accept_len"] == 80 / 40
    assert m["config_by_concurrency"] == {"8": {"a": 5, "b": 2}} and len(m["trace"]) == 2
    assert m["draft_version"] == 2 and m["weights_version"] == 3


# -- rewards that never fail silently ----------------------------------------------------------------


def _broken_verify(*args, **kwargs):
    raise RuntimeError("verifier broken")


def test_the_math_reward_raises_a_verifier_error_instead_of_scoring_zero(monkeypatch):
    assert score("so \\boxed{7}", "7") == 1.0 and score("so \\boxed{8}", "7") == 0.0
    assert score("no boxed answer", "7") == 0.0  # a wrong answer needs no verifier
    with pytest.raises(VerifierError, match="the gold answer '' does not parse"):
        score("so \\boxed{7}", "")
    monkeypatch.setattr(rewards_module, "verify", _broken_verify)
    with pytest.raises(VerifierError, match=r"reward math \(math-verify\) raised RuntimeError: verifier broken"):
        score("so \\boxed{7}", "7")
    problem = Problem("q", "7")
    scored = score_answers(math_reward(), ["\\boxed{7}", "none", "\\boxed{8}"], [problem] * 3)
    assert scored.rewards == [0.0, 0.0, 0.0] and scored.errors == 2 and "verifier broken" in scored.first_error


def test_verifier_errors_are_counted_per_step_and_shown(tmp_path, monkeypatch, capsys):
    """Answers of odd keys break the verifier: they score 0, the step counts them and goes on."""
    real = rewards_module.verify
    monkeypatch.setattr(rewards_module, "verify",
                        lambda gold, pred, **kw: _broken_verify() if "3" in str(pred) else real(gold, pred, **kw))
    run = _run(tmp_path, lambda prompt: True, answer_text=lambda key: "\\boxed{3}" if key % 2 else "\\boxed{7}")
    record = run_step(run, 0)
    assert record.reward_errors == 8 and record.reward_mean == 0.5 and record.metrics()["reward_errors"] == 8.0
    assert "REWARD ERRORS 8" in capsys.readouterr().out


def test_a_step_where_every_reward_raised_stops_the_run_naming_the_reward(tmp_path, monkeypatch):
    monkeypatch.setattr(rewards_module, "verify", _broken_verify)
    run = _run(tmp_path, lambda prompt: True, answer_text=lambda key: "\\boxed{7}")
    with pytest.raises(RewardError, match=r"the reward math \(task.reward\) raised on every one of step 1's 16 "
                                          r"answers; the first: reward math \(math-verify\) raised RuntimeError"):
        run_step(run, 0)
    assert run.trainer.batches == []  # nothing trained on the zeros


def test_fastgrpo_train_stops_on_a_broken_verifier(tmp_path, tiny_policy, monkeypatch, capsys):
    """The whole command: the built-in reward's verifier broken on every answer (whatever the policy
    writes) ends `fastgrpo train` with exit code 1 and the reward's name, before any update."""
    from fastgrpo.cli import main
    from tests.conftest import tiny_overrides

    def broken(completion, answer, timeout_seconds=2.0):
        raise VerifierError("reward math (math-verify) raised RuntimeError: verifier broken")

    monkeypatch.setattr(rewards_module, "score", broken)
    config = tmp_path / "config.yaml"
    config.write_text("seed: 0\n")
    args = ["train", "--config", str(config), *tiny_overrides(tmp_path, tiny_policy, **{
        "grpo.steps": 1, "eval.at_start": "false", "rollout.prompts_per_step": 2})]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "the reward math (task.reward) raised on every one of step 1's 8 answers" in err
    assert "verifier broken" in err
