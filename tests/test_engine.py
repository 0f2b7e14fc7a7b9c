"""The embedded engine against Hugging Face: same logits, same log-probabilities, same greedy text."""

import math

import pytest
import torch

from fastgrpo.types import SamplingParams, Request
from fastgrpo.trainers.torch_trainer import token_logprobs
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.engines.embedded.model import InferenceModel, KVCache
from fastgrpo.models.layers import onednn_available
from fastgrpo.models.sampling import sampling_logprobs
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.policy import new_policy, policy_config
from tests.conftest import first_divergence_is_a_near_tie

VOCAB = 97


@pytest.fixture(scope="module")
def policy():
    return new_policy(policy_config("test", VOCAB, 128, bos_id=1, eos_id=2, pad_id=0), seed=3).eval()


def make_engine(policy, max_batch):
    e = EmbeddedEngine(policy.config, max_batch=max_batch, max_context=128, eos_id=2, pad_id=0)
    e.update_weights(policy.state_dict().items(), version=0)
    return e


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


KERNELS = ["dense"] + (["onednn"] if onednn_available() else [])


@pytest.mark.parametrize("kernel", KERNELS)
def test_kv_cache_logits_equal_full_forward(policy, kernel):
    ids = torch.randint(3, VOCAB, (3, 24))
    with torch.no_grad():
        ref = policy(ids).logits
    model = InferenceModel(policy.config, 128, kernel=kernel)
    model.load(new_policy(policy.config, seed=99).state_dict().items())  # packed copies must follow reloads,
    weights = list(policy.state_dict().items())
    model.load(weights[: len(weights) // 2])  # also when they come in buckets, as the bridge sends them
    model.load(weights[len(weights) // 2 :])
    cache = KVCache(policy.config, 4, 128)
    rows = slice(1, 4)  # not the first rows: rows are independent
    chunks = []
    for a, b in [(0, 10), (10, 11), (11, 17), (17, 24)]:  # prefill, decode, a block, a block
        logits, _ = model.forward(ids[:, a:b], cache, rows)
        cache.lengths[rows] += b - a
        chunks.append(logits)
    assert torch.allclose(torch.cat(chunks, 1), ref, atol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_ragged_block_computes_each_rows_own_tokens_as_a_full_forward_does(policy, kernel):
    """Rows of one block with different numbers of new tokens (a per-sequence verify budget): the
    matmuls see only the valid tokens, and each valid token's logits equal a full forward over its
    row's prefix and its valid tokens before it; the gaps come back as zeros."""
    ids = torch.randint(3, VOCAB, (3, 14))
    model = InferenceModel(policy.config, 128, kernel=kernel)
    model.load(policy.state_dict().items())
    cache = KVCache(policy.config, 3, 128)
    model.forward(ids[:, :10], cache, slice(0, 3))
    cache.lengths += 10
    valid = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    logits, hidden = model.forward(ids[:, 10:], cache, slice(0, 3), new_mask=causal & valid[:, None, :], valid=valid)
    assert (logits[~valid] == 0).all() and (hidden[~valid] == 0).all()
    for b in range(3):
        kept = ids[b, :10].tolist() + ids[b, 10:][valid[b]].tolist()
        positions = torch.arange(10, 14)[valid[b]]
        with torch.no_grad():  # valid tokens take RoPE positions 10.. by slot, as the tree's depths do
            ref = policy(torch.tensor([kept]), position_ids=torch.cat([torch.arange(10), positions])[None]).logits[0, 10:]
        assert torch.allclose(logits[b][valid[b]], ref, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (0.9, 0), (1.0, 5), (0.9, 5)])
def test_engine_logprobs_equal_trainer_logprobs(policy, temperature, top_p, top_k):
    """The trainer scores the distribution the engine sampled from (top-k / top-p included), so the
    truncated importance weight pi_trainer / pi_engine is 1."""
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.config import GRPOConfig, OptimConfig

    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=20)
    engine = make_engine(policy, max_batch=4)
    ps = prompts(6)
    out = engine.generate([Request(p) for p in ps], sampling, seed=5)
    batch = build_batch(ps, [o.token_ids for o in out], [o.logprobs for o in out], torch.zeros(6), pad_id=0)
    with torch.no_grad():
        lp, entropy = token_logprobs(policy, batch, sampling)
    m = batch.response_mask
    assert m.sum() == sum(len(o.token_ids) for o in out)
    assert (lp[m] - batch.engine_logprobs[m]).abs().max() < 1e-4
    assert torch.isfinite(entropy[m]).all() and (entropy[m] >= 0).all()
    if top_k:
        assert (entropy[m] <= math.log(top_k) + 1e-5).all()  # the entropy of the truncated distribution
    trainer = TorchPolicyTrainer(policy, GRPOConfig(), OptimConfig(), sampling)
    tis = torch.exp(trainer.logprobs(batch) - batch.engine_logprobs)[m]
    assert (tis - 1).abs().max() < 1e-4


def test_a_prompt_shared_by_a_group_is_prefilled_once(policy):
    """GRPO groups (each prompt sampled several times): the prefill forward sees each distinct prompt
    once, and every sample's log-probabilities still equal a full forward's."""
    engine = make_engine(policy, max_batch=12)
    ps = [p for p in prompts(3, seed=4) for _ in range(4)]
    prefill_rows = []
    forward = engine.model.forward

    def counting(tokens, *args, **kwargs):
        prefill_rows.append(tokens.shape[0]) if tokens.shape[1] > 1 else None
        return forward(tokens, *args, **kwargs)

    engine.model.forward = counting
    out = engine.generate([Request(p) for p in ps], SamplingParams(temperature=1.0, max_new_tokens=16), seed=2)
    assert prefill_rows == [3]
    assert len({tuple(o.token_ids) for o in out}) > 3  # samples of one prompt differ
    batch = build_batch(ps, [o.token_ids for o in out], [o.logprobs for o in out], torch.zeros(12), pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(policy, batch, SamplingParams(temperature=1.0))
    m = batch.response_mask
    assert (lp[m] - batch.engine_logprobs[m]).abs().max() < 1e-4


def test_continuous_batching_is_invisible(policy):
    """Sequences joining and leaving (rows moved) must not change any sequence's greedy output."""
    ps = prompts(9, seed=1)
    reqs = [Request(p, max_new_tokens=4 + 5 * (i % 4)) for i, p in enumerate(ps)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    alone = [make_engine(policy, 1).generate([r], greedy)[0].token_ids for r in reqs]
    for max_batch in (2, 3, 9):
        together = make_engine(policy, max_batch).generate(reqs, greedy)
        assert [c.token_ids for c in together] == alone
    for o, r in zip(together, reqs):
        assert len(o.token_ids) <= r.max_new_tokens
        assert o.finish_reason in ("stop", "length")


def test_greedy_matches_hf_generate(policy):
    p = prompts(1, seed=2)[0]
    ours = make_engine(policy, 1).generate([Request(p)], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    hf = policy.generate(torch.tensor([p]), max_new_tokens=len(ours.token_ids), do_sample=False,
                         eos_token_id=2, pad_token_id=0)
    assert hf[0, len(p):].tolist() == ours.token_ids


def test_context_limit_and_bad_requests(policy):
    engine = make_engine(policy, 2)
    long_prompt = [3 + i % 90 for i in range(120)]
    out = engine.generate([Request(long_prompt)], SamplingParams(temperature=0.0, max_new_tokens=50))[0]
    assert len(out.token_ids) == 8 and out.finish_reason in ("context", "stop")  # 120 + 8 = 128
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([Request([])], SamplingParams())
    with pytest.raises(ValueError, match="no room"):
        engine.generate([Request(long_prompt * 2)], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([Request([5, VOCAB])], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_top_k_top_p_restrict_the_distribution():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    lp = sampling_logprobs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(lp).sum() == 2 and lp.exp().sum().item() == pytest.approx(1.0)
    probs = torch.softmax(logits, -1)[0]  # 0.636, 0.234, 0.086, ...
    lp = sampling_logprobs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(lp).sum() == 2  # 0.636 < 0.8 <= 0.636 + 0.234
    assert lp[0, 0].exp().item() == pytest.approx((probs[0] / probs[:2].sum()).item(), rel=1e-5)
    lp = sampling_logprobs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.isfinite(lp).sum() == 1


def test_update_weights_rejects_mismatch(policy):
    engine = make_engine(policy, 1)
    with pytest.raises(KeyError, match="not part of"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)


def test_a_weight_push_is_served_whole_or_not_at_all(policy):
    """Through the bridge, in buckets: an interrupted push leaves the engine refusing to generate (it
    never serves a mix of two versions); a tensor that arrives different from what was sent fails
    the commit; a complete push serves the new version."""
    from fastgrpo.bridge import WeightBridge

    engine = make_engine(policy, 2)
    bridge = WeightBridge([engine], bucket_bytes=1 << 16)  # many buckets
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate([Request(p) for p in prompts(2)], greedy)
    moved = {name: t + 0.01 for name, t in policy.state_dict().items()}

    def interrupted():
        for i, item in enumerate(moved.items()):
            if i == len(moved) // 2:
                raise ConnectionError("the trainer died mid-push")
            yield item

    with pytest.raises(ConnectionError):
        bridge.push(interrupted(), version=1)
    assert engine.weights_version is None and engine.stats()["weights_version"] is None
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate([Request(p) for p in prompts(2)], greedy)

    bridge.push(moved.items(), version=2)
    assert engine.weights_version == 2
    after = engine.generate([Request(p) for p in prompts(2)], greedy)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]  # the new weights are served

    class LossyLink:  # hands the buckets on, changing one tensor on the way
        def update_weights(self, named, version, complete=True):
            engine.update_weights([(n, t + 1.0 if n == "model.norm.weight" else t) for n, t in named], version, complete)

        def commit_weights(self, version, checksums=None):
            engine.commit_weights(version, checksums)

    with pytest.raises(RuntimeError, match="model.norm.weight differs from what the trainer sent"):
        WeightBridge([LossyLink()], bucket_bytes=1 << 16).push(moved.items(), version=3)
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate([Request(p) for p in prompts(2)], greedy)


def test_ignore_eos_keeps_sequences_running(policy):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    reference = make_engine(policy, 4).generate([Request(p) for p in prompts(3)], greedy)
    # declare the token that greedy emits first for prompt 0 to be EOS: that sequence must stop at once
    eos = reference[0].token_ids[0]
    engine = EmbeddedEngine(policy.config, max_batch=4, max_context=128, eos_id=eos, pad_id=0)
    engine.update_weights(policy.state_dict().items(), version=0)
    stopped = engine.generate([Request(p) for p in prompts(3)], SamplingParams(temperature=0.0, max_new_tokens=12))
    assert stopped[0].token_ids == [eos] and stopped[0].finish_reason == "stop"
    kept = engine.generate([Request(p) for p in prompts(3)], greedy)
    assert [o.token_ids for o in kept] == [o.token_ids for o in reference]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in kept)



@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, max_new_tokens=30),
                                      SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=30)])
def test_sampled_tokens_do_not_depend_on_the_batch(policy, sampling):
    """Counter-based noise: a request's samples are the same alone, in any batch, at any slot count."""
    ps = prompts(9, seed=4)
    reqs = [Request(p, max_new_tokens=6 + 4 * (i % 5)) for i, p in enumerate(ps)]
    together = [c.token_ids for c in make_engine(policy, 9).generate(reqs, sampling, seed=21)]
    for max_batch in (1, 4):
        again = [c.token_ids for c in make_engine(policy, max_batch).generate(reqs, sampling, seed=21)]
        for i, (a, b) in enumerate(zip(together, again)):
            assert first_divergence_is_a_near_tie(policy, ps[i], a, b, sampling, 21, i)
    # the noise is the request's own: moving a request to another index (another key) resamples it
    moved = make_engine(policy, 9).generate(reqs[1:] + reqs[:1], sampling, seed=21)
    assert sum(c.token_ids != together[(i + 1) % 9] for i, c in enumerate(moved)) >= 7
    other_seed = make_engine(policy, 9).generate(reqs, sampling, seed=22)
    assert sum(c.token_ids != t for c, t in zip(other_seed, together)) >= 7


def test_counter_based_sampling_draws_the_distribution():
    """Inverse-CDF sampling at hashed uniforms: frequencies match the distribution, and nothing
    outside the top-k / top-p set is ever drawn."""
    from fastgrpo.models.sampling import sample, sampling_uniforms

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 200_000
    u = sampling_uniforms(5, torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.003
    for p in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.8)):
        lp = sampling_logprobs(logits[None].expand(n, -1), p)
        tokens = sample(lp, p, u)
        freq = torch.bincount(tokens, minlength=6).double() / n
        expected = lp[0].exp().double()
        assert (freq[expected == 0] == 0).all()
        se = (expected * (1 - expected) / n).sqrt()
        assert ((freq - expected).abs() <= 4 * se + 1e-12).all(), (freq, expected)


def test_the_cap_below_a_cdfs_total_is_the_double_just_below_it():
    """`sample` caps its target at total x BELOW instead of nextafter(total, 0) (one kernel, not two): the
    same double for every total from 2^-1021 up (powers of two and their neighbours included) and for 0."""
    from fastgrpo.models.sampling import BELOW

    g = torch.Generator().manual_seed(0)
    uniform = lambda n: torch.rand(n, generator=g, dtype=torch.float64)  # noqa: E731
    x = torch.cat([uniform(10**6) * 4, uniform(10**5) * 1e6, 2.0 ** torch.arange(-60, 60, dtype=torch.float64),
                   torch.tensor([0.0, 1.0, 2.0**-1021])])
    x = torch.cat([x, torch.nextafter(x, torch.full_like(x, math.inf)), torch.nextafter(x, torch.zeros_like(x))])
    x = x[(x == 0) | (x >= 2.0**-1021)]
    want = torch.nextafter(x, torch.zeros_like(x))
    assert torch.equal(x * BELOW, want)
    assert (x[x > 0] * BELOW < x[x > 0]).all()  # a control: the cap is below every positive total
