"""The seams: backends chosen by config through one factory, and the batch a trainer receives."""

import sys

import pytest
import torch
from transformers import AutoConfig

from fastgrpo.backends import BackendUnavailable, build_engine, build_trainer
from fastgrpo.config import ConfigError, load_config
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.tokenizer import load_tokenizer
from fastgrpo.types import Request, SamplingParams
from tests.conftest import tiny_config


def test_backends_and_layout_are_validated_before_any_work():
    for override, key in (("trainer.backend=megatorch", "trainer.backend"), ("engine.backend=vllm", "engine.backend"),
                          ("parallel.tensor=2", "parallel.tensor"), ("parallel.pipeline=0", "parallel.pipeline"),
                          ("trainer.layer_spec=te", "trainer.layer_spec")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [override])
    for overrides, key in ((["trainer.backend=megatron", "speculation.policy=aware", "draft.online=async"], "draft.online"),
                           (["parallel.draft_ranks=1", "draft.online=async"], "parallel.draft_ranks"),  # torch trainer
                           (["trainer.backend=megatron", "parallel.draft_ranks=1", "draft.online=sync"],
                            "parallel.draft_ranks"),
                           (["parallel.draft_ranks=-1"], "parallel.draft_ranks")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, overrides)
    assert load_config(None, ["trainer.backend=megatron", "parallel.tensor=2"]).parallel.tensor == 2
    assert load_config(None, ["trainer.backend=megatron", "grpo.kl_coef=0.1"]).grpo.kl_coef == 0.1  # a reference in the layout


def test_the_factory_builds_a_trainer_and_engine_that_agree(tmp_path, tiny_policy):
    cfg = tiny_config(tmp_path, tiny_policy, **{"speculation.policy": "off", "draft.online": "off"})
    trainer = build_trainer(cfg)
    engine = build_engine(cfg, AutoConfig.from_pretrained(tiny_policy), load_tokenizer(tiny_policy))
    engine.update_weights(trainer.export_weights(), version=0)  # an engine holds nothing until a push
    prompt = [1, 5, 6, 7]
    out = engine.generate([Request(prompt)], SamplingParams(temperature=1.0, max_new_tokens=8), seed=3)[0]
    batch = build_batch([prompt], [out.token_ids], [out.logprobs], torch.zeros(1), pad_id=0)
    scored = trainer.logprobs(batch)[0, len(prompt):len(prompt) + len(out.token_ids)]
    torch.testing.assert_close(scored, torch.tensor(out.logprobs), atol=1e-4, rtol=0)


def test_an_uninstalled_backend_fails_with_its_key(tmp_path, tiny_policy, monkeypatch):
    cfg = tiny_config(tmp_path, tiny_policy, **{"speculation.policy": "off", "draft.online": "off"})
    monkeypatch.setitem(sys.modules, "fastgrpo.backends.embedded", None)  # as if its libraries were missing
    with pytest.raises(BackendUnavailable, match=r"engine\.backend=embedded"):
        build_engine(cfg, None, load_tokenizer(tiny_policy))


def test_a_batch_shards_by_whole_groups_across_data_parallel_ranks():
    G, groups = 4, 5
    prompts = [[1, 2 + i // G] for i in range(G * groups)]
    responses = [[3] * (1 + i % 7) for i in range(G * groups)]
    batch = build_batch(prompts, responses, [[-0.5] * len(r) for r in responses],
                        torch.arange(G * groups, dtype=torch.float32), pad_id=0)
    for world in (1, 2, 3, 5):
        shards = [batch.shard(rank, world, G) for rank in range(world)]
        rows = torch.cat([s.advantages for s in shards]).long().tolist()
        assert rows == list(range(G * groups))  # every row once, in order
        sizes = [s.size // G for s in shards]
        assert all(s.size % G == 0 for s in shards) and max(sizes) - min(sizes) <= 1
        for s in shards:  # each shard keeps its rows' tokens and is trimmed to its own longest row
            first = int(s.advantages[0])
            assert s.input_ids[0, 1].item() == 2 + first // G
            assert s.input_ids.shape[1] == int(s.attention_mask.sum(-1).max())
    with pytest.raises(ValueError, match="5 groups cannot be shared by 6"):
        batch.shard(0, 6, G)
    with pytest.raises(ValueError, match="groups of 3"):
        batch.shard(0, 2, 3)
