"""Tiny random-weight Hugging Face checkpoints of the families fastgrpo serves, as a user's directory
holds them: config.json from transformers' own config classes, model.safetensors, a tokenizer carrying
the family's special tokens and chat template, and generation_config.json with the family's stop ids.

- llama3.1: Llama 3.1 Instruct's shape: llama3 rope scaling, untied head, BOS `<|begin_of_text|>`, no pad
  token; the tokenizer's eos is `<|end_of_text|>` while turns end with `<|eot_id|>`, which only
  generation_config.json lists (as Meta-Llama-3-8B-Instruct shipped).
- qwen2.5: QKV biases, tied head, no BOS; eos `<|im_end|>`, pad `<|endoftext|>`; the template's default
  system prompt.
- qwen3: q/k norms, head_dim other than hidden / heads, no BOS; eos `<|im_end|>`.
- qwen3_moe: Qwen3's attention and tokens, three layers of which the first and last are sparse (8
  experts of width 32, top-2, weights renormalised: Qwen3-30B-A3B's routing) and the middle one dense
  (`mlp_only_layers`); router weights drawn large, so that no token's 2nd and 3rd experts are near a
  tie that float rounding could flip between the engine's and the trainer's forwards. Not in
  FAMILY_NAMES (the dense families every trainer runs): `MOE_FAMILY`.

The chat templates are the families' own templates' no-tools paths (what a GRPO prompt renders through),
written out here: the token-for-token test compares fastgrpo's prompts with `apply_chat_template` on
these. The vocabulary is a byte-level BPE trained on the arithmetic task's text, so the tiny models
can learn the task; every norm weight and bias is drawn away from 1 / 0 so a part left out shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, PretrainedConfig,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content }}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# special tokens (in vocabulary order), bos, eos, pad, generation_config's eos ids (as tokens), template
TOKENS = {
    "llama3.1": dict(special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                              "<|eom_id|>", "<|eot_id|>"],
                     bos="<|begin_of_text|>", eos="<|end_of_text|>", pad=None,
                     stops=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], template=LLAMA3_TEMPLATE),
    "qwen2.5": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                    stops=["<|im_end|>", "<|endoftext|>"], template=QWEN25_TEMPLATE),
    "qwen3": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                  bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                  stops=["<|im_end|>", "<|endoftext|>"], template=QWEN3_TEMPLATE),
}
TOKENS["qwen3_moe"] = TOKENS["qwen3"]  # Qwen3-MoE ships Qwen3's tokenizer and template
FAMILY_NAMES = ("llama3.1", "qwen2.5", "qwen3")  # the dense families
MOE_FAMILY = "qwen3_moe"
MOE_EXPERTS, MOE_TOP_K = 8, 2


def _corpus() -> list[str]:
    from fastgrpo.tasks.arithmetic import generate_problems  # the task's own text: what the policy will see

    return [p.prompt + "\n" + p.solution for p in generate_problems(400, seed=0, max_steps=4, max_value=10, max_operand=5)]


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The family's tokenizer: a byte-level BPE of 320 tokens trained on the arithmetic task's text, with the
    family's special tokens, bos / eos / pad and chat template."""
    spec = TOKENS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus() + ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                                         "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"],
                            trainers.BpeTrainer(vocab_size=320, special_tokens=spec["special"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"],
                                        pad_token=spec["pad"])
    tokenizer.chat_template = spec["template"]
    return tokenizer


def family_config(family: str, vocab_size: int, bos_id: int | None, eos_id: int, pad_id: int | None) -> PretrainedConfig:
    """The family's own transformers config class at a tiny size (hidden 64, 2 layers; the MoE 3), with the
    family's structure: rope scaling, biases, q/k norms, head size, tied or untied head, experts."""
    sizes = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                 bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, initializer_range=0.1)
    if family == "llama3.1":
        return LlamaConfig(**sizes, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))  # small: most of a 16-wide head's frequencies are scaled
    if family == "qwen2.5":
        return Qwen2Config(**sizes, tie_word_embeddings=True,
                           rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    if family == "qwen3":
        return Qwen3Config(**sizes, head_dim=32, tie_word_embeddings=False,
                           rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**(sizes | dict(num_hidden_layers=3)), head_dim=32, tie_word_embeddings=False,
                              moe_intermediate_size=32, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                              norm_topk_prob=True, mlp_only_layers=[1],
                              rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    raise KeyError(f"no tiny checkpoint for family {family!r}; have {tuple(TOKENS)}")


def write_family_checkpoint(family: str, directory: str | Path, seed: int = 0, **changes) -> Path:
    """A tiny random-weight checkpoint of `family` in `directory` (created), as a hub download holds one;
    `changes`: config values over the family's (`mlp_only_layers=[]`: a MoE sparse in every layer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec = TOKENS[family]
    tokenizer = family_tokenizer(family)
    ids = tokenizer.convert_tokens_to_ids
    cfg = family_config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                        tokenizer.pad_token_id)
    for key, value in changes.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a router: well separated expert choices
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    stops = [ids(t) for t in spec["stops"]]
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stops,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(directory)
    return directory


def write_task(path: str | Path, n: int = 64, seed: int = 1) -> Path:
    """A JSONL task of `n` arithmetic problems (`prompt`, `answer`), as a user brings one."""
    from fastgrpo.tasks.arithmetic import generate_problems

    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n"
                            for p in generate_problems(n, seed=seed, max_steps=4, max_value=10, max_operand=5)))
    return path
