"""Datasets as people have them: GSM8K's and MATH's own fields, veRL's parquet (chat-message
prompts, `reward_model.ground_truth`), a `datasets.save_to_disk` directory, Arrow and JSON files; errors
that name the file, the keys expected, the first bad row's place and its keys; chat-message prompts
through the checkpoint's template; `fastgrpo train` and `fastgrpo eval` on a veRL-layout parquet."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoTokenizer

from fastgrpo.cli import main
from fastgrpo.config import ConfigError, TaskConfig, load_config
from fastgrpo.models.tokenizer import BOXED_INSTRUCTION, load_text_format
from fastgrpo.tasks.datasets import DatasetError, load_problems
from fastgrpo.tasks.source import encode_problems, load_task_data
from fastgrpo.tracking import default_tracking_uri
from fastgrpo.bench.family_checkpoints import write_family_checkpoint

# rows as the public datasets hold them (abridged texts)
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
]
MATH = [
    {"problem": "If $\\sin x = \\frac{1}{2}$ for an acute angle $x$, what is $\\cos x$?", "level": "Level 2",
     "type": "Precalculus",
     "solution": "Since $\\cos^2 x = 1 - \\sin^2 x = \\frac{3}{4}$ and $x$ is acute, "
                 "$\\cos x = \\boxed{\\frac{\\sqrt{3}}{2}}$."},
    {"problem": "What is $1+1$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "First $\\boxed{3}$ was a slip; $1 + 1 = \\boxed{2}$."},
]


def verl_row(i: int, question: str, answer: str, system: bool = False) -> dict:
    """A row in the layout of veRL's examples/data_preprocess/gsm8k.py, asking for a boxed answer (as its
    MATH preprocessing does; its GSM8K one asks for "####", which the built-in reward does not read)."""
    user = {"role": "user", "content": question + " Let's think step by step and output the final answer "
                                                  "within \\boxed{}."}
    return {"data_source": "openai/gsm8k",
            "prompt": ([{"role": "system", "content": "You are a careful solver."}] if system else []) + [user],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "answer": f"worked\n#### {answer}", "question": question}}


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_gsm8k_jsonl_by_its_own_fields(tmp_path, caplog):
    f = tmp_path / "gsm8k_train.jsonl"
    write_jsonl(f, GSM8K)
    with caplog.at_level("WARNING"):
        problems, report = load_problems(f)
    assert [(p.prompt, p.answer) for p in problems] == [(GSM8K[0]["question"], "72"), (GSM8K[1]["question"], "10")]
    assert (report.prompt_key, report.answer_key, report.guessed, report.malformed) == ("question", "answer", True, 0)
    assert "prompts from 'question' (guessed), answers from 'answer' (guessed)" in caplog.text


def test_math_jsonl_reduces_a_solution_to_its_last_boxed_answer(tmp_path, caplog):
    f = tmp_path / "math.jsonl"
    write_jsonl(f, MATH + [{"problem": "No box?", "solution": "The answer is 4."},
                           {"problem": "Open box", "solution": "so \\boxed{\\frac{1}{2}"}])
    with caplog.at_level("WARNING"):
        problems, report = load_problems(f)
    assert [p.answer for p in problems] == ["\\frac{\\sqrt{3}}{2}", "2"]
    assert (report.prompt_key, report.answer_key, report.rows, report.malformed) == ("problem", "solution", 4, 2)
    # a worked solution that names no answer is skipped, not taken whole as the gold answer
    assert ("skipped 2 malformed rows of 4; the first: line 3 (keys 'problem', 'solution'): 'solution' is a "
            "worked solution with no \\boxed{} or #### answer in it") in caplog.text


def test_math500_layout_prefers_the_answer_field(tmp_path):
    f = tmp_path / "math500.jsonl"
    write_jsonl(f, [{"problem": "p", "solution": "long \\boxed{7}", "answer": "\\sqrt{2}", "level": 3}])
    (problem,), report = load_problems(f)
    assert problem.answer == "\\sqrt{2}" and report.answer_key == "answer"


def test_verl_parquet_chat_prompts_and_nested_ground_truth(tmp_path):
    rows = [verl_row(0, "What is 2 + 3?", "5", system=True), verl_row(1, "What is 7 - 4?", "3")]
    f = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    problems, report = load_problems(f)
    assert [p.prompt for p in problems] == [r["prompt"] for r in rows]  # the messages, system turn kept
    assert [p.answer for p in problems] == ["5", "3"]
    assert (report.prompt_key, report.answer_key, report.chat_prompts) == ("prompt", "reward_model.ground_truth", 2)
    # other fields, by dotted paths: veRL's extra_info holds the text question and GSM8K's worked answer
    problems, report = load_problems(f, "extra_info.question", "extra_info.answer")
    assert [(p.prompt, p.answer) for p in problems] == [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3")]
    assert not report.guessed


def test_a_saved_datasets_directory_arrow_and_json_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [verl_row(i, f"What is {i} + 1?", str(i + 1)) for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    problems, report = load_problems(tmp_path / "saved")
    assert [p.answer for p in problems] == ["1", "2", "3"] and problems[0].prompt == rows[0]["prompt"]
    # a DatasetDict: its root names the splits; a split's directory is a dataset
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K),
                          "test": datasets.Dataset.from_list(GSM8K[:1])}).save_to_disk(str(tmp_path / "gsm8k"))
    with pytest.raises(DatasetError, match=re.escape("a DatasetDict with splits train, test; point task.source")):
        load_problems(tmp_path / "gsm8k")
    assert [p.answer for p in load_problems(tmp_path / "gsm8k" / "test")[0]] == ["72"]
    with pytest.raises(DatasetError, match="not one written by datasets' save_to_disk"):
        load_problems(tmp_path)
    # Arrow: the IPC stream datasets writes, and the IPC file format
    table = pa.Table.from_pylist(GSM8K)
    for name, writer in (("stream.arrow", pa.ipc.new_stream), ("file.arrow", pa.ipc.new_file)):
        with writer(str(tmp_path / name), table.schema) as w:
            w.write_table(table)
        assert [p.answer for p in load_problems(tmp_path / name)[0]] == ["72", "10"]
    # JSON: one array of rows, or JSON lines under a .json name
    (tmp_path / "array.json").write_text(json.dumps(MATH, indent=1))
    assert [p.answer for p in load_problems(tmp_path / "array.json")[0]] == ["\\frac{\\sqrt{3}}{2}", "2"]
    write_jsonl(tmp_path / "lines.json", GSM8K)
    assert len(load_problems(tmp_path / "lines.json")[0]) == 2


def test_errors_name_the_file_the_keys_expected_and_the_first_bad_row(tmp_path, caplog):
    # fields a new user's own file has, none of which fastgrpo knows
    f = tmp_path / "mine.jsonl"
    write_jsonl(f, [{"q": "1+1", "a": "2"}, {"q": "2+2", "a": "4"}])
    with pytest.raises(DatasetError) as e:
        load_problems(f)
    assert str(e.value) == (
        f"{f}: no row has a prompt field: each row needs a prompt at one of 'prompt', 'question', 'problem' (a "
        f"non-empty string or a list of chat messages {{role, content}}) and an answer at one of 'answer', "
        f"'ground_truth', 'reward_model.ground_truth', 'solution' (a string or a number); task.prompt_key / "
        f"task.answer_key name other fields (dotted paths for nested ones, e.g. reward_model.ground_truth). "
        f"The first row, line 1, has keys 'q', 'a'")
    assert len(load_problems(f, "q", "a")[0]) == 2  # named, they load

    # no usable row: the first bad one's line (blank lines counted), keys, and what is wrong with it
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, ["", "{not json", json.dumps({"question": "1+1", "answer": [2], "id": 7}),
                      json.dumps({"question": "", "answer": "1"})])
    with pytest.raises(DatasetError) as e:
        load_problems(bad)
    message = str(e.value)
    assert message.startswith(f"{bad}: no usable rows found (3 rows, 3 malformed): each row needs a prompt at "
                              f"'question' (")
    assert message.endswith("The first skipped: line 2 (not valid JSON)")

    # a nested key that stops short names the keys found where it stops
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "reward_model": {"style": "rule", "gt": "1"}}]), nested)
    with pytest.raises(DatasetError) as e:
        load_problems(nested, answer_key="reward_model.ground_truth")
    assert str(e.value).endswith("The first skipped: row 1 (keys 'prompt', 'reward_model'): no "
                                 "'reward_model.ground_truth' ('reward_model' has keys 'style', 'gt')")

    # some rows skipped: counted, and the first described in the warning
    some = tmp_path / "some.jsonl"
    write_jsonl(some, [GSM8K[0], {"question": "x", "answer": [1]}, {"question": ["not", "messages"], "answer": 1}])
    with caplog.at_level("WARNING"):
        problems, report = load_problems(some)
    assert (report.rows, report.used, report.malformed) == (3, 1, 2)
    assert ("skipped 2 malformed rows of 3; the first: line 2 (keys 'question', 'answer'): 'answer' is list, "
            "not a string or a number") in caplog.text


def test_key_settings_are_checked_by_the_config():
    with pytest.raises(ConfigError, match="task.prompt_key applies to file sources only"):
        load_config(None, ["task.prompt_key=question"])
    with pytest.raises(ConfigError, match="task.answer_key must be a field name or a dotted path"):
        load_config(None, ["task.source=d.parquet", "task.answer_key=reward_model..ground_truth"])
    cfg = load_config(None, ["task.source=d.parquet", "task.answer_key=reward_model.ground_truth"])
    assert cfg.task.answer_key == "reward_model.ground_truth"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2.5 checkpoint: its template writes a default system turn when the messages have none."""
    return write_family_checkpoint("qwen2.5", tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_family_checkpoint("llama3.1", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_chat_message_prompts_are_the_chat_template_token_for_token(tmp_path, family, request):
    path = request.getfixturevalue(family)
    rows = [verl_row(0, "What is 2 + 3?", "5", system=True), verl_row(1, "What is 7 - 4?", "3")]
    f = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    problems, _ = load_problems(f)
    tok = AutoTokenizer.from_pretrained(path)

    def template(messages):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    encoded = encode_problems(problems, load_text_format(path), 512)
    assert [e.prompt_ids for e in encoded] == [template(r["prompt"]) for r in rows]
    # task.system_prompt goes before messages that have no system turn of their own, never over one
    text = load_text_format(path, TaskConfig(system_prompt="Be brief."))
    assert text.prompt_ids(problems[0].prompt) == template(rows[0]["prompt"])
    assert text.prompt_ids(problems[1].prompt) == template([{"role": "system", "content": "Be brief."},
                                                            *rows[1]["prompt"]])
    # a text prompt keeps its rule: the user turn of the problem and the boxed instruction
    assert text.prompt_ids("What is 1 + 1?") == template([{"role": "system", "content": "Be brief."}, {
        "role": "user", "content": f"What is 1 + 1?\n\n{BOXED_INSTRUCTION}"}])
    # messages were written for a template: a plain format refuses them by name
    with pytest.raises(ValueError, match="chat messages needs the chat format.*prompt_format=plain"):
        encode_problems(problems, load_text_format(path, TaskConfig(prompt_format="plain")), 512)


def run_args(tmp_path, policy, data, *extra: str) -> list[str]:
    """A run of seconds on the tiny checkpoint (tests/test_real_checkpoints.py's family run)."""
    return [f"model.path={policy}", f"task.source={data}", f"run_dir={tmp_path / 'run'}", "model.max_context=256",
            "task.eval_size=4", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=16",
            "rollout.max_batch=8", "grpo.steps=2", "grpo.micro_batch_size=4", "grpo.drop_equal_reward_groups=false",
            "eval.samples=1", "eval.at_start=false", "checkpoint.every=2", "speculation.policy=off",
            "draft.online=off", "threads=1", *extra]


def test_train_and_eval_on_a_verl_parquet(tmp_path, qwen, capsys):
    from fastgrpo.tasks.arithmetic import generate_problems

    arithmetic = generate_problems(24, seed=3, max_steps=3, max_value=10, max_operand=5)
    rows = [verl_row(i, p.prompt, p.answer, system=i % 2 == 0) for i, p in enumerate(arithmetic)]
    rows[5]["reward_model"] = {"style": "rule", "ground_truth": None}  # two rows a run skips and counts
    rows[9]["prompt"] = []
    data = tmp_path / "verl_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    config = tmp_path / "config.yaml"  # its own config: the repository's default is the demonstration task's
    config.write_text("seed: 0\n")

    assert main(["train", "--config", str(config), *run_args(tmp_path, qwen, data)]) == 0
    capsys.readouterr()
    client = MlflowClient(default_tracking_uri(tmp_path / "run"))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    metrics = run.data.metrics
    assert (metrics["data/rows"], metrics["data/rows_skipped"]) == (24, 2)
    # 22 usable rows: 4 held out as the test split, 9 of the 18 left for validation (at most half), 9 trained on
    assert (metrics["data/train_prompts"], metrics["data/eval_prompts"]) == (9, 4)
    assert metrics["data/train_prompts_too_long"] == metrics["data/eval_prompts_too_long"] == 0
    assert "loss" in metrics and "eval/mean_accuracy" in metrics

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    args = run_args(tmp_path, qwen, data)
    assert main(["eval", "--config", str(config), "--checkpoint", str(checkpoint), *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == 4 and out["split"] == "test" and 0 <= out["mean_accuracy"] <= 1
    # what it evaluated: the held-out rows' own messages, through the checkpoint's template
    task = load_task_data(load_config(str(config), args).task)
    held = {json.dumps(r["prompt"]) for r in rows}
    assert all(isinstance(p.prompt, list) and json.dumps(p.prompt) in held for p in task.held_out)
