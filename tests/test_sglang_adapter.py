"""The SGLang adapter: its own logic (reading SGLang 0.5.23's outputs into completions, the tiers,
engine arguments and draft export it derives from a config, the settings it refuses), then each
defect the adapter had against SGLang's real behaviour, shown on the emulated SGLang
(tests/sglang_emulation, whose interface tests/test_sglang_conformance.py checks against the
source): each of those tests fails on the adapter before its fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig

from fastgrpo.engines import build_engine
from fastgrpo.engines.sglang.adapter import adaptive_tiers, engine_dtype, server_args
from fastgrpo.engines.sglang.requests import (SGLANG_MASK_CAP, TIE_HEADROOM, check_sampling, completion,
                                              eagle_reservation, fill_prefixes, sampling_mask_cap)
from fastgrpo.bridge import WeightBridge
from fastgrpo.config import load_config
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.models.draft import sglang_eagle_config
from fastgrpo.speculation.policy import FastGRPOFormula
from fastgrpo.types import Request, SamplingParams
from tests.conftest import tiny_config
from tests.sglang_emulated import emulated_sglang, scheduler


def output(tokens, reason="length", masked=None, sets=None, verify=0):
    """A generate output in the shape of sglang 0.5.23 (tokenizer_manager.py)."""
    meta = {"finish_reason": {"type": reason}, "output_token_logprobs": [(-0.5 - i, t, None) for i, t in enumerate(tokens)],
            "completion_tokens": len(tokens)}
    if masked is not None:
        meta["output_token_sampling_logprobs"] = masked
        meta["output_token_sampling_mask"] = sets
    if verify:
        meta["spec_verify_ct"] = verify
    return {"output_ids": tokens, "meta_info": meta}


def test_sglang_outputs_become_completions():
    c = completion(output([7, 8, 2], "stop", verify=2), prompt_len=3, requested=10, limit=10, masked=False)
    assert c.token_ids == [7, 8, 2] and c.logprobs == [-0.5, -1.5, -2.5] and c.finish_reason == "stop"
    assert c.spec == {"spec_steps": 2, "spec_emitted": 3} and c.hidden is None and c.sample_sets is None
    # with top-k / top-p: the renormalised log-probabilities and each token's sampling set
    c = completion(output([7, 8], masked=[-0.1, -0.2], sets=[[7, 3], [9, 8]]), 3, 2, 2, masked=True)
    assert c.logprobs == [-0.1, -0.2] and c.sample_sets == [[7, 3], [9, 8]] and c.finish_reason == "length"
    with pytest.raises(RuntimeError, match="sampling sets"):
        completion(output([7, 8], masked=[-0.1, -0.2], sets=[[7, 3], [9, 1]]), 3, 2, 2, masked=True)
    # a length stop at a max_new_tokens clamped to the context is a context stop
    assert completion(output([7, 8]), 62, requested=10, limit=2, masked=False).finish_reason == "context"
    assert completion(output([7, 8]), 62, requested=2, limit=2, masked=False).finish_reason == "length"
    with pytest.raises(RuntimeError, match="abort"):
        completion(output([7], "abort"), 3, 3, 3, masked=False)
    bad = output([7, 8])
    bad["meta_info"]["output_token_logprobs"][1] = (-1.0, 9, None)
    with pytest.raises(RuntimeError, match="other tokens"):
        completion(bad, 3, 3, 3, masked=False)


def test_states_a_cache_hit_skipped_come_from_the_request_that_computed_them():
    states = torch.arange(8.0)[:, None].expand(8, 2)  # the state at position p is [p, p]
    a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], [1, 2, 7]
    full = fill_prefixes([a, b, c], [(0, states[:4]), (3, states[3:5]), (2, states[2:2])])
    assert [f[:, 0].tolist() for f in full] == [[0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1]]
    with pytest.raises(RuntimeError, match="positions 0..1"):
        fill_prefixes([a, c], [(2, states[2:4]), (2, states[2:2])])  # nobody computed positions 0, 1


def sglang_routes(tiers: dict[str, dict], batch: int, sizes: list[int]) -> tuple[int, list[int]]:
    """(padded size, candidates) of the slot SGLang 0.5.23 runs a decode batch of `batch` rows at: padded
    to a captured CUDA-graph size, then the largest slot key not above it
    (srt/speculative/adaptive_spec_params.py:342-358)."""
    padded = next((s for s in sizes if s >= batch), batch)
    keys = sorted(int(k) for k in tiers)
    key = max([k for k in keys if k <= padded] or [keys[0]])
    return padded, tiers[str(key)]["candidate_steps"]


def test_the_fastgrpo_rule_becomes_sglang_batch_size_tiers():
    """One slot per run of equal depths over the captured sizes, each holding the policy's choice at the
    size SGLang pads the batch to (which is what the step computes). Keyed by raw concurrency instead,
    a slot would hold the policy's answer at a size SGLang never routes (it pads 81-88 to 88), and a
    reading without the padding would promise a depth SGLang does not run (4 at 13 rows, where it runs
    3): the check reads each slot at the padded size."""
    from fastgrpo.speculation.sglang_tiers import spec_capture_sizes

    policy, max_batch = FastGRPOFormula(), 128
    sizes = spec_capture_sizes(max_batch)
    tiers = adaptive_tiers(policy, max_batch)
    assert all(len(t["candidate_steps"]) == 1 for t in tiers.values())
    assert set(map(int, tiers)) <= set(sizes) and min(map(int, tiers)) == 1  # keys SGLang routes to
    for running in range(1, max_batch + 1):
        padded, steps = sglang_routes(tiers, running, sizes)
        config = policy.choose(padded)
        assert steps == [0 if config is None else config.depth], running
    assert sglang_routes(tiers, 13, sizes) == (14, [3])  # the policy's 4 at 13 rows cannot run: SGLang pads to 14
    assert tiers[max(tiers, key=int)]["candidate_steps"] == [0]  # saturated: no speculation


def test_engine_arguments_follow_the_config():
    cfg = load_config(None, ["engine.backend=sglang", "trainer.backend=megatron", "parallel.tensor=4",
                             "parallel.pipeline=2", "engine.tensor=2", "engine.mem_fraction=0.4", "speculation.depth=5",
                             "speculation.topk=2", "speculation.num_verify=8", "speculation.policy=static",
                             "draft.online=sync", "rollout.top_k=0"])
    off = server_args(cfg, "off", None, None, base_gpu_id=2, dtype="float16")
    assert off["tp_size"] == 2 and off["base_gpu_id"] == 2 and off["mem_fraction_static"] == 0.4
    assert off["enable_return_hidden_states"] and off["skip_tokenizer_init"] and "speculative_algorithm" not in off
    assert off["dtype"] == "float16" and off["enable_deterministic_inference"]  # seeds are ignored without it
    assert engine_dtype(cfg) == "bfloat16"  # the trainer's precision (auto: bf16 on GPUs)
    assert engine_dtype(load_config(None, ["engine.backend=sglang", "trainer.precision=fp32"])) == "float32"
    assert off["chunked_prefill_size"] == -1  # the draft learns online: whole prompts, every state returned
    assert "sampling_mask_max_tokens" not in off  # no top-k: SGLang's default
    static = server_args(cfg, "static", "draft-dir", None, 0)
    assert (static["speculative_algorithm"], static["speculative_num_steps"], static["speculative_eagle_topk"],
            static["speculative_num_draft_tokens"]) == ("EAGLE", 5, 2, 8)
    assert eagle_reservation(static, None) == 10  # top-k x steps
    adaptive = server_args(cfg, "fastgrpo", "draft-dir", "tiers.json", 0)
    assert adaptive["speculative_adaptive"] and adaptive["speculative_eagle_topk"] == 1
    assert adaptive["speculative_adaptive_config"] == "tiers.json"
    assert eagle_reservation(adaptive, {"1": {"candidate_steps": [4]}, "8": {"candidate_steps": [0]}}) == 5
    assert eagle_reservation(adaptive, None) == 8  # SGLang's default tiers: at most 7 steps
    masked = load_config(None, ["engine.backend=sglang", "rollout.top_k=20", "draft.online=off"])
    args = server_args(masked, "off", None, None, 0)
    assert args["sampling_mask_max_tokens"] == sampling_mask_cap(20) == 20 + TIE_HEADROOM
    assert "chunked_prefill_size" not in args


def test_sampling_sglang_cannot_report_is_refused_by_its_key():
    assert check_sampling(SamplingParams(temperature=0.7), speculating=True, mask_max_tokens=64) is False
    assert check_sampling(SamplingParams(temperature=0.0, top_p=0.5), speculating=True, mask_max_tokens=64) is False
    assert check_sampling(SamplingParams(top_k=5, top_p=0.9), speculating=False, mask_max_tokens=69) is True
    with pytest.raises(ValueError, match="rollout.top_k / rollout.top_p: with speculation"):
        check_sampling(SamplingParams(top_k=5), speculating=True, mask_max_tokens=SGLANG_MASK_CAP)
    with pytest.raises(ValueError, match="rollout.top_p < 1 needs a finite rollout.top_k"):
        check_sampling(SamplingParams(top_p=0.9), speculating=False, mask_max_tokens=SGLANG_MASK_CAP)
    with pytest.raises(ValueError, match="rollout.top_k 6"):  # no headroom left for ties
        check_sampling(SamplingParams(top_k=6), speculating=False, mask_max_tokens=69)
    with pytest.raises(ValueError, match="rollout.top_k 1"):
        check_sampling(SamplingParams(top_k=1), speculating=False, mask_max_tokens=69)


def test_the_eagle_draft_config_is_what_sglang_can_load(tiny_policy):
    target = AutoConfig.from_pretrained(tiny_policy)
    assert target.tie_word_embeddings  # the test policy ties its head to its embedding, as Llama 3.2 1B does
    cfg = sglang_eagle_config(target, "bfloat16")
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "bfloat16" and "torch_dtype" not in cfg
    assert cfg["rope_parameters"] == target.to_dict()["rope_parameters"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1


# -- on the emulated SGLang --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_policy):
    return load_policy(tiny_policy).eval()


@pytest.fixture
def sglang(tiny_policy, tiny_draft, reference, tmp_path):
    """make(policy=..., **overrides): an SGLang adapter over the emulated SGLang, built by the factory."""
    engines = []
    with emulated_sglang() as emulator:
        def make(policy=tiny_policy, **overrides):
            sections = {"engine.backend": "sglang", "speculation.policy": "off", "draft.path": tiny_draft,
                        "draft.online": "off", "speculation.depth": 3, "speculation.topk": 2,
                        "speculation.num_verify": 4} | overrides
            cfg = tiny_config(tmp_path, policy, **{k: str(v) for k, v in sections.items()})
            engine = build_engine(cfg, AutoConfig.from_pretrained(policy), load_text_format(policy),
                                  weights=reference.state_dict().items())
            engines.append(engine)
            return engine
        make.emulator = emulator
        yield make
        for engine in engines:
            engine.close()


def states(model, prompt, tokens):
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens]), output_hidden_states=True).hidden_states[-1][0, :-1]


def test_generate_sends_a_request_object_with_the_sampling_mask(sglang, reference):
    """Engine.generate has no return_sampling_mask (passing it is a TypeError for every call); the
    request object carries it, and the mask's kept ids become each token's sampling set."""
    engine = sglang(**{"rollout.top_k": 5})
    with pytest.raises(TypeError, match="return_sampling_mask"):
        engine._engine.generate(input_ids=[[1, 5, 6]], return_logprob=True, return_sampling_mask=True)
    assert engine.generate([], SamplingParams()) == []  # SGLang refuses an empty batch
    sampling = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=8)
    prompts = [[1, 9, 10, 11], [1, 12, 13]]
    out = engine.generate([Request(p) for p in prompts], sampling, seed=4)
    for p, c in zip(prompts, out):
        assert c.sample_sets is not None and len(c.sample_sets) == len(c.token_ids)
        assert all(t in s and 1 <= len(s) <= 5 for t, s in zip(c.token_ids, c.sample_sets))
        with torch.no_grad():
            logits = reference(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1] / sampling.temperature
        for t, (token, kept) in enumerate(zip(c.token_ids, c.sample_sets)):  # renormalised over the set
            want = logits[t, token] - torch.logsumexp(logits[t, kept], -1)
            assert abs(c.logprobs[t] - float(want)) < 1e-4


def test_a_seed_repeats_only_with_deterministic_inference(sglang):
    """SGLang ignores sampling_seed unless started with enable_deterministic_inference."""
    engine = sglang()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    requests = [Request([1, 20, 21, 22], key=k) for k in (3, 4)]
    a, b = (engine.generate(requests, sampling, seed=9) for _ in range(2))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert scheduler(engine).args.enable_deterministic_inference
    scheduler(engine).args.enable_deterministic_inference = False  # an engine started without it: seeds ignored
    a, b = (engine.generate(requests, sampling, seed=9) for _ in range(2))
    assert [c.token_ids for c in a] != [c.token_ids for c in b]


def test_a_top_k_beyond_the_engines_mask_cap_is_refused_before_sglang_aborts(sglang):
    engine = sglang(**{"rollout.top_k": 5})
    assert scheduler(engine).mask_cap == sampling_mask_cap(5)  # top-k and headroom for ties
    calls = len(scheduler(engine).calls)
    with pytest.raises(ValueError, match="rollout.top_k 20"):
        engine.generate([Request([1, 5, 6])], SamplingParams(top_k=20, max_new_tokens=4))
    assert len(scheduler(engine).calls) == calls
    # why the adapter refuses it first: SGLang aborts a request whose top-k exceeds its mask cap
    engine.mask_cap = 10_000
    with pytest.raises(ValueError, match="sampling-mask-max-tokens"):
        engine.generate([Request([1, 5, 6])], SamplingParams(top_k=100, max_new_tokens=4))


def test_every_group_member_gets_all_its_states_despite_radix_cache_hits(sglang, reference):
    """A group shares its prompt: SGLang returns prompt states only for what the radix cache did not
    hold (every member after the first), which the adapter fills from the member that computed them."""
    engine = sglang()
    prompt = [1, 30, 31, 32, 33, 34]
    out = engine.generate([Request(prompt, key=k) for k in range(4)] + [Request(prompt[:4] + [40])],
                          SamplingParams(temperature=1.0, max_new_tokens=6), seed=2, capture=True)
    hits = [r["meta_info"]["cached_tokens"] for r in scheduler(engine).last_outputs]
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    for p, c in zip([prompt] * 4 + [prompt[:4] + [40]], out):
        torch.testing.assert_close(c.hidden, states(reference, p, c.token_ids), atol=1e-4, rtol=1e-4)
    # the next capture call does not meet this call's prefixes in the cache (nobody would compute them)
    again = engine.generate([Request(prompt, key=9)], SamplingParams(temperature=1.0, max_new_tokens=3), seed=2,
                            capture=True)
    torch.testing.assert_close(again[0].hidden, states(reference, prompt, again[0].token_ids), atol=1e-4, rtol=1e-4)


def test_capture_with_prompts_longer_than_a_prefill_chunk(sglang, reference, monkeypatch):
    """Chunked prefill returns no states for a prompt's middle chunks: an engine whose draft learns
    online starts without chunking; one that does not says why its capture fails."""
    monkeypatch.setattr(sglang.emulator.scheduler, "DEFAULT_CHUNKED_PREFILL", 4)  # prompts longer than SGLang's chunk
    prompt = [1] + list(range(40, 50))
    engine = sglang(**{"speculation.policy": "static", "draft.online": "sync"})
    out = engine.generate([Request(prompt)], SamplingParams(max_new_tokens=5), seed=1, capture=True)
    torch.testing.assert_close(out[0].hidden, states(reference, prompt, out[0].token_ids), atol=1e-4, rtol=1e-4)
    chunked = sglang(**{"speculation.policy": "static"})
    with pytest.raises(RuntimeError, match="chunked_prefill_size"):
        chunked.generate([Request(prompt)], SamplingParams(max_new_tokens=5), seed=1, capture=True)


def test_each_tensor_parallel_rank_gets_its_own_payload(sglang, reference):
    """SGLang's ranks each deserialise their own copy (CUDA IPC reference counts), made after
    monkey_patch_torch_reductions(); the emulation refuses a copy read twice or an unpatched one."""
    engine = sglang(**{"engine.tensor": 2})
    assert scheduler(engine).tp == 2
    moved = [(n, t + 0.01) for n, t in reference.state_dict().items()]
    WeightBridge([engine], bucket_bytes=1 << 14).push(iter(moved), version=1)
    assert engine.stats()["weights_version"] == 1 and scheduler(engine).weight_version == "1"
    sglang.emulator.reset_ipc()
    engine.update_weights(moved[:1], version=2, complete=False)  # patched again before serialising
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    payload = MultiprocessingSerializer.serialize(moved[:1])
    with pytest.raises(sglang.emulator.EmulationError, match="one serialised copy per rank"):
        engine._run(engine._engine.tokenizer_manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload] * 2, selector="target"), None))
    sglang.emulator.reset_ipc()
    unpatched = [MultiprocessingSerializer.serialize(moved[:1]) for _ in range(2)]
    with pytest.raises(sglang.emulator.EmulationError, match="monkey_patch_torch_reductions"):
        engine._run(engine._engine.tokenizer_manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(serialized_named_tensors=unpatched, selector="target"), None))


def test_the_eagle_draft_starts_in_the_targets_dtype(sglang, tiny_policy, tmp_path):
    """A tied policy's draft config must be untied (SGLang deletes the shared weight twice at start);
    target and draft run in one dtype (with "auto", a bfloat16 policy beside a draft config without
    dtype runs the draft in float16)."""
    policy = tmp_path / "policy-bf16"
    shutil.copytree(tiny_policy, policy)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    engine = sglang(policy, **{"speculation.policy": "static"})
    s = scheduler(engine)
    assert s.target_dtype == s.draft_dtype == torch.bfloat16
    assert s.args.dtype == "bfloat16" and not s.draft_config["tie_word_embeddings"]


def test_max_new_tokens_are_clamped_to_the_context_sglang_leaves(sglang):
    """SGLang refuses a whole call when a prompt, its max_new_tokens and EAGLE's reserved slots
    exceed the context: the adapter asks for what fits and reports the clamp as a context stop."""
    engine = sglang(**{"speculation.policy": "static"})  # reserves max(2 x 3, 4) = 6 slots
    assert engine.reserved == 6 == scheduler(engine).reserved
    prompt = [1] + [7] * 149  # 150 of the context's 160
    out = engine.generate([Request(prompt), Request([1, 5, 6], max_new_tokens=3)],
                          SamplingParams(max_new_tokens=48, ignore_eos=True), seed=1)
    assert len(out[0].token_ids) == 4 and out[0].finish_reason == "context"
    assert len(out[1].token_ids) == 3 and out[1].finish_reason == "length"
    with pytest.raises(ValueError, match="request 1: prompt of 154 tokens leaves no room .* EAGLE"):
        engine.generate([Request([1, 5]), Request([1] * 154)], SamplingParams(max_new_tokens=4))


def test_a_new_version_pushed_over_an_uncommitted_one_continues_its_session(sglang, reference):
    engine = sglang()
    weights = list(reference.state_dict().items())
    engine.update_weights(weights[:2], version=1, complete=False)
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate([Request([1, 5, 6])], SamplingParams(max_new_tokens=2))
    WeightBridge([engine]).push(iter(weights), version=2)  # SGLang refuses a second begin_weight_update
    assert engine.stats()["weights_version"] == 2 and scheduler(engine).session is None
    assert len(engine.generate([Request([1, 5, 6])], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_released_weights_are_stale_until_the_next_push_and_memory_returns_in_stages(sglang, reference, tiny_draft):
    """Resume brings back the weights' memory (garbage until pushed), the KV cache and CUDA graphs
    after the push; generating in between is refused instead of sampling from garbage."""
    engine = sglang(**{"speculation.policy": "static"})
    s = scheduler(engine)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate([Request([1, 5, 6, 7])], greedy)
    engine.release_memory()
    assert s.offloaded == {"kv_cache", "weights", "cuda_graph"}
    with pytest.raises(RuntimeError, match="released"):
        engine.generate([Request([1, 5, 6, 7])], greedy)
    engine.resume_memory()
    assert s.offloaded == {"kv_cache", "cuda_graph"} and s.garbage  # the weights' memory, not their values
    with pytest.raises(RuntimeError, match="released"):
        engine.generate([Request([1, 5, 6, 7])], greedy)
    WeightBridge([engine], bucket_bytes=1 << 15).push(iter(reference.state_dict().items()), version=1)
    assert not s.offloaded and not s.garbage and not s.draft_garbage  # the draft came back from its CPU backup
    # a draft or a push arriving while released brings the weights' memory back first
    from safetensors.torch import load_file

    engine.release_memory()
    engine.update_draft(load_file(str(tiny_draft / "draft.safetensors")).items(), version=3)
    assert s.offloaded == {"kv_cache", "cuda_graph"} and engine.draft_version == 3
    with pytest.raises(RuntimeError, match="released"):
        engine.generate([Request([1, 5, 6, 7])], greedy)
    engine.update_weights(reference.state_dict().items(), version=2)
    assert not s.offloaded and engine.stats()["weights_version"] == 2
    assert [c.token_ids for c in engine.generate([Request([1, 5, 6, 7])], greedy)] == [c.token_ids for c in before]


def test_aware_sets_sglangs_adaptive_slots_and_refreshes_them(sglang, monkeypatch):
    """speculation.policy=aware on SGLang: a slot per captured batch size, each set (through fastgrpo's
    scheduler plugin) to aware's chain and frozen; after a call the acceptance SGLang's histograms
    report is learned and the slots follow aware's new picks; a depth outside a slot's candidates is
    refused by name, and an SGLANG_PLUGINS that leaves the plugin out is refused at start."""
    from fastgrpo.speculation.sglang_tiers import spec_capture_sizes

    engine = sglang(**{"speculation.policy": "aware", "rollout.max_batch": 8})
    slots = scheduler(engine).draft_worker.adaptive_controller.params._slots
    assert sorted(slots) == spec_capture_sizes(8)
    assert {k: s.current_steps for k, s in slots.items()} == engine.aware.table
    assert all(s.warmup_batches == float("inf") for s in slots.values())
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    reached = engine.aware.acceptance.reached[1]
    out = engine.generate([Request([1, 20 + i, 21, 22], key=i) for i in range(4)], sampling, seed=3)
    assert all(len(c.token_ids) == 16 for c in out)
    assert any(engine.aware.table.values())  # it speculated, and SGLang's histograms taught aware
    assert engine.aware.acceptance.reached[1] > reached
    engine.aware.count([10_000])  # every draft rejected: speculation no longer pays anywhere
    engine._learn([], [], [], [])
    assert {k: s.current_steps for k, s in slots.items()} == engine.aware.table
    assert set(engine.aware.table.values()) == {0}
    with pytest.raises(RuntimeError, match="slot 1: 99 steps is not among its candidates"):
        engine.set_tiers({1: 99})
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    with pytest.raises(RuntimeError, match="SGLANG_PLUGINS=someone_else leaves out fastgrpo's plugin"):
        sglang(**{"speculation.policy": "aware"})


def test_steps_of_a_depth_0_slot_are_not_speculation_and_teach_aware_nothing(sglang):
    """SGLang runs a step of a depth-0 slot as the verify of a one-node tree and counts it as a verify
    step with 0 correct drafts (spec_verify_ct, slot 0 of the histogram: the emulation does too).
    The adapter knows the depths it set: a call that ran plain at every step reports no speculative
    step and leaves aware's acceptance as it was (counted as speculation, the call's 60 plain steps would
    teach aware 60 level-1 rejections it never tried)."""
    engine = sglang(**{"speculation.policy": "aware", "rollout.max_batch": 8})
    engine.aware.count([10_000])  # every draft rejected: every slot goes plain
    engine._learn([], [], [], [])
    assert set(engine.aware.table.values()) == {0}
    reached, passed = list(engine.aware.acceptance.reached), list(engine.aware.acceptance.passed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    out = engine.generate([Request([1, 20 + i, 21, 22], key=i) for i in range(4)], sampling, seed=3)
    raw = [o["meta_info"] for o in scheduler(engine).last_outputs]
    assert [(m["spec_verify_ct"], m["spec_correct_drafts_histogram"]) for m in raw] == [(15, [15])] * 4
    assert all(c.spec == {"spec_steps": 0, "spec_emitted": 0} for c in out)
    stats = engine.stats()
    assert stats["spec_steps"] == 0 and stats["accept_len"] == 1.0 and stats["decode_steps"] == 60
    assert engine.aware.acceptance.reached == reached and engine.aware.acceptance.passed == passed


def test_a_plugin_that_fails_is_logged_and_skipped_as_sglang_does(sglang, monkeypatch, tmp_path, caplog):
    """SGLang logs a general plugin whose entry point fails to load or whose register() raises, and
    starts without it (srt/plugins/__init__.py): another distribution's broken plugins do not stop
    aware's engine."""
    site = tmp_path / "site"
    (site / "brokenplug-1.0.dist-info").mkdir(parents=True)
    (site / "brokenplug-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 1.0\n")
    (site / "brokenplug-1.0.dist-info" / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nbroken = brokenplug:register\nmissing = brokenplug_absent:register\n")
    (site / "brokenplug.py").write_text("def register():\n    raise RuntimeError('brokenplug cannot register')\n")
    monkeypatch.syspath_prepend(str(site))
    engine = sglang(**{"speculation.policy": "aware", "rollout.max_batch": 8})
    slots = scheduler(engine).draft_worker.adaptive_controller.params._slots
    assert {k: s.current_steps for k, s in slots.items()} == engine.aware.table
    logged = [r.getMessage() for r in caplog.records if r.exc_info]
    assert any("broken" in m for m in logged) and any("missing" in m for m in logged)


def test_fastgrpos_plugin_failing_in_sglang_is_named_at_start(sglang, monkeypatch):
    """fastgrpo's own register() raising (a broken install): SGLang logs it and starts without the
    method; the adapter names the plugin at its first depth update, at start (before: on SGLang a bare
    missing-attribute message, in the emulation the plugin's own exception)."""
    from fastgrpo.engines.sglang import plugin

    def register():
        raise ImportError("a broken install")

    monkeypatch.setattr(plugin, "register", register)
    with pytest.raises(RuntimeError, match="fastgrpo's SGLang plugin is not registered in SGLang's scheduler"):
        sglang(**{"speculation.policy": "aware", "rollout.max_batch": 8})


def test_an_engine_leaves_no_files_behind_when_closed_or_when_its_start_fails(sglang, monkeypatch, tmp_path):
    """The exported draft and the tiers file SGLang starts from live in a folder of their own until `close`
    (SGLang reads them as it starts); a start that fails removes it at once, nothing left in the system's
    temporary directory either way."""
    import tempfile

    from fastgrpo.engines.sglang.adapter import SGLangEngine

    scratch = tmp_path / "system-tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    engine = sglang(**{"speculation.policy": "aware", "rollout.max_batch": 8})
    work, = scratch.iterdir()
    assert {p.name for p in work.iterdir()} == {"eagle-draft", "adaptive.json"}
    engine.close()
    assert list(scratch.iterdir()) == []

    def set_tiers(self, table):
        raise RuntimeError("the first rpc failed")

    monkeypatch.setattr(SGLangEngine, "set_tiers", set_tiers)  # SGLang started; the adapter fails after it
    with pytest.raises(RuntimeError, match="the first rpc failed"):
        sglang(**{"speculation.policy": "aware", "rollout.max_batch": 8})
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("value", [",", " ", " , ,"])
def test_an_sglang_plugins_of_only_separators_or_blanks_allows_no_plugin(sglang, monkeypatch, value):
    """SGLang reads SGLANG_PLUGINS as an allow-list whenever it is not empty (EnvStr: as it is), so
    commas or blanks alone skip every plugin: aware refuses to start, and the emulation loads none."""
    from fastgrpo.engines.sglang.adapter import check_plugin
    from fastgrpo.engines.sglang.plugin import SET_STEPS

    monkeypatch.setenv("SGLANG_PLUGINS", value)
    with pytest.raises(RuntimeError, match="names no plugin"):
        sglang(**{"speculation.policy": "aware", "rollout.max_batch": 8})
    assert not hasattr(scheduler(sglang()), SET_STEPS)  # the first scheduler of this emulation loaded none
    for allowed in ("", "fastgrpo", " other , fastgrpo "):
        monkeypatch.setenv("SGLANG_PLUGINS", allowed)
        check_plugin()


def test_each_decode_step_runs_at_the_slot_of_its_padded_batch(sglang):
    """SGLang routes every decode step by its running batch, padded to a captured CUDA-graph size
    (the emulation does too: before, it routed one raw batch size for a whole call). The fastgrpo
    tiers hold the policy's depth at every padded size, and the adapter's count of speculative steps
    (verify steps less those its replay of the call puts at depth-0 slots) is SGLang's own: exact,
    since depth 0 is picked only above every positive depth (before: 96 requests ran plain for the
    whole call, and the adapter counted the steps of the shrinking batch as speculative)."""
    from fastgrpo.speculation.sglang_tiers import pad, spec_capture_sizes

    engine = sglang(**{"speculation.policy": "fastgrpo", "rollout.max_batch": 96})
    sizes, policy = spec_capture_sizes(96), FastGRPOFormula()
    assert scheduler(engine).capture_sizes == sizes  # cuda_graph_max_bs_decode = max_batch
    requests = [Request([1, 20 + i % 7, 21, 22], key=i, max_new_tokens=2 + (i * 7) % 23) for i in range(96)]
    out = engine.generate(requests, SamplingParams(temperature=1.0, ignore_eos=True), seed=4)
    assert [len(c.token_ids) for c in out] == [r.max_new_tokens for r in requests]
    steps = scheduler(engine).decode_steps
    assert steps[0][0] == 96 and steps[-1][0] == 1  # the batch shrinks as requests finish
    for batch, depth in steps:
        config = policy.choose(pad(batch, sizes))
        assert depth == (0 if config is None else config.depth), batch
    ran = {depth for batch, depth in steps}
    assert 0 in ran and ran - {0}  # plain at 81-96 rows (padded to 88 and 96), chains below
    speculative = sum(batch for batch, depth in steps if depth > 0)
    stats = engine.stats()
    assert stats["spec_steps"] == speculative
    assert stats["decode_steps"] == sum(batch for batch, _ in steps)


def stop_engine(policy, tmp_path, reference, stop_ids=()):
    from fastgrpo.engines.sglang import adapter
    from fastgrpo.models.tokenizer import load_tokenizer

    cfg = tiny_config(tmp_path, policy, **{"engine.backend": "sglang", "speculation.policy": "off",
                                           "draft.online": "off"})
    return adapter.build_engine(cfg, AutoConfig.from_pretrained(policy), load_tokenizer(policy),
                                weights=reference.state_dict().items(), stop_ids=stop_ids)


def test_the_engines_stop_ids_stop_sglang(tiny_policy, reference, tmp_path):
    """SGLang stops by itself on config.json's and generation_config.json's eos ids only (ModelConfig
    hf_eos_token_id; never the tokenizer's eos, with skip_tokenizer_init): the adapter's `stop_ids`
    go with every request as stop_token_ids, which SGLang honours unless ignore_eos
    (managers/schedule_batch.py:1857-1878). Without them a response runs past its end-of-turn token,
    as the engine started without stop ids below shows."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    prompt = [1, 9, 10, 11]
    with emulated_sglang():
        free = stop_engine(tiny_policy, tmp_path, reference)
        tokens = free.generate([Request(prompt)], greedy)[0].token_ids
        free.close()
        eos = {AutoConfig.from_pretrained(tiny_policy).eos_token_id}
        at = next(i for i, t in enumerate(tokens) if t not in eos and i > 0)
        stop = tokens[at]
        first = tokens.index(stop)
        engine = stop_engine(tiny_policy, tmp_path, reference, stop_ids=[stop, stop])
        ends = SamplingParams(temperature=0.0, max_new_tokens=12)
        c = engine.generate([Request(prompt)], ends)[0]
        assert c.token_ids == tokens[: first + 1] and c.finish_reason == "stop"
        sent = scheduler(engine).last_params
        assert sent[0]["stop_token_ids"] == [stop]
        assert engine.generate([Request(prompt)], greedy)[0].token_ids == tokens  # ignore_eos: no stop at all
        engine.close()
        # generation_config.json's eos ids stop SGLang by itself (configs/model_config.py:2190-2208)
        policy = tmp_path / "with-generation-config"
        shutil.copytree(tiny_policy, policy)
        (policy / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 999]}))
        engine = stop_engine(policy, tmp_path, reference)
        c = engine.generate([Request(prompt)], ends)[0]
        assert c.token_ids == tokens[: first + 1] and c.finish_reason == "stop"
        engine.close()


def test_a_moe_checkpoint_with_dense_layers_is_refused_before_sglang_starts():
    """SGLang 0.5.23 runs every Qwen3-MoE layer as a sparse block (tests/test_sglang_conformance.py reads it
    from its source), so a checkpoint with dense layers among them is refused by name, on any machine,
    before any GPU is asked for; the released layout (every layer sparse) passes the check."""
    from transformers import Qwen3MoeConfig

    from fastgrpo.engines.sglang.adapter import build_engine, check_model

    cfg = load_config(None, ["engine.backend=sglang", "speculation.policy=off", "draft.online=off"])
    for dense in ({"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}):
        config = Qwen3MoeConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, **dense)
        with pytest.raises(ValueError, match="has dense layers"):
            build_engine(cfg, config, None)
    check_model(Qwen3MoeConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2))
