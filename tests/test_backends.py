"""The seams: backends chosen by config through one factory, and the batch a trainer receives."""

import dataclasses
import math
import sys

import pytest
import torch
from transformers import AutoConfig

from fastgrpo.engines import build_engine

from fastgrpo.protocols import BackendUnavailable

from fastgrpo.trainers import build_trainer
from fastgrpo.config import ConfigError, load_config
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.tokenizer import load_text_format
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
    engine = build_engine(cfg, AutoConfig.from_pretrained(tiny_policy), load_text_format(tiny_policy))
    engine.update_weights(trainer.export_weights(), version=0)  # an engine holds nothing until a push
    prompt = [1, 5, 6, 7]
    out = engine.generate([Request(prompt)], SamplingParams(temperature=1.0, max_new_tokens=8), seed=3)[0]
    batch = build_batch([prompt], [out.token_ids], [out.logprobs], torch.zeros(1), pad_id=0)
    scored = trainer.logprobs(batch)[0, len(prompt):len(prompt) + len(out.token_ids)]
    torch.testing.assert_close(scored, torch.tensor(out.logprobs), atol=1e-4, rtol=0)


def test_an_uninstalled_backend_fails_with_its_key(tmp_path, tiny_policy, monkeypatch):
    cfg = tiny_config(tmp_path, tiny_policy, **{"speculation.policy": "off", "draft.online": "off"})
    monkeypatch.setitem(sys.modules, "fastgrpo.engines.embedded.build", None)  # as if its libraries were missing
    with pytest.raises(BackendUnavailable, match=r"engine\.backend=embedded"):
        build_engine(cfg, None, load_text_format(tiny_policy))


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


def _engine_and_trainer(tmp_path, policy, **extra):
    cfg = tiny_config(tmp_path, policy, **{"speculation.policy": "off", "draft.online": "off"} | extra)
    trainer = build_trainer(cfg)
    engine = build_engine(cfg, AutoConfig.from_pretrained(policy), load_text_format(policy))
    engine.update_weights(trainer.export_weights(), version=0)
    return cfg, trainer, engine


def test_keyed_requests_sample_the_same_wherever_they_run(tmp_path, tiny_policy):
    """Requests split over two engines' calls, each request keyed by its place in the whole batch,
    give the tokens one call over all of them gives: what lets rollout deal prompts to any number of
    engines without changing a sample."""
    _, _, engine = _engine_and_trainer(tmp_path, tiny_policy)
    prompts = [[1, 5 + i % 3, 6, 7] for i in range(8)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    whole = engine.generate([Request(p) for p in prompts], sampling, seed=11)
    first = engine.generate([Request(p, key=i) for i, p in enumerate(prompts[:3])], sampling, seed=11)
    rest = engine.generate([Request(p, key=3 + i) for i, p in enumerate(prompts[3:])], sampling, seed=11)
    assert [c.token_ids for c in first + rest] == [c.token_ids for c in whole]
    unkeyed = engine.generate([Request(p) for p in prompts[3:]], sampling, seed=11)  # keys 0.. again: other samples
    assert [c.token_ids for c in unkeyed] != [c.token_ids for c in whole[3:]]


@pytest.mark.parametrize("speculation", ["off", "static"])
def test_the_engine_returns_each_tokens_sampling_set_and_the_trainer_scores_in_it(tmp_path, tiny_policy, tiny_draft,
                                                                                  speculation):
    """With top-k and top-p, each token comes with the set it was sampled from (it holds the token; at
    most top_k ids), plain and speculative decoding alike, and the trainer scoring in those sets gives
    the engine's log-probabilities to float rounding: `kl_engine_trainer` below 1e-5 after a step.
    Without the sets the trainer recomputes them from its own logits: each sampled token's top-k /
    top-p log-probability as computed by hand from the model's logits (`_cut_logprob`)."""
    extra = {"draft.path": str(tiny_draft), "speculation.policy": speculation} if speculation != "off" else {}
    cfg, trainer, engine = _engine_and_trainer(tmp_path, tiny_policy, **extra, **{  # static: the draft of draft.path
        "rollout.top_k": 5, "rollout.top_p": 0.9, "rollout.max_new_tokens": 24})
    sampling = SamplingParams.of(cfg.rollout)
    prompts = [[1, 5 + i % 4, 6, 7, 8] for i in range(16)]
    out = engine.generate([Request(p) for p in prompts], sampling, seed=4)
    if speculation != "off":
        assert engine.stats()["spec_steps"] > 0
    for c in out:
        assert c.sample_sets is not None and len(c.sample_sets) == len(c.token_ids)
        assert all(tok in kept and 1 <= len(kept) <= 5 for tok, kept in zip(c.token_ids, c.sample_sets))
    batch = build_batch(prompts, [c.token_ids for c in out], [c.logprobs for c in out],
                        torch.linspace(-1, 1, len(out)), pad_id=0, sample_sets=[c.sample_sets for c in out])
    scored = trainer.logprobs(batch)
    for i, c in enumerate(out):
        got = scored[i, len(prompts[i]): len(prompts[i]) + len(c.token_ids)]
        torch.testing.assert_close(got, torch.tensor(c.logprobs), atol=2e-5, rtol=0)
    recomputed = trainer.logprobs(dataclasses.replace(batch, sample_sets=None))
    top_p_cut = 0
    with torch.no_grad():
        for i, c in enumerate(out):
            logits = trainer.model(torch.tensor([prompts[i] + c.token_ids])).logits[0].double().tolist()
            for j, token in enumerate(c.token_ids):
                row = logits[len(prompts[i]) + j - 1]
                want = _cut_logprob(row, token, sampling.top_k, sampling.top_p)
                assert abs(float(recomputed[i, len(prompts[i]) + j]) - want) < 2e-5, (i, j)
                top_p_cut += abs(_cut_logprob(row, token, sampling.top_k, 1.0) - want) > 1e-3
    assert top_p_cut > 0  # the control: an oracle without top-p would fail the comparison above
    metrics = trainer.train_step(batch)
    assert abs(metrics["kl_engine_trainer"]) < 1e-5 and metrics["updates"] == 1, metrics


def _cut_logprob(logits: list[float], token: int, top_k: int, top_p: float) -> float:
    """The sampling distribution at temperature 1 written out: the top_k largest logits, of which those
    (in order) whose predecessors' probability mass is still below top_p, renormalised; the sampled
    token is scored inside the set even where it fell outside (the trainer never scores -inf)."""
    order = sorted(range(len(logits)), key=lambda t: -logits[t])[:top_k]
    weights = [math.exp(logits[t] - logits[order[0]]) for t in order]
    kept, covered = [], 0.0
    for t, w in zip(order, weights):
        if covered < top_p:
            kept.append(t)
        covered += w / sum(weights)
    kept += [] if token in kept else [token]
    top = max(logits[t] for t in kept)
    return logits[token] - top - math.log(sum(math.exp(logits[t] - top) for t in kept))


def test_sampling_sets_fall_back_and_pad_correctly():
    """`sampling_logprobs` with sets: renormalised over exactly the given ids (token 0 included, with
    -1 padding that must not drop it); positions without a set keep the computed top-k set."""
    from fastgrpo.models.sampling import sampling_logprobs

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.1], [0.0, 3.0, 1.0, 2.0]])
    p = SamplingParams(temperature=1.0, top_k=2)
    sets = torch.tensor([[0, 2, -1], [-1, -1, -1]])
    lp = sampling_logprobs(logits, p, sets=sets)
    torch.testing.assert_close(lp[0], torch.log_softmax(torch.tensor([2.0, -float("inf"), 0.5, -float("inf")]), -1))
    torch.testing.assert_close(lp[1], sampling_logprobs(logits[1:], p)[0])


