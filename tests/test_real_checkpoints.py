"""Real checkpoints: `fastgrpo train` runs Llama 3.1, Qwen2.5 and Qwen3 dense from their Hugging
Face directories as a user has them (fastgrpo/bench/family_checkpoints.py: the families' special tokens, chat
templates and generation_config stop ids; Llama without a pad token, the Qwens without BOS), and refuses
what it does not compute before any work."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from fastgrpo.cli import main
from fastgrpo.config import TaskConfig, load_config
from fastgrpo.engines import build_engine
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import BOXED_INSTRUCTION, load_text_format
from fastgrpo.train import train
from fastgrpo.types import Request, SamplingParams
from fastgrpo.bench.family_checkpoints import FAMILY_NAMES, write_family_checkpoint, write_task

PROBLEM = "Compute left to right: 7 * 2 - 3"


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def checkpoint(request, tmp_path_factory):
    return request.param, write_family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("system", ["", "You are a careful calculator."])
def test_a_chat_prompt_is_the_chat_template_token_for_token(checkpoint, system):
    name, path = checkpoint
    text = load_text_format(path, TaskConfig(system_prompt=system))
    tok = AutoTokenizer.from_pretrained(path)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{PROBLEM}\n\n{BOXED_INSTRUCTION}"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert text.chat and text.prompt_ids(PROBLEM) == list(want)
    rendered = tok.decode(text.prompt_ids(PROBLEM))
    assert (system in rendered) and PROBLEM in rendered and "\\boxed{}" in rendered
    assert rendered.endswith({"llama3.1": "<|start_header_id|>assistant<|end_header_id|>\n\n"}.get(
        name, "<|im_start|>assistant\n"))


def test_plain_prompts_need_no_bos(checkpoint):
    name, path = checkpoint
    text = load_text_format(path, TaskConfig(prompt_format="plain"))
    tok = AutoTokenizer.from_pretrained(path)
    body = tok.encode(PROBLEM + "\n", add_special_tokens=False)
    assert not text.chat
    assert text.prompt_ids(PROBLEM) == ([tok.bos_token_id] if name == "llama3.1" else []) + body
    assert text.response_ids("4") == tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]


def test_stop_ids_are_the_eos_the_generation_config_and_the_turn_end(checkpoint):
    name, path = checkpoint
    text = load_text_format(path)
    tok = AutoTokenizer.from_pretrained(path)
    listed = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert set(text.stop_ids) == {tok.eos_token_id, *listed}
    end = {"llama3.1": "<|eot_id|>"}.get(name, "<|im_end|>")
    assert text.response_end_id == tok.convert_tokens_to_ids(end)  # SFT and draft text end their turns so
    if name == "llama3.1":  # <|eot_id|> ends a turn; only generation_config.json names it
        assert tok.eos_token == "<|end_of_text|>" and tok.convert_tokens_to_ids("<|eot_id|>") in text.stop_ids


def test_a_sample_stops_at_an_id_only_generation_config_lists(tmp_path):
    """The greedy answer of a random Llama 3.1 runs to the token limit; with its 5th token listed in
    generation_config.json (and nowhere else), the same request stops there."""
    path = write_family_checkpoint("llama3.1", tmp_path / "llama")
    cfg = load_config(None, [f"model.path={path}", "model.max_context=128", "rollout.max_batch=4", "rollout.max_new_tokens=64",
                             "speculation.policy=off", "task.prompt_format=plain"])
    policy = load_policy(path)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)

    def answer():
        text = load_text_format(path, cfg.task)
        engine = build_engine(cfg, AutoConfig.from_pretrained(path), text, policy.state_dict().items())
        return text, engine.generate([Request(text.prompt_ids(PROBLEM))], greedy)[0]

    text, free = answer()
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    assert stop not in text.stop_ids and stop != text.tokenizer.eos_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": gen["eos_token_id"] + [stop]}))
    _, stopped = answer()
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]


def family_run(tmp_path, path, *extra: str) -> list[str]:
    task = write_task(tmp_path / "task.jsonl", n=48)
    return [f"model.path={path}", f"task.source={task}", f"run_dir={tmp_path / 'run'}", "model.max_context=256",
            "task.eval_size=4", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24",
            "rollout.max_batch=8", "rollout.top_k=20", "grpo.steps=2", "grpo.micro_batch_size=4",
            "grpo.drop_equal_reward_groups=false", "eval.samples=1", "eval.at_start=false", "checkpoint.every=2",
            "tracking.enabled=false", "threads=1", *extra]


def test_grpo_trains_each_family_from_its_hugging_face_directory(checkpoint, tmp_path):
    """Two GRPO steps (torch trainer, embedded engine, top-k sample sets) on each family: the trainer
    scores what the engine sampled with the engine's own log-probabilities (the same weights, the same
    family forward), and the checkpoint it writes reloads as the family with its stop ids."""
    name, path = checkpoint
    cfg = load_config(None, family_run(tmp_path, path, "speculation.policy=off", "draft.online=off"))
    result = train(cfg)
    assert len(result.steps) == 2
    for r in result.steps:
        assert abs(r.policy["kl_engine_trainer"]) < 1e-5, (name, r.policy["kl_engine_trainer"])
        assert r.response_len_mean > 0 and torch.isfinite(torch.tensor(r.policy["loss"]))
    saved = result.checkpoint / "policy"
    assert AutoConfig.from_pretrained(saved).model_type == AutoConfig.from_pretrained(path).model_type
    assert load_text_format(saved).stop_ids == load_text_format(path).stop_ids


@pytest.mark.parametrize("config", [{"model_type": "gpt2"}, {"model_type": "llama", "auto_map": {
    "AutoModelForCausalLM": "modeling_custom.Custom"}}], ids=["gpt2", "custom-code"])
def test_an_unsupported_checkpoint_is_refused_before_any_work(tmp_path, capsys, config):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    args = [f"model.path={tmp_path / 'model'}", f"run_dir={tmp_path / 'run'}", "tracking.enabled=false"]
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert "llama" in err and "qwen2" in err and "qwen3" in err
    assert not (tmp_path / "run").exists()  # nothing started


def test_chat_format_needs_a_chat_template(tmp_path, tiny_policy):
    """fastgrpo's own tokenizer has no chat template: auto is plain, chat is refused by name."""
    assert not load_text_format(tiny_policy).chat
    with pytest.raises(ValueError, match="prompt_format=chat.*no chat template"):
        load_text_format(tiny_policy, TaskConfig(prompt_format="chat"))


