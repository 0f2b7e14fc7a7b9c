"""Speculative decoding: lossless (greedy and sampled identity with plain decoding, goodness of fit of
sampled tokens to the target), correct KV paths."""

from dataclasses import replace

import pytest
import torch

from fastgrpo.types import SamplingParams, Request
from fastgrpo.trainers.torch_trainer import token_logprobs
from fastgrpo.draft_learning.pretrain import target_states
from fastgrpo.draft_learning.trainer import DraftTrainer
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.engines.embedded.model import KVCache, block_mask, cache_kv
from fastgrpo.models.sampling import sampling_logprobs
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.models.draft import DraftHead
from fastgrpo.engines.embedded.calibrate import load_or_calibrate
from fastgrpo.speculation.cost_model import FURTHER, SWEEP, CostModel, still_flat
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Aware, FastGRPOFormula, Static
from fastgrpo.speculation.tlt import TLT
from fastgrpo.speculation.spec import SpecConfig
from tests.conftest import first_divergence_is_a_near_tie
from tests.test_speculation_policy import linear_costs

VOCAB = 8
PROMPT = [1, 3, 4]


@pytest.fixture(scope="module")
def small_vocab():
    """A target with 8 tokens and peaked distributions, and a random (deliberately poor) draft."""
    cfg = policy_config("test", VOCAB, 64, bos_id=1, eos_id=VOCAB + 1, pad_id=0)
    target = new_policy(cfg, seed=11).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(3.0)  # tied head: sharper, varied next-token distributions
    draft = DraftHead(cfg)
    draft.reset_parameters(seed=5)
    return cfg, target, draft


@pytest.fixture(scope="module")
def trained_draft(small_vocab):
    """A draft trained briefly on the target's own samples: accepted often, far from always."""
    cfg, target, _ = small_vocab
    return train_draft(cfg, target)


@pytest.fixture(scope="module")
def spread_vocab():
    """A target less peaked than small_vocab's (at temperature 0.7 under top-k and top-p, several
    tokens still carry mass), with a draft trained on it: for the distributional test."""
    cfg = policy_config("test", VOCAB, 64, bos_id=1, eos_id=VOCAB + 1, pad_id=0)
    target = new_policy(cfg, seed=11).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(2.0)
    return cfg, target, train_draft(cfg, target)


def train_draft(cfg, target):
    out = engine_for(cfg, target, None).generate([Request(PROMPT)] * 64, SamplingParams(max_new_tokens=40), seed=1)
    hidden, tokens, mask = target_states(target, [PROMPT + o.token_ids for o in out])
    draft = DraftHead(cfg)
    draft.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
    trainer = DraftTrainer(draft, lr=3e-3)
    for _ in range(150):
        trainer.step(hidden, tokens, mask)
    return draft


def engine_for(cfg, target, draft, policy=None, max_batch=64):
    e = EmbeddedEngine(cfg, max_batch, 64, eos_id=VOCAB + 1, pad_id=0, policy=policy)
    e.update_weights(target.state_dict().items(), 0)
    if draft is not None:
        e.update_draft(draft.state_dict().items(), 0)
    return e


