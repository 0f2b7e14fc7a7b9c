"""GRPO end to end on the test-size policy: metrics land in MLflow, resume is exact."""

import json

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from fastgrpo.cli import main
from fastgrpo.train import train
from fastgrpo.tracking import default_tracking_uri
from tests.conftest import tiny_config

STEP_METRICS = ["reward_mean", "reward_std", "accuracy", "response_len_mean", "response_len_max", "rollout_s",
                "train_s", "weight_sync_s", "gen_tokens_per_s", "kl_engine_trainer", "clip_fraction", "entropy",
                "grad_norm", "loss"]


def history(run_dir, key):
    client = MlflowClient(default_tracking_uri(run_dir))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, "resume must log into the same MLflow run"
    return {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, key)}


def test_sft_policy_loads_with_auto_classes(tiny_policy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    tok = AutoTokenizer.from_pretrained(tiny_policy)
    ids = tok("Compute left to right: 3 + 4\n", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tok)
    report = json.loads((tiny_policy / "sft_report.json").read_text())
    assert report["train_loss"] < 2.0  # it learned something of the format


def test_grpo_steps_log_to_mlflow_and_resume_is_exact(tmp_path, tiny_policy):
    # drop_equal_reward_groups off so that every step trains even when a tiny policy gets all wrong
    full = tiny_config(tmp_path / "full", tiny_policy, **{"grpo.drop_equal_reward_groups": "false"})
    train(full)
    run_dir = tmp_path / "full" / "run"
    for key in STEP_METRICS:
        h = history(run_dir, key)
        assert sorted(h) == [1, 2, 3, 4], key
    assert history(run_dir, "eval/pass1_greedy").keys() == {0, 4}
    assert all(v > 0 for v in history(run_dir, "response_len_mean").values())

    split = tiny_config(tmp_path / "split", tiny_policy,
                        **{"grpo.drop_equal_reward_groups": "false", "grpo.steps": 2})
    train(split)
    resumed = tiny_config(tmp_path / "split", tiny_policy, **{"grpo.drop_equal_reward_groups": "false"})
    train(resumed, resume=True)
    split_dir = tmp_path / "split" / "run"
    for key in ["loss", "reward_mean", "response_len_mean", "grad_norm"]:
        assert history(split_dir, key) == history(run_dir, key), key
    a = load_file(run_dir / "checkpoints" / "step_00000004" / "policy" / "model.safetensors")
    b = load_file(split_dir / "checkpoints" / "step_00000004" / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # keep_last=2: steps 2 and 4 kept
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_eval_command_on_a_checkpoint(tmp_path, tiny_policy, capsys, monkeypatch):
    """The command's figures from the answers themselves: every answer the reward scores is recorded
    (a stand-in score that depends on the text: the test policy answers few problems right), the
    greedy ones are checked against Hugging Face's greedy `generate`, and pass@1, mean accuracy and
    pass@2 with their standard errors are computed here from the recorded scores."""
    import fastgrpo.tasks.rewards as rewards
    from fastgrpo.config import load_config
    from fastgrpo.models.policy import load_policy
    from fastgrpo.models.tokenizer import load_text_format
    from fastgrpo.tasks.source import load_task

    scored = []

    def stand_in(text, answer, timeout_s):
        scored.append((text, answer, float(len(text) % 2 == 0)))
        return scored[-1][2]

    monkeypatch.setattr(rewards, "score", stand_in)
    cfg_args = [f"model.path={tiny_policy}", "model.size=test", "model.max_context=160", "task.eval_size=4",
                "task.max_steps=6", "eval.samples=2", "rollout.max_new_tokens=48"]
    config = tmp_path / "config.yaml"  # its own config: the repository's default is the demonstration task's
    config.write_text("seed: 0\n")
    assert main(["eval", "--config", str(config), *cfg_args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == 4 and out["split"] == "test"

    cfg = load_config(str(config), cfg_args)
    problems = load_task(cfg.task)[1]  # the test split
    answers = [p.answer for p in problems]
    greedy, sampled = scored[:4], scored[4:]
    assert len(scored) == 4 + 4 * 2
    assert [a for _, a, _ in greedy] == answers and [a for _, a, _ in sampled] == [a for a in answers for _ in "12"]
    policy, text = load_policy(tiny_policy), load_text_format(tiny_policy)
    for (got, _, _), problem in zip(greedy, problems):
        prompt = torch.tensor([text.prompt_ids(problem.prompt)])
        ids = policy.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=min(48, 160 - prompt.shape[1]), eos_token_id=text.tokenizer.eos_token_id,
                              pad_token_id=text.tokenizer.pad_token_id)[0, prompt.shape[1]:]
        assert got == text.response_text(ids.tolist())

    def mean_se(values):
        mean = sum(values) / len(values)
        return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5

    by_problem = [[v for _, _, v in sampled[2 * i: 2 * i + 2]] for i in range(4)]
    expected = {"pass1_greedy": mean_se([v for _, _, v in greedy]),
                "mean_accuracy": mean_se([sum(s) / 2 for s in by_problem]),
                "pass_at_2": mean_se([max(s) for s in by_problem])}
    assert len({v for _, _, v in scored}) == 2  # both scores occur: a wrong aggregation would show
    for name, (mean, se) in expected.items():
        assert out[name] == pytest.approx(mean) and out[f"{name}_se"] == pytest.approx(se), name


def test_nan_step_is_skipped_and_training_goes_on(tmp_path, tiny_policy, monkeypatch):
    """Also: the run computes at its `threads` and leaves the process's thread count as it found it."""
    import fastgrpo.grpo.batch as batch

    real, seen = batch.group_advantages, []

    def nan_advantages(r, s, **kw):
        seen.append(torch.get_num_threads())
        return real(r, s, **kw) * float("nan")

    monkeypatch.setattr(batch, "group_advantages", nan_advantages)
    outside = torch.get_num_threads()
    inside = 2 if outside == 1 else 1
    cfg = tiny_config(tmp_path, tiny_policy, **{"grpo.drop_equal_reward_groups": "false", "grpo.steps": 1,
                                                 "threads": inside})
    before = load_file(tiny_policy / "model.safetensors")
    train(cfg)
    assert seen and set(seen) == {inside} and torch.get_num_threads() == outside
    assert history(tmp_path / "run", "skipped_updates") == {1: 1.0}
    after = load_file(tmp_path / "run" / "checkpoints" / "step_00000001" / "policy" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in after)


def test_file_dataset_with_too_long_prompts(tmp_path, tiny_policy, caplog):
    rows = [{"prompt": "Compute left to right: 3 + 4", "answer": "7"},
            {"prompt": "Compute left to right: " + " + 1" * 200, "answer": "201"},
            {"prompt": "Compute left to right: 5 * 2", "answer": 10},
            {"question": "no prompt field"}]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps(rows[0]) + "\n")
    cfg = tiny_config(tmp_path, tiny_policy, **{"task.source": str(data), "task.eval_source": str(evals),
                                                 "grpo.steps": 1})
    with caplog.at_level("WARNING"):
        train(cfg)
    text = caplog.text
    assert "skipped 1 of" in text and "longer than the context" in text
    assert "malformed" in text.lower()


def test_missing_dataset_is_a_clear_error(tmp_path, tiny_policy, capsys):
    rc = main(["train", f"model.path={tiny_policy}", "model.size=test", f"run_dir={tmp_path / 'r'}",
               f"task.source={tmp_path / 'nope.jsonl'}"])
    assert rc == 1
    assert "dataset file not found" in capsys.readouterr().err


def test_draft_pretrain_and_speculative_grpo(tmp_path, tiny_policy, tiny_draft):
    import json as _json

    meta = _json.loads((tiny_draft / "draft_config.json").read_text())
    assert meta["pretrain"]["eval_top1"] > 0.3  # it learned to predict the policy's next tokens
    cfg = tiny_config(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "speculation.policy": "static",
                                                "draft.online": "sync", "draft.sync_budget": 0.5,
                                                "grpo.steps": 2, "grpo.drop_equal_reward_groups": "false"})
    train(cfg)
    accept = history(tmp_path / "run", "accept_len")
    assert sorted(accept) == [1, 2] and all(v > 1.0 for v in accept.values())  # drafts accepted
    # online draft learning: trained every step, published as a new version, one policy update behind
    assert history(tmp_path / "run", "draft_version") == {1: 1.0, 2: 2.0}
    assert history(tmp_path / "run", "draft_lag") == {1: 1.0, 2: 1.0}
    assert all(0 < v < 10 for v in history(tmp_path / "run", "draft_loss").values())
    assert all(0 <= v <= 1 for v in history(tmp_path / "run", "draft_top1").values())
    assert all(v > 0 for v in history(tmp_path / "run", "draft_train_s").values())
    saved = tmp_path / "run" / "checkpoints" / "step_00000002" / "draft"
    assert (saved / "draft.safetensors").is_file() and (saved / "draft_buffer.safetensors").is_file()
    # resume restores the learner: the next step publishes version 3
    train(tiny_config(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "speculation.policy": "static",
                                                "draft.online": "sync", "draft.sync_budget": 0.5,
                                                "grpo.steps": 3, "grpo.drop_equal_reward_groups": "false"}),
          resume=True)
    assert history(tmp_path / "run", "draft_version")[3] == 3.0
    spec = history(tmp_path / "run", "spec_step_fraction")
    assert spec == {1: 1.0, 2: 1.0, 3: 1.0}  # static speculates at every decode step
    stats = list((tmp_path / "run" / "mlartifacts").rglob("step_000001.json"))
    assert len(stats) == 1
    record = _json.loads(stats[0].read_text())
    assert record["config_by_concurrency"] and record["trace"]


