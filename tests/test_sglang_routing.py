"""Routing replay on the emulated SGLang (fastgrpo/engines/sglang): the routed experts SGLang records come back
as the embedded engine's record, and routing SGLang cannot record is refused naming why. (Split from
tests/test_sglang_adapter.py, whose fixtures it uses.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from fastgrpo.engines import build_engine
from fastgrpo.engines.sglang.adapter import server_args
from fastgrpo.config import load_config
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.types import Request, SamplingParams
from tests.conftest import tiny_config
from tests.sglang_emulated import emulated_sglang, scheduler
from tests.test_sglang_adapter import reference, sglang  # noqa: F401 (its fixtures: sglang requests reference)


# -- routing replay (a mixture of experts' routed experts) on the emulated SGLang --------------------------

def moe_sglang(tmp_path, policy_dir, weights, **overrides):
    """An SGLang adapter over the emulated SGLang for a Qwen3-MoE checkpoint, holding `weights`."""
    sections = {"engine.backend": "sglang", "speculation.policy": "off", "draft.online": "off",
                "trainer.routing_replay": "rollout"} | overrides
    cfg = tiny_config(tmp_path, policy_dir, **sections)
    return build_engine(cfg, AutoConfig.from_pretrained(policy_dir), load_text_format(policy_dir), weights=weights)


def embedded_moe(policy):
    from fastgrpo.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(policy.config, 8, 128, eos_id=-1, pad_id=0, dtype=torch.float32)
    engine.update_weights(policy.state_dict().items(), version=0)
    return engine


def test_the_routing_sglang_records_is_the_embedded_engines(tmp_path):
    """A tiny Qwen3-MoE (every layer sparse, as SGLang builds it) rolled out greedily on the emulated
    SGLang (routed experts captured per KV slot, encoded as SGLang encodes them: routed.py in the
    emulation, checked against the wheel's own code by tests/test_sglang_conformance.py) and on the
    embedded engine: the same tokens, and the adapter's `Completion.routing` is the embedded engine's
    record, position for position (int16 [T, layers, k], the last position -1). Every request reads its
    prompt's first positions from the radix cache, whose rows another request wrote: a group member's,
    or a request of an earlier call (the first of them asked for no routing, which SGLang records all the
    same, and returned none); after a push of other weights (the cache flushed) the record is the new
    weights' routing."""
    from fastgrpo.models.policy import load_policy
    from fastgrpo.bench.family_checkpoints import MOE_FAMILY, MOE_TOP_K, write_family_checkpoint

    first = write_family_checkpoint(MOE_FAMILY, tmp_path / "moe", mlp_only_layers=[])
    second = write_family_checkpoint(MOE_FAMILY, tmp_path / "moe-2", seed=1, mlp_only_layers=[])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (6 + 3 * i,), generator=g).tolist() for i in range(3)]
    requests = [Request(p, max_new_tokens=8 + 2 * j) for p in prompts for j in range(2)]  # groups of 2
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    with emulated_sglang():
        policy = load_policy(first).eval()
        engine = moe_sglang(tmp_path, first, policy.state_dict().items())
        assert engine.generate(requests, greedy)[0].routing is None  # not asked for (SGLang records all the same)
        for _ in range(2):
            got = engine.generate(requests, greedy, routing=True)
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in scheduler(engine).last_outputs)
            want = embedded_moe(policy).generate(requests, greedy, routing=True)
            for r, c, w in zip(requests, got, want):
                assert c.token_ids == w.token_ids
                assert c.routing.dtype == torch.int16 and c.routing.shape == (len(r.prompt_ids) + len(c.token_ids), 3,
                                                                              MOE_TOP_K)
                assert torch.equal(c.routing, w.routing)
        assert len(torch.unique(got[0].routing[:-1, 0], dim=0)) > 3  # the record varies by position
        other = load_policy(second).eval()
        engine.update_weights(other.state_dict().items(), version=1)
        got = engine.generate(requests, greedy, routing=True)
        want = embedded_moe(other).generate(requests, greedy, routing=True)
        assert [c.token_ids for c in got] == [w.token_ids for w in want]
        assert all(torch.equal(c.routing, w.routing) for c, w in zip(got, want))
        assert not all(torch.equal(c.routing, w.routing) for c, w in zip(got, embedded_moe(policy).generate(
            requests, greedy, routing=True)))
        engine.close()


def test_routing_sglang_cannot_record_is_refused_naming_why(tmp_path, sglang):
    """An SGLang engine records routing only for a mixture of experts under trainer.routing_replay=rollout
    without speculation (`enable_return_routed_experts`); asked without it, generate refuses rather than
    send a request whose output would have no record. With speculation, generate and the config refuse,
    citing SGLang's source. A dense policy has no routing to record: routing=True returns none."""
    from fastgrpo.config import ConfigError
    from fastgrpo.engines.sglang.adapter import SGLangEngine
    from fastgrpo.models.policy import load_policy
    from fastgrpo.bench.family_checkpoints import MOE_FAMILY, write_family_checkpoint

    replay = load_config(None, ["engine.backend=sglang", "trainer.routing_replay=rollout", "speculation.policy=off",
                                "draft.online=off"])
    assert server_args(replay, "off", None, None, 0, moe=True)["enable_return_routed_experts"]
    assert "enable_return_routed_experts" not in server_args(replay, "off", None, None, 0, moe=False)
    assert "enable_return_routed_experts" not in server_args(replay, "static", "draft", None, 0, moe=True)
    off = load_config(None, ["engine.backend=sglang", "speculation.policy=off", "draft.online=off"])
    assert "enable_return_routed_experts" not in server_args(off, "off", None, None, 0, moe=True)
    with pytest.raises(ConfigError, match=r"trainer\.routing_replay rollout with engine\.backend=sglang needs "
                                          r"speculation\.policy=off.*eagle_worker_common\.py:772-784"):
        load_config(None, ["engine.backend=sglang", "trainer.routing_replay=rollout", "speculation.policy=fastgrpo"])

    moe = write_family_checkpoint(MOE_FAMILY, tmp_path / "moe", mlp_only_layers=[])
    weights = load_policy(moe).state_dict().items()
    request = [Request([5, 6, 7])]
    engine = moe_sglang(tmp_path, moe, weights, **{"trainer.routing_replay": "off"})
    with pytest.raises(ValueError, match="started with enable_return_routed_experts"):
        engine.generate(request, SamplingParams(max_new_tokens=4), routing=True)
    engine.close()
    speculating = SGLangEngine(engine._engine, replay, AutoConfig.from_pretrained(moe), "static", {})
    with pytest.raises(ValueError, match=r"needs speculation\.policy=off \(this engine speculates: static\).*"
                                         r"spec_utils\.py:859-910"):
        speculating.generate(request, SamplingParams(max_new_tokens=4), routing=True)
    dense = sglang(**{"trainer.routing_replay": "rollout"})
    assert dense.generate(request, SamplingParams(max_new_tokens=4), routing=True)[0].routing is None