def rank_fit_p(logprobs, tokens):
    """P-value that each of `tokens` [n] was drawn from its own distribution `logprobs` [n, V] (given
    everything before it, as tokens of one sequence are).

    Cells are ranks under each draw's distribution (most probable first), pooled from the rare end
    until every cell expects >= 5 draws. S = sum_i (onehot(cell of token i) - p_i(cells)) is a
    martingale under the null, however each distribution depends on earlier draws, with covariance
    C = sum_i (diag(p_i) - p_i p_i^T), so S^T C^-1 S is chi-square with cells - 1 degrees of freedom
    (Pearson's sum of (O - E)^2 / E would overstate the variance when p_i varies). A wrong temperature,
    or a verifier that favours the draft's proposals, moves mass between likely and unlikely ranks."""
    p = logprobs.double().exp()
    order = p.argsort(dim=-1, descending=True, stable=True)
    by_rank = p.gather(-1, order)
    rank = (order == tokens[:, None]).long().argmax(-1)
    cell, cells, pooled = torch.zeros(p.shape[-1], dtype=torch.long), 0, 0.0
    for r, e in reversed(list(enumerate(by_rank.sum(0).tolist()))):
        cell[r], pooled = cells, pooled + e
        if pooled >= 5:
            cells, pooled = cells + 1, 0.0
    if pooled > 0 and cells > 0:  # the most probable ranks left over join the cell below them
        cell[cell == cells] = cells - 1
    else:
        cells += pooled > 0
    in_cell = torch.nn.functional.one_hot(cell, cells).double()
    expected = by_rank @ in_cell  # [n, cells]
    s = (in_cell[rank] - expected).sum(0)[:-1]  # the last cell is implied by the others
    cov = (torch.diag(expected.sum(0)) - expected.T @ expected)[:-1, :-1]
    stat = s @ torch.linalg.solve(cov, s)
    return torch.special.gammaincc(torch.tensor((cells - 1) / 2.0, dtype=torch.float64), stat / 2).item()


def record_verify_steps(engine, monkeypatch) -> dict:
    """Where each token a verify step emits was sampled, keyed by (seed, request, position): (depth of
    its tree node, the node is a leaf, the step's config, an earlier step of this sequence accepted a
    path so its KV cache had been rewritten). The engine's stats only give means, so this wraps its
    verify_tree and _speculate."""
    import fastgrpo.engines.embedded.engine as engine_module

    where, last, rewritten = {}, [], set()
    verify = engine_module.verify_tree

    def recording_verify(logprobs, tree, *args):
        result = verify(logprobs, tree, *args)
        last.append((tree, result))
        return result

    speculate = engine._speculate

    def recording_speculate(running, config, sampling, seed):
        before = [(s, len(s.tokens)) for s in running]
        last.clear()
        out = speculate(running, config, sampling, seed)
        if last:  # not a plain step for a non-finite draft
            tree, result = last.pop()
            B, N = tree.parents.shape
            children = torch.zeros(B, N).scatter_add_(1, tree.parents[:, 1:], torch.ones(B, N - 1))
            nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long), result.path], 1)  # where token k was sampled
            leaf = (children.gather(1, nodes) == 0).tolist()
            for b, (s, n) in enumerate(before):
                for k in range(len(s.tokens) - n):
                    where[(seed, s.index, n + k)] = (k, leaf[b][k], config, (seed, s.index) in rewritten)
                if result.accepted[b] > 0:
                    rewritten.add((seed, s.index))
        return out

    monkeypatch.setattr(engine_module, "verify_tree", recording_verify)
    monkeypatch.setattr(engine, "_speculate", recording_speculate)
    return where


MIXED_PROMPTS = [[1], [1, 2], [1, 7], [1, 3, 4], [1, 6, 2, 3, 3], [1, 5, 5, 6, 7, 2], [1, 4, 2, 6, 3, 5, 7, 2]]


def spec_policy(name):
    if name == "fastgrpo":
        return FastGRPOFormula()
    if name == "aware":
        # costs so far above any step's measured seconds that every measured/predicted ratio clips to
        # Aware's floor of 1e-3, speculative and plain alike, so the choices follow this curve (flat to 512
        # tokens, then linear: at 48 rows, trees of depth 4-6, whose full-depth accepts the test needs; flat
        # to 256, aware took d2k2n4 for most steps), not the machine's load: a plain step priced at 1e5 s clips while it takes
        # under 100 s. (Priced at 100 s, a tree step of 0.3 s on a loaded machine did not clip while plain
        # steps did, so trees looked 2-3x dearer and aware chose shallow ones: 15 deep nodes of 500.)
        grid = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        return Aware(CostModel({t: 1e5 * max(1.0, t / 512) for t in grid}, {t: 1e4 * max(1.0, t / 512) for t in grid}))
    if name == "aware_per_sequence":
        # a verified node costs 1/256 of a plain step, so unlikely nodes are cut (on any predicted gain:
        # margin 0); costs far above any step's seconds, as for aware (larger still: a loaded machine's
        # stalls stay under the clip too)
        grid = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        return AwarePerSequence(CostModel({t: 1e4 * (1 + t / 256) for t in grid}, {t: 1e3 for t in grid}), margin=0.0)
    depth, topk, num_verify = map(int, name.removeprefix("static-").split("-"))
    return Static(SpecConfig(depth, topk, num_verify))


