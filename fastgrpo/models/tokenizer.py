"""Tokenizers: the small byte-level BPE fastgrpo trains on the task's own text, and TextFormat, how any
checkpoint's tokenizer turns problems and responses into ids (chat template or plain).

In the BPE, digits are split one per token so that arithmetic stays learnable by a tiny model; byte-level
pre-tokenization makes decoding exact for any text (spaces and newlines included).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from fastgrpo.config import TaskConfig

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


# what a chat prompt's user turn asks after the problem: the reward reads the answer from \boxed{}
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_MARK = "FASTGRPO_RESPONSE_MARK"


def generation_stop_ids(model_dir: str | Path | None) -> list[int]:
    """generation_config.json's `eos_token_id` (an int or a list) of the checkpoint at `model_dir`, if any:
    instruct checkpoints list there the end-of-turn ids their tokenizer's eos does not name (Llama 3's
    `<|eot_id|>`)."""
    file = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if file is None or not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


@dataclass(frozen=True)
class TextFormat:
    """How a checkpoint's text becomes token ids and back, one rule for rollout, eval, SFT and draft
    training.

    - `chat`: the tokenizer's chat template with the generation prompt, an optional system turn, and
      a user turn holding the problem and BOXED_INSTRUCTION; a response ends with the template's
      end-of-turn token (the first token the template writes after an assistant turn's text: Llama 3's
      `<|eot_id|>`, Qwen's `<|im_end|>`).
    - `plain`: BOS when the tokenizer has one (Qwen's has none), the problem, a newline; a response
      ends with the tokenizer's eos.
    Generation stops at any of `stop_ids`: the tokenizer's eos, generation_config.json's eos ids and the
    response end. Nothing needs a pad token: padding is masked wherever it is used, so any id serves.
    """

    tokenizer: PreTrainedTokenizerBase
    chat: bool
    system_prompt: str
    stop_ids: tuple[int, ...]
    response_end_id: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None = None,
           prompt_format: str = "auto", system_prompt: str = "") -> TextFormat:
        """The format of `tokenizer` (and the checkpoint at `model_dir`, for its generation_config):
        `auto` is chat when the tokenizer has a chat template, else plain."""
        if prompt_format not in ("auto", "chat", "plain"):
            raise ValueError(f"task.prompt_format must be auto, chat or plain, got {prompt_format!r}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise ValueError(f"task.prompt_format=chat, but the tokenizer at {model_dir} has no chat template; "
                             f"use task.prompt_format=plain (or auto)")
        chat = prompt_format == "chat" or (prompt_format == "auto" and has_template)
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer at {model_dir} has no eos token: a response could not end")
        end = tokenizer.eos_token_id
        if chat:
            end = _turn_end(tokenizer)
        stops = tuple(dict.fromkeys([tokenizer.eos_token_id, *generation_stop_ids(model_dir), end]))
        return cls(tokenizer, chat, system_prompt, stops, end)

    def prompt_ids(self, problem: str | list[dict[str, str]]) -> list[int]:
        """A problem's prompt: text by the format's rule; chat messages (a dataset's own, e.g. veRL's) through
        the chat template as they are (`messages`; a plain format refuses them)."""
        if not self.chat and isinstance(problem, str):
            bos = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
            return bos + self.tokenizer.encode(problem + "\n", add_special_tokens=False)
        return list(self.tokenizer.apply_chat_template(self.messages(problem), add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def messages(self, problem: str | list[dict[str, str]]) -> list[dict[str, str]]:
        """The chat turns of a problem: task.system_prompt's turn (if set), then for a text problem a user turn
        of it and BOXED_INSTRUCTION; given messages are kept as they are (their system turn, if they have
        one, over task.system_prompt's). A plain format refuses messages: no template, or its end of turn
        not a stop (task.prompt_format=plain), so the response could not end where the template ends it."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if isinstance(problem, str):
            return system + [{"role": "user", "content": f"{problem}\n\n{BOXED_INSTRUCTION}"}]
        if not self.chat:
            raise ValueError("a prompt given as chat messages needs the chat format, but the text format is plain "
                             "(the tokenizer has no chat template, or task.prompt_format=plain)")
        own = any(m.get("role") == "system" for m in problem)
        return [dict(m) for m in ([] if own else system) + list(problem)]

    def response_ids(self, response: str) -> list[int]:
        """A response as the policy emits it: its text, then the end of the turn."""
        return self.tokenizer.encode(response, add_special_tokens=False) + [self.response_end_id]

    def response_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_text_format(path: str | Path, task: TaskConfig | None = None) -> TextFormat:
    """The tokenizer of the checkpoint at `path` in the TextFormat `task` asks for (`task.prompt_format`,
    `task.system_prompt`; default: auto, no system turn)."""
    task = task or TaskConfig()
    return TextFormat.of(load_tokenizer(path), path, task.prompt_format, task.system_prompt)


def _turn_end(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token the chat template writes right after an assistant turn's text."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": _MARK}],
                                         tokenize=False)
    after = text.split(_MARK, 1)[1] if _MARK in text else ""
    ids = tokenizer.encode(after, add_special_tokens=False)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
    if not ids or ids[0] not in special:
        raise ValueError(f"the chat template ends an assistant turn with {after[:40]!r}, not with a special token: "
                         f"fastgrpo cannot tell where a response ends (use task.prompt_format=plain)")
    return ids[0]