def test_a_rounding_error_at_the_cut_changes_a_recomputed_set_but_not_the_engines():
    """Tokens 1 and 2 tie at the top-k cut to 1e-6: the engine's logits keep token 1, the trainer's
    (a rounding error away) would keep token 2. Scored in the engine's set, the trainer's
    log-probability of the sampled token is the engine's to float rounding; recomputing the set
    changes the normaliser by the weight of a whole token."""
    from fastgrpo.models.sampling import kept_sets, sampling_logprobs

    p = SamplingParams(temperature=1.0, top_k=2)
    engine_logits = torch.tensor([[3.0, 1.0 + 1e-6, 1.0, -2.0]])
    trainer_logits = torch.tensor([[3.0, 1.0, 1.0 + 1e-6, -2.0]])
    engine_lp = sampling_logprobs(engine_logits, p)
    sets = torch.tensor(kept_sets(engine_lp))
    assert sets.tolist() == [[0, 1]]
    token = torch.tensor([0])
    in_set = sampling_logprobs(trainer_logits, p, sampled=token, sets=sets)[0, 0]
    recomputed = sampling_logprobs(trainer_logits, p, sampled=token)[0, 0]
    assert abs(float(in_set - engine_lp[0, 0])) < 1e-5
    assert abs(float(recomputed - engine_lp[0, 0])) < 1e-5  # token 0's own probability: the same normaliser here...
    second = torch.tensor([1])  # ...but the token at the cut: in the engine's set, outside the recomputed one
    engine_second = engine_lp[0, 1]
    assert abs(float(sampling_logprobs(trainer_logits, p, sampled=second, sets=sets)[0, 1] - engine_second)) < 1e-5
    assert abs(float(sampling_logprobs(trainer_logits, p, sampled=second)[0, 1] - engine_second)) > 1e-2


def test_an_engine_layout_the_launched_world_cannot_hold_fails_before_any_work(monkeypatch):
    """engine.tensor against the world torchrun launched: it must divide the policy ranks and the ranks
    of a node (an engine never spans nodes); the error names the key, before any group is made."""
    from fastgrpo.run_setup import check_layout

    cfg = load_config(None, ["engine.backend=sglang", "engine.tensor=2", "trainer.backend=megatron",
                             "speculation.policy=off", "draft.online=off"])
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"engine\.tensor=2 divides the 3 policy ranks"):
        check_layout(cfg)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"engine\.tensor=2 divides the 3 ranks of a node"):
        check_layout(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_layout(cfg)  # 3 engines of 2 GPUs, each within one of 3 nodes of 2