def sampled_tokens(cfg, target, draft, policy, sampling, calls, monkeypatch):
    """Calls of 128 requests (prompts of mixed lengths, 2 to 12 new tokens: the running batch refills
    and drains): every emitted token with the target's logits before it from a full forward over its
    actual prefix, and where a verify step sampled it (record_verify_steps; None: not a verify step)."""
    engine = engine_for(cfg, target, draft, policy, max_batch=48)
    return mixed_calls_scored(engine, target, sampling, calls, record_verify_steps(engine, monkeypatch))


def mixed_calls_scored(engine, target, sampling, calls, where, default=None):
    """`calls` calls of 128 requests of MIXED_PROMPTS (2 to 12 new tokens each) through `engine`: every
    emitted token, the target's logits before it (a full forward over its prefix) and `where`'s entry
    for it, keyed (call seed, request, token index) (`default` where it has none)."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for call in range(calls):
        prompts = torch.randint(len(MIXED_PROMPTS), (128,), generator=g).tolist()
        lengths = torch.randint(2, 13, (128,), generator=g).tolist()
        reqs = [Request(MIXED_PROMPTS[i], max_new_tokens=n) for i, n in zip(prompts, lengths)]
        out = engine.generate(reqs, sampling, seed=1000 + call)
        seqs += [(1000 + call, i, r.prompt_ids, o.token_ids) for i, (r, o) in enumerate(zip(reqs, out))]
    ids = torch.zeros(len(seqs), max(len(p) + len(t) for *_, p, t in seqs), dtype=torch.long)
    rows, positions, found = [], [], []
    for row, (seed, i, prompt, tokens) in enumerate(seqs):
        ids[row, : len(prompt) + len(tokens)] = torch.tensor(prompt + tokens)
        rows += [row] * len(tokens)
        positions += range(len(prompt), len(prompt) + len(tokens))
        found += [where.get((seed, i, j), default) for j in range(len(tokens))]
    with torch.no_grad():
        logits = target(ids).logits[rows, torch.tensor(positions) - 1]  # right-padding is never attended
    return logits, ids[rows, positions], found


@pytest.mark.parametrize("policy, sampling, calls", [  # calls: ~770 verify tokens each, enough for 99% power
    ("static-4-4-16", SamplingParams(temperature=1.0, max_new_tokens=12), 36),  # against the biased temperature
    ("fastgrpo", SamplingParams(temperature=0.7, top_k=5, max_new_tokens=12), 32),  # (by the fit's noncentrality
    ("aware", SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12), 24),  # per token, measured)
    ("static-4-3-10", SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12), 18),
    ("aware_per_sequence", SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12), 24),
], ids=lambda v: f"t{v.temperature}-k{v.top_k}-p{v.top_p}" if isinstance(v, SamplingParams) else str(v))
def test_speculative_tokens_follow_the_target_distribution(spread_vocab, monkeypatch, policy, sampling, calls):
    """Every token a verify step emits is a draw from the target's sampling distribution given the
    tokens before it, wherever in the tree it was sampled. Calls of 128 requests (prompts of mixed
    lengths, lengths of 2 to 12 tokens: the running batch refills and drains, so fastgrpo's and aware's
    trees change) are scored against full forwards over each token's actual prefix: no token outside
    the top-k / top-p set, and the fit holds for all verify tokens, for those sampled at depth >= 2 and
    for the bonus tokens sampled at leaves. The same tokens scored at 1.04 times the temperature (a
    bias of total variation ~0.02) must fail the fit: the test can see a bias that small."""
    speculation = spec_policy(policy)
    logits, tokens, found = sampled_tokens(*spread_vocab, speculation, sampling, calls, monkeypatch)
    if policy == "aware_per_sequence":  # verify blocks were ragged: rows' trees were cut (~45% of the
        # nodes, with any predicted gain cutting: margin 0)
        assert 0.2 < speculation.verified_nodes / speculation.offered_nodes < 0.95
    logprobs = sampling_logprobs(logits, sampling)
    outside = torch.isinf(logprobs.gather(-1, tokens[:, None])[:, 0])
    assert not outside.any(), f"{int(outside.sum())} tokens outside the top-k / top-p set"

    verified = torch.tensor([w is not None for w in found])
    info = [w for w in found if w is not None]
    deep = torch.tensor([w[0] >= 2 for w in info])
    bonus = torch.tensor([w[0] >= 1 and w[1] for w in info])
    # the paths under test were taken, many times: deep nodes after earlier accepted paths rewrote the
    # cache, full-depth accepts of trees of depth >= 3, and (fastgrpo, aware) trees that changed
    assert sum(w[0] >= 2 and w[3] for w in info) >= 500
    assert sum(w[0] == w[2].depth >= 3 for w in info) >= 100
    if policy in ("fastgrpo", "aware", "aware_per_sequence"):
        assert len({w[2] for w in info}) >= 5
    logprobs, tokens = logprobs[verified], tokens[verified]
    assert rank_fit_p(logprobs, tokens) > 1e-3
    assert rank_fit_p(logprobs[deep], tokens[deep]) > 1e-3
    assert rank_fit_p(logprobs[bonus], tokens[bonus]) > 1e-3
    biased = sampling_logprobs(logits[verified], replace(sampling, temperature=1.04 * sampling.temperature))
    assert 0.5 * (biased.exp() - logprobs.exp()).abs().sum(-1).mean() < 0.025  # the bias is small...
    assert rank_fit_p(biased, tokens) < 1e-3  # ...and seen


def test_greedy_speculative_equals_greedy_plain(small_vocab, trained_draft):
    cfg, target, _ = small_vocab
    draft = trained_draft
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(2, VOCAB, (int(n),), generator=g).tolist(), max_new_tokens=m)
            for n, m in [(3, 30), (5, 12), (2, 40), (7, 25), (4, 1), (6, 33)]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, greedy)]
    # a node costs 1/40 of a plain step, and any predicted gain cuts: the budget cuts a third of the nodes
    per_sequence = AwarePerSequence(linear_costs(per_token=0.00025), margin=0.0)
    for policy, max_batch in [(Static(SpecConfig(2, 2, 3)), 2), (Static(SpecConfig(4, 3, 10)), 6),
                              (FastGRPOFormula(), 3), (TLT(), 6), (per_sequence, 6)]:
        engine = engine_for(cfg, target, draft, policy, max_batch)
        assert [c.token_ids for c in engine.generate(reqs, greedy)] == plain
        assert engine.stats()["accept_len"] > 1.0  # paths were accepted, so the KV moves were exercised
    assert 0 < per_sequence.verified_nodes < per_sequence.offered_nodes  # verify blocks were ragged


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, max_new_tokens=40),
                                      SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=40)])
def test_sampled_speculative_equals_sampled_plain(small_vocab, trained_draft, sampling):
    """With noise keyed by (seed, request, position), verification samples each position exactly as
    plain decoding does: the same tokens, except after a float-rounding flip at a CDF boundary. Covers
    deep accepts, trees that change with concurrency (fastgrpo, aware) and prompts of mixed lengths."""
    cfg, target, _ = small_vocab
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(2, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist(),
                    max_new_tokens=int(torch.randint(5, 41, (1,), generator=g))) for _ in range(48)]
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, sampling, seed=9)]
    costs = CostModel({t: 0.01 for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)},
                      {t: 0.001 for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)})  # verify is free: speculate
    for policy, max_batch in [(Static(SpecConfig(4, 3, 10)), 16), (FastGRPOFormula(), 48), (Aware(costs), 48),
                              (AwarePerSequence(linear_costs(per_token=0.001)), 48)]:
        engine = engine_for(cfg, target, trained_draft, policy, max_batch)
        spec = [c.token_ids for c in engine.generate(reqs, sampling, seed=9)]
        # the fixed rules speculate at every step; aware's choices follow the step times it measures on
        # this machine (a loaded one makes speculation pay less), so it is only asked to speculate at all
        assert engine.stats()["spec_steps"] > 0
        assert engine.stats()["accept_len"] > 1.3 or isinstance(policy, Aware)
        same = sum(a == b for a, b in zip(spec, plain))
        assert same >= 44, f"{policy.name}: only {same} of 48 sequences identical"
        for i, (a, b) in enumerate(zip(spec, plain)):
            assert first_divergence_is_a_near_tie(target, reqs[i].prompt_ids, a, b, sampling, 9, i), (policy.name, i)


class EveryKth(Static):
    """Speculates on every k-th decode step and decodes plainly between (as aware's probes do)."""

    def __init__(self, config: SpecConfig, k: int):
        super().__init__(config)
        self.k, self.steps = k, 0

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        self.steps += 1
        return self.config if self.steps % self.k == 0 else None


def test_the_engine_tells_the_policy_the_longest_rows_cached_tokens(small_vocab, trained_draft):
    """The engine's attention reads every row to the longest row's cache, so that is the context a
    policy prices a step at: the prompt, plus every token a step fed (one per plain step, the accepted
    path and the bonus token per speculative step), row by row, while both rows run. Where EOS is ignored
    it also tells each row's tokens left before the step (its budget less what it emitted: the prefill's
    token and each step's), and None where a row may stop sooner."""

    class Recording(EveryKth):
        def __init__(self):
            super().__init__(SpecConfig(3, 2, 5), k=2)
            self.seen = []
            self.left = []

        def tokens_left(self, left):
            self.left.append(left)

        def choose(self, running, context=None):
            self.seen.append(("choose", running, context, self.left[-1]))
            return super().choose(running, context)

        def observe(self, config, running, emitted, seconds, accepted=None):
            self.seen.append(("observe", config, accepted))

    cfg, target, _ = small_vocab
    policy = Recording()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    engine_for(cfg, target, trained_draft, policy, max_batch=2).generate(
        [Request([1, 3, 4], max_new_tokens=30), Request([1, 5, 5, 6, 7, 2], max_new_tokens=30)], greedy)
    cached, left, checked = [3, 6], [29, 29], 0
    for event in policy.seen:
        if event[0] == "choose":
            if event[1] < 2:
                break  # a row finished: rows move
            assert event[2] == max(cached) and event[3] == left
            checked += 1
        else:
            _, config, accepted = event
            fed = [1 if config is None else a + 1 for a in accepted or [0, 0]]
            cached, left = [c + f for c, f in zip(cached, fed)], [n - f for n, f in zip(left, fed)]
    assert checked > 8 and any(e[0] == "observe" and e[1] is not None and max(e[2]) > 0 for e in policy.seen)
    told = len(policy.left)
    engine_for(cfg, target, trained_draft, policy, max_batch=2).generate(
        [Request([1, 3, 4], max_new_tokens=30)], SamplingParams(temperature=0.0, max_new_tokens=30))
    assert len(policy.left) > told and all(left is None for left in policy.left[told:])


def test_draft_catch_up_after_plain_steps_feeds_only_a_window(small_vocab, trained_draft):
    """After a stretch of plain steps the draft consumes at most `draft_window` states per row, and
    the output is still exactly the plain engine's (greedy), with paths still accepted."""
    cfg, target, _ = small_vocab
    reqs = [Request(p, max_new_tokens=m) for p, m in [(PROMPT, 40), ([1, 2], 30), ([1, 5, 5, 6, 7], 35)]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, greedy)]
    engine = engine_for(cfg, target, trained_draft, EveryKth(SpecConfig(3, 2, 5), k=6), max_batch=2)
    engine.draft_window = 3
    widths = []
    features = engine.draft.features

    def recording(hidden, *args):
        widths.append(hidden.shape[1])
        return features(hidden, *args)

    engine.draft.features = recording
    assert [c.token_ids for c in engine.generate(reqs, greedy)] == plain
    assert engine.stats()["accept_len"] > 1.0
    assert widths and max(widths) <= 3  # catch-ups and tree levels (topk 2) alike