@pytest.mark.slow  # a draft pretrained per family, then aware's calibration: ~40 s each
def test_aware_speculation_runs_on_each_family(checkpoint, tmp_path):
    """`fastgrpo draft-pretrain` sizes the draft from the family (its heads, head size, tied head) on the
    chat-formatted corpus; two GRPO steps with `aware` and the online draft learner, losslessly (the
    trainer's log-probabilities are the engine's)."""
    from fastgrpo.draft_learning.pretrain import pretrain_draft

    name, path = checkpoint
    args = family_run(tmp_path, path, f"draft.path={tmp_path / 'draft'}", "draft.pretrain_steps=60",
                      f"speculation.cost_model_dir={tmp_path / 'costs'}", "speculation.policy=aware",
                      "draft.online=sync")
    pretrain_draft(load_config(None, args))
    result = train(load_config(None, args))
    assert len(result.steps) == 2
    assert all(abs(r.policy["kl_engine_trainer"]) < 1e-5 for r in result.steps), name


def _train(rank, world, args):
    return [r.metrics() for r in train(load_config(None, args)).steps]


@pytest.mark.slow  # a world of 4 (gloo)
def test_a_megatron_tp2_pp2_world_trains_qwen3(tmp_path):
    """Qwen3 (q/k norms, its own head size) in Megatron at TP2 x PP2 with an engine on each rank: two GRPO
    steps whose trainer log-probabilities equal what the engines sampled with (megatron-core's
    qk_layernorm and kv_channels against the engine's family forward, at the same weights)."""
    from fastgrpo.local_world import run_world

    path = write_family_checkpoint("qwen3", tmp_path / "qwen3")
    args = family_run(tmp_path, path, "trainer.backend=megatron", "parallel.tensor=2", "parallel.pipeline=2",
                      "speculation.policy=off", "draft.online=off", "rollout.prompts_per_step=4")
    steps = run_world(_train, 4, tmp_path / "world", args, timeout_s=300.0)
    for rank_steps in steps:
        assert len(rank_steps) == 2
        assert all(abs(m["kl_engine_trainer"]) < 1e-5 for m in rank_steps), [m["kl_engine_trainer"] for m in rank_steps]


