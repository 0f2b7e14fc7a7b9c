"""The SGLang adapter's own logic, which runs without SGLang: reading SGLang 0.5.23's outputs into
completions, the speculation tiers and engine arguments it derives from a config, and the sampling
settings it refuses. (The adapter against a live SGLang is the engine contract suite, skipped here.)"""

from __future__ import annotations

import pytest

from fastgrpo.backends.sglang_engine import adaptive_tiers, check_sampling, completion, server_args
from fastgrpo.config import load_config
from fastgrpo.speculation.policy import FastGRPOFormula
from fastgrpo.types import SamplingParams


def output(tokens, reason="length", masked=None, hidden=None, verify=0):
    """An `Engine.generate` result in the shape of sglang 0.5.23 (tokenizer_manager.py)."""
    meta = {"finish_reason": {"type": reason}, "output_token_logprobs": [(-0.5 - i, t, None) for i, t in enumerate(tokens)],
            "completion_tokens": len(tokens)}
    if masked is not None:
        meta["output_token_sampling_logprobs"] = masked
    if hidden is not None:
        meta["hidden_states"] = hidden
    if verify:
        meta["spec_verify_ct"] = verify
    return {"output_ids": tokens, "meta_info": meta}


def test_sglang_outputs_become_completions():
    c = completion(output([7, 8, 2], "stop", verify=2), prompt_len=3, max_new_tokens=10, max_context=64,
                   masked=False, capture=False)
    assert c.token_ids == [7, 8, 2] and c.logprobs == [-0.5, -1.5, -2.5] and c.finish_reason == "stop"
    assert c.spec == {"spec_steps": 2, "spec_emitted": 3} and c.hidden is None
    # with top-k / top-p the renormalised log-probabilities, not the temperature-only ones
    c = completion(output([7, 8], masked=[-0.1, -0.2]), 3, 2, 64, masked=True, capture=False)
    assert c.logprobs == [-0.1, -0.2] and c.finish_reason == "length"
    # a length stop short of max_new_tokens at the context's end is a context stop
    assert completion(output([7, 8]), 62, 10, 64, masked=False, capture=False).finish_reason == "context"
    # the prompt's states arrive as one chunk, then one row per accepted token; the last token's is never computed
    prompt_rows = [[float(i)] * 4 for i in range(3)]
    c = completion(output([7, 8, 9], hidden=[prompt_rows, [3.0] * 4, [4.0] * 4]), 3, 3, 64, masked=False,
                   capture=True)
    assert c.hidden.shape == (5, 4) and c.hidden[:, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="hidden states"):
        completion(output([7, 8, 9], hidden=[prompt_rows]), 3, 3, 64, masked=False, capture=True)
    with pytest.raises(RuntimeError, match="abort"):
        completion(output([7], "abort"), 3, 3, 64, masked=False, capture=False)
    bad = output([7, 8])
    bad["meta_info"]["output_token_logprobs"][1] = (-1.0, 9, None)
    with pytest.raises(RuntimeError, match="other tokens"):
        completion(bad, 3, 3, 64, masked=False, capture=False)


def test_the_fastgrpo_rule_becomes_sglang_batch_size_tiers():
    policy, max_batch = FastGRPOFormula(), 128
    tiers = adaptive_tiers(policy, max_batch)
    starts = sorted(int(k) for k in tiers)
    assert starts[0] == 1 and all(len(t["candidate_steps"]) == 1 for t in tiers.values())
    for running in range(1, max_batch + 1):  # SGLang's slot for a batch: the largest key not above it
        slot = tiers[str(max(s for s in starts if s <= running))]
        config = policy.choose(running)
        assert slot["candidate_steps"] == [0 if config is None else config.depth], running
    assert tiers[str(starts[-1])]["candidate_steps"] == [0]  # saturated: no speculation


def test_engine_arguments_follow_the_config():
    cfg = load_config(None, ["engine.backend=sglang", "trainer.backend=megatron", "parallel.tensor=4",
                             "parallel.pipeline=2", "engine.tensor=2", "engine.mem_fraction=0.4", "speculation.depth=5", "speculation.topk=2",
                             "speculation.num_verify=8", "speculation.policy=static", "draft.online=sync"])
    off = server_args(cfg, "off", None, None, base_gpu_id=2)
    assert off["tp_size"] == 2 and off["base_gpu_id"] == 2  # engine.tensor, whatever the trainer's layout and off["mem_fraction_static"] == 0.4
    assert off["enable_return_hidden_states"] and off["skip_tokenizer_init"] and "speculative_algorithm" not in off
    static = server_args(cfg, "static", "draft-dir", None, 0)
    assert (static["speculative_algorithm"], static["speculative_num_steps"], static["speculative_eagle_topk"],
            static["speculative_num_draft_tokens"]) == ("EAGLE", 5, 2, 8)
    adaptive = server_args(cfg, "fastgrpo", "draft-dir", "tiers.json", 0)
    assert adaptive["speculative_adaptive"] and adaptive["speculative_eagle_topk"] == 1
    assert adaptive["speculative_adaptive_config"] == "tiers.json"


def test_sampling_sglang_cannot_report_is_refused_by_its_key():
    assert check_sampling(SamplingParams(temperature=0.7), speculating=True, mask_max_tokens=64) is False
    assert check_sampling(SamplingParams(temperature=0.0, top_p=0.5), speculating=True, mask_max_tokens=64) is False
    assert check_sampling(SamplingParams(top_k=5, top_p=0.9), speculating=False, mask_max_tokens=64) is True
    with pytest.raises(ValueError, match="rollout.top_k / rollout.top_p: with speculation"):
        check_sampling(SamplingParams(top_k=5), speculating=True, mask_max_tokens=64)
    with pytest.raises(ValueError, match="rollout.top_p < 1 needs a finite rollout.top_k"):
        check_sampling(SamplingParams(top_p=0.9), speculating=False, mask_max_tokens=64)
    with pytest.raises(ValueError, match="rollout.top_k 100"):
        check_sampling(SamplingParams(top_k=100), speculating=False, mask_max_tokens=64)