def test_a_draft_swapped_in_mid_rollout_catches_up_instead_of_reading_the_old_drafts_cache(
        small_vocab, trained_draft, monkeypatch):
    """A new draft version installed between decode steps starts from the rows' target states, not from
    the cache the previous version wrote: its first prediction equals a fresh forward of the new draft
    over each row's whole history (captured from the same rollout)."""
    import fastgrpo.engines.embedded.engine as engine_module

    cfg, target, poor_draft = small_vocab
    reqs = [Request(p, max_new_tokens=30) for p in (PROMPT, [1, 2], [1, 5, 5, 6, 7])]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    engine = engine_for(cfg, target, poor_draft, Static(SpecConfig(3, 2, 5)))
    engine.draft_window = 64  # the catch-up after the swap may feed the whole history
    polls = iter(range(10_000))
    engine.draft_source = lambda: (trained_draft.state_dict().items(), 1) if next(polls) == 6 else None
    roots = []
    draft_tree = engine_module.draft_tree

    def recording(draft, cache, rows, root_features, *args):
        roots.append((engine.draft_version, engine.cache.lengths[rows].clone(), root_features.clone()))
        return draft_tree(draft, cache, rows, root_features, *args)

    monkeypatch.setattr(engine_module, "draft_tree", recording)
    out = engine.generate(reqs, greedy, capture=True)
    version, lengths, root = next(r for r in roots if r[0] == 1)  # the first step after the swap
    assert roots[0][0] == 0 and lengths.min() >= 8  # the swap came after the old version wrote its cache
    for b, (req, o) in enumerate(zip(reqs, out)):
        assert torch.allclose(root[b], fresh_root(cfg, trained_draft, req, o, int(lengths[b])), atol=1e-4), b