@pytest.mark.slow  # a world of 2 per family
def test_a_deepspeed_zero3_world_trains_each_family(checkpoint, tmp_path):
    """DeepSpeed ZeRO-3 at DP2 (Hugging Face modules: biases, q/k norms, a tied or untied head, all sharded)
    on each family: two GRPO steps with top-k sample sets, the trainer's log-probabilities over the
    engine's sets equal to what the engine sampled with."""
    pytest.importorskip("deepspeed")
    from fastgrpo.local_world import run_world

    name, path = checkpoint
    args = family_run(tmp_path, path, "trainer.backend=deepspeed", "deepspeed.zero_stage=3",
                      "speculation.policy=off", "draft.online=off")
    steps = run_world(_train, 2, tmp_path / "world", args, timeout_s=300.0)
    for rank_steps in steps:
        assert len(rank_steps) == 2
        assert all(abs(m["kl_engine_trainer"]) < 1e-5 for m in rank_steps), (name, rank_steps)


def test_sft_from_a_family_checkpoint_keeps_its_tokens_and_learns_the_task(tmp_path):
    """`sft.init`: SFT starts from a Qwen2.5 directory and saves a Qwen2.5 with the same tokenizer, chat
    template and stop ids, its loss on chat-formatted worked solutions (computed here, apart) well below
    the starting checkpoint's; a missing directory is refused by the key's name before any work."""
    from fastgrpo.config import load_config
    from fastgrpo.sft import build_policy
    from fastgrpo.tasks.source import load_task

    init = write_family_checkpoint("qwen2.5", tmp_path / "qwen2.5")
    out = tmp_path / "policy"
    args = [f"model.path={out}", f"sft.init={init}", "model.max_context=256", "task.train_size=400",
            "task.eval_size=8", "sft.examples=960", "sft.batch_size=16", "sft.warmup_steps=5", "sft.lr=3e-3",
            "sft.max_problem_steps=4", "rollout.max_new_tokens=64", "eval.samples=1", "threads=1",
            "tracking.enabled=false"]
    assert main(["sft", *args]) == 0
    assert AutoConfig.from_pretrained(out).model_type == "qwen2"
    before, after = load_text_format(init), load_text_format(out)
    assert after.chat and after.stop_ids == before.stop_ids and after.response_end_id == before.response_end_id
    assert after.tokenizer.get_vocab() == before.tokenizer.get_vocab()
    assert after.tokenizer.chat_template == before.tokenizer.chat_template

    train_problems, _ = load_task(load_config(None, args).task)

    def loss(path) -> float:
        model = load_policy(path)
        total = 0.0
        for p in train_problems[:16]:
            prompt, response = before.prompt_ids(p.prompt), before.response_ids(p.solution)
            ids = torch.tensor([prompt + response])
            labels = torch.tensor([[-100] * len(prompt) + response])
            with torch.no_grad():
                total += float(model(input_ids=ids, labels=labels).loss)
        return total / 16

    start, end = loss(init), loss(out)
    assert end < 0.5 * start, (start, end)

    with pytest.raises(FileNotFoundError, match="sft.init"):
        build_policy(load_config(None, [*args, f"sft.init={tmp_path / 'nowhere'}"]))
