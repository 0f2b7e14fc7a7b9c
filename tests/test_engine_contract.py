"""The behaviour every rollout engine must have, whatever runs it: the log-probabilities of the
distribution it samples from, weight versions served whole, greedy and seeded determinism, the
target's states on request, and bad input refused before any work.

Each test runs once per engine: `embedded`; `sglang-emulated`, the SGLang adapter's own code over
the emulated SGLang of tests/sglang_emulation (its interface checked against sglang 0.5.23's source
by tests/test_sglang_conformance.py); and `sglang`, the adapter over a real SGLang wherever it and a
GPU are installed (skipped elsewhere, with the reason: `make test` on a CPU machine runs every case on
the first two). The reference is the Hugging Face policy itself.

What `sglang-emulated` emulates, each rule read in SGLang's source (tests/sglang_emulation/
_sglang_emulator/ cites the lines): the Engine / TokenizerManager calls and request objects the
adapter sends, the scheduler's continuous batching and radix-cache hits, the pytorch sampling backend
(top-k, top-p, seeds under deterministic inference, the sampling mask and its cap), the log-probabilities
and finish reasons it reports, stop ids, context validation, weight-update sessions and tensor IPC per
rank, memory release and resume, hidden-state capture, and EAGLE (the draft's files as SGLang loads
them, verify with adaptive slots routed by the padded batch, the speculation counters). What it does not:
CUDA kernels and their numerics (it runs the policy in float32 on the CPU), SGLang's processes and
tensor-parallel sharding, the real EAGLE draft forward (a stand-in proposes: acceptance is not
SGLang's), and speed. The `sglang` variant runs these same cases on a GPU.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from transformers import AutoConfig

from fastgrpo.engines import build_engine

from fastgrpo.protocols import BackendUnavailable
from fastgrpo.bridge import WeightBridge
from fastgrpo.models.sampling import sampling_logprobs
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.types import Request, SamplingParams
from tests.conftest import tiny_config
from tests.sglang_emulated import emulated_sglang

ENGINES = ["embedded", "sglang-emulated", "sglang"]


@pytest.fixture(scope="module")
def reference(tiny_policy):
    return load_policy(tiny_policy).eval()


@pytest.fixture(params=ENGINES)
def make_engine(request, tmp_path, tiny_policy, tiny_draft, reference):
    """Builds the parametrised backend's engine through the one factory, holding the tiny policy."""
    engines = []
    backend = request.param.removesuffix("-emulated")
    with ExitStack() as stack:
        if request.param == "sglang-emulated":
            stack.enter_context(emulated_sglang())

        def make(speculation: str = "off", **overrides):
            cfg = tiny_config(tmp_path, tiny_policy, **{"engine.backend": backend, "speculation.policy": speculation,
                                                        "draft.path": tiny_draft, "draft.online": "off",
                                                        "speculation.depth": 3, "speculation.topk": 2,
                                                        "speculation.num_verify": 4} | overrides)
            try:
                engine = build_engine(cfg, AutoConfig.from_pretrained(tiny_policy), load_text_format(tiny_policy),
                                      weights=reference.state_dict().items())
            except BackendUnavailable as e:  # the real SGLang only: the same case ran on sglang-emulated
                pytest.skip(f"{e} (the same case ran on the emulated SGLang: sglang-emulated)")
            engines.append(engine)
            return engine

        yield make
        for engine in engines:
            if hasattr(engine, "close"):
                engine.close()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(5, 40, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def scored(model, prompt: list[int], tokens: list[int], sampling: SamplingParams,
           sets: list[list[int]] | None = None) -> torch.Tensor:
    """The reference: the policy's log-probability of each sampled token under `sampling`, in the
    sets the engine sampled from when it returns them (as the trainer scores)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1]
    sampled = torch.tensor(tokens)
    padded = None
    if sets is not None:
        padded = torch.full((len(sets), max(map(len, sets))), -1)
        for i, s in enumerate(sets):
            padded[i, : len(s)] = torch.tensor(s)
    return sampling_logprobs(logits, sampling, sampled, padded).gather(-1, sampled[:, None])[:, 0]


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 1.0, 5), (0.7, 0.9, 5)])
def test_logprobs_are_those_of_the_sampling_distribution(make_engine, reference, temperature, top_p, top_k):
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12)
    engine = make_engine(**{"rollout.top_k": top_k, "rollout.top_p": top_p})  # SGLang sizes its sampling mask at start
    ps = prompts(4)
    out = engine.generate([Request(p) for p in ps], sampling, seed=11)
    for p, c in zip(ps, out):
        assert len(c.logprobs) == len(c.token_ids) >= 1
        assert (c.sample_sets is not None) == (top_k > 0 or top_p < 1)  # each token's set when they cut
        ref = scored(reference, p, c.token_ids, sampling, c.sample_sets)
        assert torch.isfinite(ref).all()  # no token outside the top-k / top-p set
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_a_speculating_engine_reports_the_same_distribution_and_its_draft_version(make_engine, reference, tiny_draft):
    from safetensors.torch import load_file

    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    engine = make_engine("static")
    draft = load_file(str(tiny_draft / "draft.safetensors"))
    engine.update_draft(draft.items(), version=7)
    ps = prompts(3, seed=1)
    out = engine.generate([Request(p) for p in ps], sampling, seed=2)
    assert engine.stats()["draft_version"] == 7 and engine.stats()["spec_steps"] > 0
    for p, c in zip(ps, out):
        torch.testing.assert_close(torch.tensor(c.logprobs), scored(reference, p, c.token_ids, sampling),
                                   atol=1e-4, rtol=0)


def test_greedy_is_deterministic_and_follows_the_policy(make_engine, reference):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    engine = make_engine()
    ps = prompts(3, seed=2)
    first = engine.generate([Request(p) for p in ps], greedy)
    again = engine.generate([Request(p) for p in reversed(ps)], greedy)[::-1]  # another order, same answers
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    for p, c in zip(ps, first):
        hf = reference.generate(torch.tensor([p]), max_new_tokens=len(c.token_ids), do_sample=False,
                                eos_token_id=2, pad_token_id=0)
        assert hf[0, len(p):].tolist() == c.token_ids


def test_a_seed_repeats_a_sample_and_another_seed_does_not(make_engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    engine = make_engine()
    requests = [Request(p) for p in prompts(4, seed=3)]
    a, b, c = (engine.generate(requests, sampling, seed=s) for s in (5, 5, 6))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert all(len(x.token_ids) == 16 and x.finish_reason == "length" for x in a)


def test_a_weight_version_is_served_whole_after_its_commit(make_engine, reference):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine = make_engine()
    requests = [Request(p) for p in prompts(2, seed=4)]
    assert engine.stats()["weights_version"] == 0
    before = engine.generate(requests, greedy)
    moved = [(name, t + 0.05 * torch.randn_like(t)) for name, t in reference.state_dict().items()]
    engine.update_weights(moved[:3], version=1, complete=False)
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate(requests, greedy)
    engine.release_memory()  # as around a colocated training step
    engine.resume_memory()
    WeightBridge([engine], bucket_bytes=1 << 15).push(iter(moved), version=2)
    assert engine.stats()["weights_version"] == 2
    after = engine.generate(requests, greedy)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]


def test_the_target_states_come_back_on_request(make_engine, reference):
    engine = make_engine()
    ps = prompts(2, seed=5)
    out = engine.generate([Request(p) for p in ps], SamplingParams(temperature=1.0, max_new_tokens=6), seed=1,
                          capture=True)
    for p, c in zip(ps, out):
        full = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            states = reference(full, output_hidden_states=True).hidden_states[-1][0, :-1]  # after the final norm
        assert c.hidden is not None and c.hidden.shape == states.shape
        torch.testing.assert_close(c.hidden, states, atol=1e-4, rtol=1e-4)
    assert all(c.hidden is None for c in engine.generate([Request(ps[0])], SamplingParams(max_new_tokens=3)))


def test_every_member_of_a_group_gets_its_states(make_engine, reference):
    """GRPO samples each prompt several times: members after the first share its prompt (SGLang's
    radix cache, the embedded engine's shared prefill), and each still gets every state."""
    engine = make_engine()
    ps = prompts(2, seed=6)
    requests = [Request(p, key=k) for p in ps for k in range(3)]
    out = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=5), seed=3, capture=True)
    for r, c in zip(requests, out):
        with torch.no_grad():
            states = reference(torch.tensor([r.prompt_ids + c.token_ids]), output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(c.hidden, states[0, :-1], atol=1e-4, rtol=1e-4)


def test_bad_requests_are_refused_before_any_work(make_engine):
    engine = make_engine()
    vocab = engine.cfg.vocab_size
    for bad, match in [([], "empty prompt"), ([1, vocab], "vocabulary"), ([1, -1], "vocabulary"),
                       ([1] * 200, "no room")]:
        with pytest.raises(ValueError, match=match):
            engine.generate([Request([1, 5, 6]), Request(bad)], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([Request([1, 5], max_new_tokens=0)], SamplingParams())
    out = engine.generate([Request([1, 5, 6], max_new_tokens=4)], SamplingParams(ignore_eos=True))
    assert len(out[0].token_ids) == 4 and out[0].finish_reason == "length"  # still serving