@pytest.mark.slow  # three short GRPO runs: ~50 s
def test_same_seed_same_run_and_speculation_does_not_change_learning(tmp_path, tiny_policy, tiny_draft):
    """Counter-based sampling: the same seed and config give the same evals and training metrics run
    to run, and a run with speculation sees the same rollouts as one without, so learns the same.
    Exactly the same only up to float-rounding flips at a CDF boundary (batch shapes differ between
    speculative and plain forwards; a flip early in a run changes what follows), which are rare: the
    token-level check is in test_speculation.py. Also covers `bench learning` and summary.json."""
    from fastgrpo.bench.learning import bench_learning, run_config

    cfg = tiny_config(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "speculation.policy": "aware",
                                                "draft.online": "sync", "speculation.cost_model_dir": tmp_path / "costs",
                                                "task.eval_size": 24})
    out = tmp_path / "learning.json"
    bench_learning(cfg, quick=True, output=out, seeds=1, steps=3, every=2)
    saved = json.loads(out.read_text())
    on, off = saved["aware"]["seeds"][0], saved["off"]["seeds"][0]
    assert [p["step"] for p in on["curve"]] == [0, 2, 3] and saved["seeds"][0] == on
    assert on["start"] == off["start"]  # the same policy, the same noise: the same eval
    for a, b in zip(on["curve"], off["curve"]):
        assert abs(a["mean_accuracy"] - b["mean_accuracy"]) <= 2 / 24 and abs(a["pass1_greedy"] - b["pass1_greedy"]) <= 2 / 24
    assert sum(x != y for x, y in zip(on["train_accuracy"], off["train_accuracy"])) <= 1
    assert (out.with_suffix(".png")).stat().st_size > 10_000

    # without speculation nothing depends on timing: the same run, bit for bit
    first_dir = tmp_path / "learning-runs" / "off-seed0"
    again = train(run_config(cfg, 0, "off", 3, 2, tmp_path / "again"))
    summary = json.loads((first_dir / "summary.json").read_text())
    assert summary["start"] == {k.removeprefix("eval/"): v for k, v in again.evals[0].items()}
    assert summary["end"] == {k.removeprefix("eval/"): v for k, v in again.evals[3].items()}
    for key in ["loss", "reward_mean", "response_len_mean", "grad_norm", "entropy"]:
        assert {r.step: r.metrics()[key] for r in again.steps if key in r.metrics()} == history(first_dir, key), key
    assert summary["steps_run"] == 3 and summary["median"]["step_s"] > 0 and off["summary"] == summary