def fresh_root(cfg, draft, request, completion, length):
    """The draft's prediction at the token after `length` cached positions of a finished request,
    from a forward over its whole history (the target states captured by the same rollout)."""
    history = torch.tensor(request.prompt_ids + completion.token_ids)
    positions = torch.arange(length)[None]
    with torch.inference_mode():
        fresh = draft.features(completion.hidden[None, :length], history[None, 1 : length + 1], positions,
                               block_mask(torch.tensor([0]), length, length, None),
                               cache_kv(KVCache(cfg, 1, 64, layers=1), 0, slice(0, 1), positions, length))
    return fresh[0, length - 1]


def test_the_draft_sees_every_state_of_plain_steps_prefills_and_retired_rows(small_vocab, trained_draft, monkeypatch):
    """Plain steps hand their target states to the draft lazily (written when rows change or the draft
    needs them): at every speculative step, in a batch where rows finish, move and are refilled by a
    later prefill, each row's draft prediction equals a fresh forward over that request's history."""
    import fastgrpo.engines.embedded.engine as engine_module

    cfg, target, _ = small_vocab
    prompts = [PROMPT, [1, 2], [1, 5, 5, 6, 7], [1, 6], [1, 4, 4], [1, 7, 2, 3]]
    reqs = [Request(p, max_new_tokens=m) for p, m in zip(prompts, (14, 30, 25, 20, 17, 11))]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    engine = engine_for(cfg, target, trained_draft, EveryKth(SpecConfig(2, 2, 3), k=4), max_batch=3)
    engine.draft_window = 64  # every state is fed, so the draft's cache must hold each row's whole history
    steps = []
    speculate, draft_tree = engine._speculate, engine_module.draft_tree

    def recording_step(running, *args):
        steps.append([s.index for s in running])
        return speculate(running, *args)

    def recording_tree(draft, cache, rows, root_features, *args):
        steps[-1] = (steps[-1], engine.cache.lengths[rows].clone(), root_features.clone())
        return draft_tree(draft, cache, rows, root_features, *args)

    monkeypatch.setattr(engine, "_speculate", recording_step)
    monkeypatch.setattr(engine_module, "draft_tree", recording_tree)
    out = engine.generate(reqs, greedy, capture=True)
    assert len(steps) >= 6 and {i for which, _, _ in steps for i in which} == set(range(len(reqs)))
    for which, lengths, roots in steps:
        for b, i in enumerate(which):
            assert torch.allclose(roots[b], fresh_root(cfg, trained_draft, reqs[i], out[i], int(lengths[b])),
                                  atol=1e-4), (which, b)


