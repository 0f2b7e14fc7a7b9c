"""A small byte-level BPE tokenizer trained on the task's own text.

Digits are split one per token so that arithmetic stays learnable by a tiny model; byte-level
pre-tokenization makes decoding exact for any text (spaces and newlines included).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"


MAX_VOCAB = 512  # what train_tokenizer asks of BPE (the tasks' small alphabets stop well short of it)


def train_tokenizer(texts: Iterable[str], vocab_size: int = MAX_VOCAB) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """The model sees BOS, the question, then a newline after which the answer begins."""
    return [tokenizer.bos_token_id] + tokenizer.encode(prompt + "\n", add_special_tokens=False)


def encode_response(tokenizer: PreTrainedTokenizerFast, response: str) -> list[int]:
    return tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]


def decode_response(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
