"""SGLang's routed-experts capture (`enable_return_routed_experts`; state_capturer/routed_experts.py and
state_capturer/base.py in the wheel, under sglang/srt/) in the emulated scheduler, keyed as SGLang keys
it: by KV slot.

- The record is a host buffer of int32 rows [num_hidden_layers, num_experts_per_tok], one per KV slot,
  zeroed when it is made (RoutedExpertsCapturer.__init__, routed_experts.py:72-93; BaseHostCache,
  base.py:63-75). SGLang builds it at start from the text config's `num_experts_per_tok`, which a dense
  model lacks.
- Each target forward writes the rows of the slots it computed (its out_cache_loc: a prompt's uncached
  part, a decode step's fed token; base.py:190-221, finalize 117-118): every row whole, each sparse
  layer's column its top-k ids (capture_routed_experts_if_allowed, layers/moe/topk.py:2529-2574, before
  any expert-parallel remap), a dense layer's column 0 (nothing captures it; the device buffer starts
  zeroed, base.py:38-42). The draft never writes (routed_experts.py:177-190).
- A finished request reads the rows of its slots for positions 0..seqlen-2, seqlen = prompt + output
  through the stop (`get_topk`: scheduler_components/batch_result_processor.py:136-161, base.py:173-188):
  a radix-cache hit's positions read the rows the forward that computed their KV wrote.
- The tensor leaves as base64 of its bytes (`encode`: detokenizer_manager.py:432-448, and
  tokenizer_manager.py:2602-2609 on the skip_tokenizer_init path), under meta_info["routed_experts"]; a
  request that asks while the server flag is off gets no key (no capturer: batch_result_processor.py:
  151-153).

Under EAGLE the emulation raises (SGLang records tree drafts' accepted tokens wrongly, and its buffer is
not sized for verify steps: the adapter's ROUTING_SPECULATION)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .common import EmulationError


def encode(rows: torch.Tensor) -> str:
    """DetokenizerManager._b64_encode_per_request for one request: `pybase64.b64encode(item.numpy()
    .tobytes()).decode("utf-8")` (pybase64 writes what the standard library's base64 writes)."""
    return base64.b64encode(rows.numpy().tobytes()).decode("utf-8")


class RoutedExperts:
    """The scheduler's RoutedExpertsCapturer: `capture()` around a target forward collects each sparse
    layer's top-k, `write` stores a forward's rows at its slots, `get_topk` reads a finished request's.
    `routers`: each sparse layer's router by layer id (`for_model`)."""

    def __init__(self, routers: dict[int, torch.nn.Module], layers: int, top_k: int):
        self.routers, self.layers, self.top_k = routers, layers, top_k
        self.host: dict[int, torch.Tensor] = {}  # KV slot -> its row; a slot never written reads zeros

    @classmethod
    def for_model(cls, model: torch.nn.Module, config: dict) -> RoutedExperts:
        """The capturer SGLang builds at start for `model` of config.json `config`: a column per hidden
        layer, the top-k its config routes to."""
        if not config.get("num_experts_per_tok"):
            raise EmulationError("enable_return_routed_experts on a model without num_experts_per_tok: SGLang reads it "
                                 "at start (state_capturer/routed_experts.py:72) and fails")
        # the decoder layers whose MLP routes (Hugging Face's sparse block has a `gate` router)
        routers = {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
        return cls(routers, config["num_hidden_layers"], config["num_experts_per_tok"])

    @contextmanager
    def capture(self) -> Iterator[dict[int, torch.Tensor]]:
        """Each sparse layer's top-k ids [tokens, k] (int32) for the one forward inside, by layer id."""
        seen: dict[int, torch.Tensor] = {}

        def hook(layer: int):
            return lambda module, inputs, output: seen.__setitem__(layer, output[2].detach().to(torch.int32))

        handles = [router.register_forward_hook(hook(i)) for i, router in self.routers.items()]
        try:
            yield seen
        finally:
            for h in handles:
                h.remove()

    def write(self, slots: list[int], seen: dict[int, torch.Tensor], first: int) -> None:
        """The rows of `slots`, the forward's token positions `first`, `first + 1`, ... (a forward of the
        whole prompt after a cache hit writes only the positions SGLang computes: from `first`)."""
        for i, slot in enumerate(slots):
            row = torch.zeros(self.layers, self.top_k, dtype=torch.int32)
            for layer, ids in seen.items():
                row[layer] = ids[first + i]
            self.host[slot] = row

    def get_topk(self, slots: list[int], seqlen: int) -> torch.Tensor:
        """BaseTopkCapturer.get_topk with start_len 0: the rows of the slots of positions 0..seqlen-2."""
        zero = torch.zeros(self.layers, self.top_k, dtype=torch.int32)
        rows = [self.host.get(s, zero) for s in slots[: seqlen - 1]]
        return torch.stack(rows) if rows else zero[:0]