def test_a_windowed_draft_row_ignores_what_came_before_the_window(small_vocab, trained_draft):
    """Keys before `visible_from` are invisible: the draft's output over a window equals its output
    over the same states in a fresh cache, whatever the skipped slots hold."""
    cfg, _, _ = small_vocab
    draft = trained_draft
    g = torch.Generator().manual_seed(2)
    hidden, tokens = torch.randn(1, 4, cfg.hidden_size, generator=g), torch.randint(0, VOCAB, (1, 4), generator=g)
    positions = torch.arange(10, 14)[None]

    def window_features(cache: KVCache) -> torch.Tensor:
        cache.visible_from[0] = 10
        mask = block_mask(torch.tensor([10]), 4, 14, None, cache.visible_from[:1])
        return draft.features(hidden, tokens, positions, mask, cache_kv(cache, 0, slice(0, 1), positions, 14))

    stale = KVCache(cfg, 1, 32, layers=1)
    stale.k.normal_(generator=g), stale.v.normal_(generator=g)
    fresh = KVCache(cfg, 1, 32, layers=1)
    with torch.inference_mode():
        assert torch.allclose(window_features(stale), window_features(fresh), atol=1e-6)
        stale.visible_from[0] = 0
        mask = block_mask(torch.tensor([10]), 4, 14, None)
        unmasked = draft.features(hidden, tokens, positions, mask, cache_kv(stale, 0, slice(0, 1), positions, 14))
    assert not torch.allclose(unmasked, window_features(fresh), atol=1e-3)  # the stale slots did matter


