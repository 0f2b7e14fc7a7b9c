"""The tiny-policy recipe and Hugging Face loading/saving.

Policies are plain `LlamaForCausalLM` checkpoints: whatever trains here loads in any HF tool, and
whatever HF loads can be trained here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel

from fastgrpo.paths import is_policy

# test: trains in seconds; bench: ~20M parameters, the size the benchmarks and `make train` use; gpu: ~308M
# parameters (24 layers of 1024), what `fastgrpo bench gpu-check` trains on one GPU in bf16.
SIZES: dict[str, dict[str, int]] = {
    "test": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
    "bench": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                  intermediate_size=1536),
    "gpu": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                intermediate_size=2816),
}


def policy_config(size: str, vocab_size: int, max_context: int, bos_id: int, eos_id: int, pad_id: int) -> LlamaConfig:
    if size not in SIZES:
        raise ValueError(f"unknown policy size {size!r}; choose one of {sorted(SIZES)}")
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_context,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_dropout=0.0,
        **SIZES[size],
    )


def new_policy(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def load_policy(path: str | Path) -> PreTrainedModel:
    path = Path(path)
    if not is_policy(path):
        raise FileNotFoundError(f"no Hugging Face policy at {path} (config.json missing); build one with `fastgrpo sft`")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    return model


def save_policy_tensors(directory: Path, tensors: dict[str, Tensor], config: PretrainedConfig, tied: bool) -> None:
    """A Hugging Face policy directory from full tensors (what a sharded trainer exports): a tied head
    is stored once, as the embedding, as Hugging Face itself stores it."""
    directory.mkdir(parents=True, exist_ok=True)
    if tied:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(directory / "model.safetensors"))
    config.save_pretrained(directory)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