@pytest.mark.slow  # two SFT runs: ~40 s
def test_sft_is_the_same_policy_bit_for_bit(tmp_path, tiny_policy):
    """SFT runs a fixed number of steps (no clock): building the policy again, at the thread count its report
    records, gives the same weights."""
    from fastgrpo.sft import build_policy

    threads = json.loads((tiny_policy / "sft_report.json").read_text())["threads"]
    cfg = tiny_config(tmp_path, threads=threads)
    report = build_policy(cfg)
    assert report["complete"] == 1.0 and report["steps"] == cfg.sft.examples // cfg.sft.batch_size
    assert report["threads"] == threads >= 1
    a, b = load_file(tiny_policy / "model.safetensors"), load_file(tmp_path / "policy" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_summary_claims_no_start_it_did_not_evaluate():
    from fastgrpo.grpo.report import summary_markdown

    end = {"pass1_greedy": 0.25, "mean_accuracy": 0.2, "pass_at_4": 0.5,
           "pass1_greedy_se": 0.02, "mean_accuracy_se": 0.01, "pass_at_4_se": 0.02}
    start = {k: v / 2 for k, v in end.items()}
    summary = {"config": {"eval_samples": 4, "eval_split": "validation", "eval_problems": 500, "seed": 0,
                          "prompts_per_step": 16, "group_size": 8, "lr": 1e-5, "speculation": "off",
                          "draft_online": "off"},
               "start": None, "start_step": None, "end": end, "end_step": 30, "median": {}, "steps_run": 30}
    without = summary_markdown(summary).splitlines()
    assert without[2] == "| mean accuracy (4 samples, T = rollout's) | not evaluated | 20.0% ± 1.0 | - |"
    with_start = summary_markdown(summary | {"start": start, "start_step": 0}).splitlines()
    assert with_start[2] == "| mean accuracy (4 samples, T = rollout's) | 10.0% ± 0.5 | 20.0% ± 1.0 | +10.0 |"