def test_accepted_path_cache_gives_full_forward_logprobs(small_vocab, trained_draft):
    """Every emitted token's log-probability from the speculative engine (computed over a cache
    rebuilt from accepted paths) equals a fresh full forward's."""
    cfg, target, _ = small_vocab
    draft = trained_draft
    engine = engine_for(cfg, target, draft, Static(SpecConfig(3, 3, 8)), max_batch=4)
    prompts = [PROMPT, [1, 2], [1, 5, 5, 6, 7], [1, 7, 2, 3]] * 2
    out = engine.generate([Request(p) for p in prompts], SamplingParams(temperature=1.0, max_new_tokens=40), seed=3)
    assert engine.stats()["accept_len"] > 1.2
    batch = build_batch(prompts, [o.token_ids for o in out], [o.logprobs for o in out], torch.zeros(8), pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(target, batch, SamplingParams(temperature=1.0))
    m = batch.response_mask
    assert (lp[m] - batch.engine_logprobs[m]).abs().max() < 1e-4


def test_fastgrpo_formula_is_guarded():
    f = FastGRPOFormula()
    assert f.choose(1) == SpecConfig(depth=5, topk=8, num_verify=160)
    assert f.choose(16) == SpecConfig(depth=3, topk=8, num_verify=10)
    assert f.choose(80) == SpecConfig(depth=3, topk=1, num_verify=2)
    assert f.choose(81) is None and f.choose(200) is None  # the original breaks (k = 0) / crashes here


def test_fastgrpo_policy_runs_200_sequences(small_vocab):
    cfg, target, draft = small_vocab
    engine = engine_for(cfg, target, draft, FastGRPOFormula(), max_batch=200)
    out = engine.generate([Request(PROMPT)] * 200, SamplingParams(temperature=1.0, max_new_tokens=12), seed=0)
    assert len(out) == 200 and all(len(o.token_ids) == 12 for o in out)
    buckets = engine.stats()["config_by_concurrency"]
    assert buckets[">128"] == {"off": 11}  # 200 running: plain decoding (token 1 comes from the prefill)


def test_bad_drafts_fall_back_or_fail_clearly(small_vocab):
    cfg, target, draft = small_vocab
    engine = engine_for(cfg, target, draft, Static(SpecConfig(3, 3, 8)), max_batch=4)
    wrong = {k: torch.zeros(3, 3) if k == "fc" else v for k, v in draft.state_dict().items()}
    with pytest.raises(ValueError, match="does not match"):
        engine.update_draft(wrong.items(), 1)
    nan_draft = {k: torch.full_like(v, float("nan")) if k == "norm" else v for k, v in draft.state_dict().items()}
    engine.update_draft(nan_draft.items(), 2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    plain = engine_for(cfg, target, None).generate([Request(PROMPT)], greedy)[0].token_ids
    assert engine.generate([Request(PROMPT)], greedy)[0].token_ids == plain


def test_cost_model_calibrates_and_caches(small_vocab, tmp_path, monkeypatch):
    cfg, target, draft = small_vocab
    engine = engine_for(cfg, target, draft)
    costs = load_or_calibrate(engine.model, engine.draft, tmp_path)
    for curve in (costs.target_s, costs.draft_s):
        assert all(v > 0 for v in curve.values()) and set(SWEEP) <= set(curve)
        # past SWEEP, each further point was swept because the curve before it was still flat, and the
        # sweep stopped at the first point where it was not (or at the last of FURTHER)
        points = sorted(curve)
        assert points == sorted(SWEEP) + list(FURTHER[: len(points) - len(SWEEP)])
        for i in range(len(SWEEP), len(points)):
            assert still_flat({t: curve[t] for t in points[:i]})
        assert len(points) == len(SWEEP) + len(FURTHER) or not still_flat(curve)
    assert costs.target(10_000) > costs.target(1)  # extrapolates the compute-bound slope
    cached = list(tmp_path.iterdir())  # the cache alone: its partial write renamed onto it
    assert len(cached) == 1 and cached[0].name.startswith("cost_model-") and cached[0].suffix == ".json"
    again = load_or_calibrate(engine.model, engine.draft, tmp_path)
    assert again.target_s == costs.target_s  # read from the cache, not re-measured
    # the same folder on a machine whose CPU kernels use another instruction set: measured there anew
    isa = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2" if isa != "AVX2" else "AVX512")
    elsewhere = load_or_calibrate(engine.model, engine.draft, tmp_path)
    assert len(list(tmp_path.iterdir())) == 2 and elsewhere.target_s != costs.target_s


def test_every_configured_policy_name_builds_that_policy():
    """The config's policy names, the registry and each class's own name are one list."""
    from typing import get_args

    from fastgrpo.config import SpeculationConfig, SpeculationPolicyName
    from fastgrpo.speculation.registry import CALIBRATED, POLICIES, make_policy

    assert set(get_args(SpeculationPolicyName)) == set(POLICIES)
    for name in POLICIES:
        costs = CostModel({t: 0.01 * (1 + t / 64) for t in (1, 4, 16, 64, 256)}, {t: 0.001 for t in (1, 4, 16, 64, 256)})
        policy = make_policy(SpeculationConfig(policy=name), costs if name in CALIBRATED else None)
        assert policy.name == name
    with pytest.raises(ValueError, match="needs a calibrated cost model"):
        make_policy(SpeculationConfig(policy="aware"))


def test_the_extrapolation_tool_prices_past_512_tokens_as_the_cost_model_does():
    """tools/forward_extrapolation.py at test size: its cost-model price of 768 tokens is the line through the
    swept 256 and 512 points, its other price the 512 point's cost per token, both against a measured time."""
    from tools.forward_extrapolation import main

    (row,) = main(["--size", "test", "--larger", "768", "--rounds", "1", "--reps", "1", "--threads", "1"])
    s256, s512 = row["swept_s"][256], row["swept_s"][512]
    assert row["segment_s"] == pytest.approx(s512 + (s512 - s256) * (768 - 512) / 256)
    assert row["origin_s"] == pytest.approx(s512 * 1.5) and row["measured_s"] > 0
    assert row["segment_error"] == pytest.approx(row["segment_s"] / row["measured_s"] - 1)
    with pytest.raises(SystemExit):
        main(["--larger", "500"])
