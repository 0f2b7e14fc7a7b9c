"""Static decode steps (engines/embedded/steps.py): the same tokens and log-probabilities as the eager
engine across padding, buckets, trees, stops and a mixture of experts; no host sync or host-to-device
copy inside a step function; op budgets; CUDA graphs where there is a GPU."""

import time

import pytest
import torch

from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.engines.embedded.graphs import HostSync, StepAudit
from fastgrpo.engines.embedded.steps import batch_bucket, context_bucket
from fastgrpo.engines.embedded.tree import Tree, ancestor_mask, verify_tree
from fastgrpo.grpo.report import rollout_stats
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.models.sampling import sampling_logprobs
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import Request, SamplingParams
from tests.conftest import first_divergence_is_a_near_tie
from tests.test_families import trained_draft
from tests.test_moe_engine import hf_model, qwen3_moe

VOCAB, EOS = 61, 2
STOPS = (EOS, 5, 7, 11)  # several stop ids: sequences end at a stop now and then, mid-path under speculation
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=28)
SAMPLINGS = {"greedy": GREEDY, "t1": SamplingParams(temperature=1.0, max_new_tokens=28),
             "t0.7-cut": SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=28)}
TREES = [SpecConfig(1, 1, 2), SpecConfig(3, 2, 6), SpecConfig(4, 4, 12), SpecConfig(6, 8, 32)]


@pytest.fixture(scope="module")
def dense():
    """A tiny Llama target with peaked distributions, and a draft trained on its greedy continuations
    (accepted often)."""
    cfg = policy_config("test", VOCAB, 128, bos_id=1, eos_id=EOS, pad_id=0)
    target = new_policy(cfg, seed=3).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(3.0)
    return cfg, target, trained_draft(cfg, target, prompts(7, seed=5) + prompts(5, seed=7) + prompts(5, seed=1))


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(cfg, target, static, draft=None, policy=None, max_batch=6):
    e = EmbeddedEngine(cfg, max_batch, 128, eos_id=STOPS, pad_id=0, policy=policy, static_steps=static)
    e.update_weights(target.state_dict().items(), version=0)
    if draft is not None:
        e.update_draft(draft.state_dict().items(), version=0)
    return e


def assert_same(model, ps, a, b, sampling, seed):
    """Same tokens (or a first difference that is a float-rounding flip at a CDF boundary), same finish
    reasons, log-probabilities within 1e-5 wherever the tokens agree, same sampling sets."""
    for i, (p, x, y) in enumerate(zip(ps, a, b)):
        assert first_divergence_is_a_near_tie(model, p, x.token_ids, y.token_ids, sampling, seed, i), (i, x.token_ids, y.token_ids)
        if x.token_ids == y.token_ids:
            assert x.finish_reason == y.finish_reason
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
            assert x.sample_sets == y.sample_sets


def test_buckets_are_the_ladder():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 100, 256, 257)] == \
        [1, 2, 4, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 384]
    assert [context_bucket(n, 10_000) for n in (1, 64, 65, 129, 200, 257, 385, 600)] == [64, 64, 128, 256, 256, 384, 512, 768]
    assert context_bucket(570, 580) == 580  # never past the cap (the ladder says 768)
    with pytest.raises(ValueError, match="more than the cap"):
        context_bucket(600, 599)
    with pytest.raises(ValueError, match="at least one"):
        batch_bucket(0)


def test_the_stats_count_padded_rows_and_the_cache_positions_read_beyond_each_rows_own(dense):
    """Three rows of 10, 20 and 30 prompt tokens, 5 tokens each (stops ignored), plain steps: the prefill
    emits each row's first token, then 4 decode steps (k = 0..3) run all three. By hand: a static step
    runs 4 rows (3's bucket), one of 4 token slots padded; each row reads the 64 positions of the longest
    row's bucket (30 + k cached, 1 new), 4 x 64 a step; an eager step reads 3 rows to the longest's
    31 + k. The rows need their own (10 + 20 + 30 + 3k) + 3 positions: 270 over the 4 steps."""
    cfg, target, _ = dense
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)
    requests = [Request(list(range(3, 3 + n)), max_new_tokens=5) for n in (10, 20, 30)]
    needed = 4 * 63 + 3 * (0 + 1 + 2 + 3)
    for static, read, steps, rows_padded in ((True, 4 * 4 * 64, 4, 1 / 4), (False, 3 * (31 + 32 + 33 + 34), 0, 0.0)):
        e = engine(cfg, target, static)
        assert all(len(c.token_ids) == 5 for c in e.generate(requests, sampling, seed=1))
        stats = e.stats()
        assert (stats["decode_steps"], stats["static_steps"]) == (4, steps)
        assert stats["pad_row_share"] == rows_padded
        assert stats["pad_kv_share"] == pytest.approx(1 - needed / read, abs=1e-12)
        assert (stats["positions_read"], stats["positions_needed"]) == (read, needed)
        # the run's per-step artifact keeps them (an engine that reports none, SGLang, leaves them out)
        assert rollout_stats(stats)["pad_kv_share"] == stats["pad_kv_share"]
        assert "pad_kv_share" not in rollout_stats({k: v for k, v in stats.items() if "pad" not in k})


@pytest.mark.parametrize("name", SAMPLINGS)
def test_static_plain_steps_equal_eager_ones(dense, name):
    """Nine requests through six rows: the batch shrinks through 6, 5, 4, ... (padded to 6, 6, 4, 4, 2, 1)
    and rows move as sequences stop at EOS or the limit."""
    cfg, target, _ = dense
    sampling, ps = SAMPLINGS[name], prompts(9, seed=2)
    eager = engine(cfg, target, False).generate([Request(p) for p in ps], sampling, seed=4)
    static = engine(cfg, target, True).generate([Request(p) for p in ps], sampling, seed=4)
    assert_same(target, ps, static, eager, sampling, 4)
    assert any(o.finish_reason == "stop" for o in eager) and any(o.finish_reason == "length" for o in eager)


@pytest.mark.parametrize("tree", TREES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", ["greedy", pytest.param("t1", marks=pytest.mark.slow),
                                  pytest.param("t0.7-cut", marks=pytest.mark.slow)])  # sampled: ~30 s, slow tier
def test_static_speculative_steps_equal_eager_ones_and_plain_decoding(dense, tree, name):
    cfg, target, draft = dense
    sampling, ps = SAMPLINGS[name], prompts(7, seed=5)
    requests = [Request(p) for p in ps]
    off = engine(cfg, target, False).generate(requests, sampling, seed=9)
    eager_engine = engine(cfg, target, False, draft, Static(tree))
    eager = eager_engine.generate(requests, sampling, seed=9)
    static_engine = engine(cfg, target, True, draft, Static(tree))
    static = static_engine.generate(requests, sampling, seed=9)
    assert_same(target, ps, static, eager, sampling, 9)
    assert_same(target, ps, static, off, sampling, 9)
    # the same trees accepted alike: the static step verified what the eager one did
    assert static_engine.stats()["spec_steps"] > 0
    assert abs(static_engine.stats()["accept_len"] - eager_engine.stats()["accept_len"]) < 0.05
    if name == "greedy" and tree.depth > 1:
        assert static_engine.stats()["accept_len"] > 1.5  # accepted paths longer than one node were kept


@pytest.mark.parametrize("tree", [SpecConfig(1, 1, 2), SpecConfig(4, 4, 12)], ids=lambda c: c.name)
def test_a_static_step_with_a_non_finite_draft_verifies_roots_alone(dense, tree):
    """A draft whose states are NaN cannot raise inside a static step: each row verifies its root alone,
    so the tokens are plain decoding's and nothing is accepted past the root."""
    cfg, target, draft = dense
    requests = [Request(p) for p in prompts(5, seed=11)]
    off = engine(cfg, target, False).generate(requests, GREEDY, seed=3)
    static_engine = engine(cfg, target, True, draft, Static(tree))
    static_engine.update_draft([(k, torch.full_like(v, float("nan")) if k == "norm" else v)
                                for k, v in draft.state_dict().items()], version=1)
    static = static_engine.generate(requests, GREEDY, seed=3)
    assert [o.token_ids for o in static] == [o.token_ids for o in off]
    stats = static_engine.stats()
    assert stats["spec_steps"] > 0 and stats["accept_len"] == 1.0


def test_static_steps_capture_the_states_eager_steps_capture(dense):
    """Online draft learning reads the target's states of every position from a generate(capture=True)."""
    cfg, target, draft = dense
    ps = prompts(5, seed=7)
    sampling = SAMPLINGS["t1"]
    a = engine(cfg, target, False, draft, Static(SpecConfig(4, 4, 12))).generate([Request(p) for p in ps], sampling, 3, capture=True)
    b = engine(cfg, target, True, draft, Static(SpecConfig(4, 4, 12))).generate([Request(p) for p in ps], sampling, 3, capture=True)
    for p, x, y in zip(ps, a, b):
        assert x.token_ids == y.token_ids
        assert x.hidden.shape == y.hidden.shape == (len(p) + len(x.token_ids) - 1, cfg.hidden_size)
        assert torch.allclose(x.hidden, y.hidden, atol=1e-5)


@pytest.fixture(scope="module")
def moe():
    cfg = qwen3_moe()
    return cfg, hf_model(cfg)


def test_a_mixture_of_experts_steps_statically_as_eagerly(moe):
    """Static steps run every expert (dense_experts): the same tokens and log-probabilities as the routed
    eager step, plain and speculative."""
    cfg, hf = moe
    ps = prompts(5, seed=3)
    draft = trained_draft(cfg, hf, ps)
    for policy in (None, Static(SpecConfig(3, 2, 6))):
        runs = []
        for static in (False, True):
            e = EmbeddedEngine(cfg, 4, 128, eos_id=EOS, pad_id=0, policy=policy, static_steps=static)
            e.update_weights(hf.state_dict().items(), version=0)
            e.update_draft(draft.state_dict().items(), version=0)
            runs.append(e.generate([Request(p) for p in ps], SAMPLINGS["t1"], seed=2))
        assert_same(hf, ps, runs[1], runs[0], SAMPLINGS["t1"], 2)


def audited(e: EmbeddedEngine) -> list[tuple[object, StepAudit]]:
    """Every static step of `e` runs inside a strict audit; returns (step key, audit) per step."""
    audits = []
    run = e.graphs.run

    def run_audited(key, step):
        e.graphs.audit = StepAudit()
        audits.append((key, e.graphs.audit))
        try:
            return run(key, step)
        finally:
            e.graphs.audit = None

    e.graphs.run = run_audited
    return audits


@pytest.mark.parametrize("name", ["t0.7-cut", "greedy"])
def test_no_step_function_syncs_or_copies_host_data(dense, moe, name):
    """A step captured as a CUDA graph must not read values back or build tensors from host data: the
    strict audit raises on either. Dense plain and speculative steps and a MoE step (with and without
    recording its routing) pass it."""
    cfg, target, draft = dense
    for e in (engine(cfg, target, True, draft, Static(SpecConfig(4, 4, 12))), engine(cfg, target, True, draft)):
        audits = audited(e)
        e.generate([Request(p) for p in prompts(5, seed=1)], SAMPLINGS[name], seed=1)
        assert audits and all(not a.violations for _, a in audits)
    moe_cfg, hf = moe
    e = EmbeddedEngine(moe_cfg, 4, 128, eos_id=EOS, pad_id=0, static_steps=True)
    e.update_weights(hf.state_dict().items(), version=0)
    for routing in (False, True):  # with routing replay's record too
        audits = audited(e)
        e.generate([Request(p) for p in prompts(3, seed=1)], SAMPLINGS[name], seed=1, routing=routing)
        assert audits and all(not a.violations for _, a in audits)


def test_the_audit_catches_what_the_eager_step_does(dense):
    """The control: the eager plain step (its Python token lists, `.tolist()`, the context read back) fails
    the same audit, so a passing static step is not an audit that sees nothing."""
    cfg, target, _ = dense
    e = engine(cfg, target, False)
    audit = StepAudit(strict=False)
    decode = e._decode

    def audited_decode(*args):
        with audit:
            return decode(*args)

    e._decode = audited_decode
    e.generate([Request(p) for p in prompts(3, seed=1)], SAMPLINGS["t1"], seed=1)
    assert any("tolist" in v for v in audit.violations)
    assert any("lift_fresh" in v for v in audit.violations)  # torch.tensor of the pending tokens
    with pytest.raises(HostSync, match="sync with the host"), StepAudit():
        int(torch.arange(3).max())


def test_op_budgets_per_step(dense):
    """Ops a static step dispatches (every aten call, views included), at two depths of the same model: a
    plain step within 155 + 67 per layer, a d4k4n12 speculative step within 770 + 67 per layer (measured:
    150 + 61 and 754 + 61, of which ~6 a layer are the views that group the query heads for attention;
    on a GPU each op that is not a view is a kernel of the step's graph). Three ops per layer more, or an
    op per row or per node, break these."""
    cfg, target, draft = dense
    counts = {}
    for layers in (2, 4):
        c = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": layers})
        t = new_policy(c, seed=1).eval()
        for policy in (None, Static(SpecConfig(4, 4, 12))):
            e = engine(c, t, True, draft, policy)
            audits = audited(e)
            e.generate([Request(p) for p in prompts(4, seed=1)], SAMPLINGS["t1"], seed=1)
            counts[(layers, policy is None)] = max(a.total for _, a in audits)
    per_layer_plain = (counts[(4, True)] - counts[(2, True)]) / 2
    per_layer_spec = (counts[(4, False)] - counts[(2, False)]) / 2
    print(f"\nops: plain {counts[(2, True)]} at 2 layers (+{per_layer_plain:.0f}/layer), "
          f"d4k4n12 {counts[(2, False)]} (+{per_layer_spec:.0f}/layer)")
    assert per_layer_plain <= 67 and counts[(2, True)] - 2 * per_layer_plain <= 155
    assert per_layer_spec <= 67 and counts[(2, False)] - 2 * per_layer_spec <= 770


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_replay_the_static_steps(dense):
    cfg, target, draft = dense
    ps = prompts(9, seed=2)
    runs = []
    for graphs in (False, True):
        e = EmbeddedEngine(cfg, 6, 128, eos_id=EOS, pad_id=0, policy=Static(SpecConfig(4, 4, 12)), device="cuda",
                           static_steps=True, graphs=graphs)
        e.update_weights(target.state_dict().items(), version=0)
        e.update_draft(draft.state_dict().items(), version=0)
        runs.append(e.generate([Request(p) for p in ps], SAMPLINGS["t1"], seed=4))
    assert e.graphs.captures > 0 and e.graphs.replays > e.graphs.captures
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
    # the captures' seconds are the call's, apart; a second call of the same keys captures nothing
    first = e.stats()["capture_s"]
    assert 0 < first == e.graphs.capture_s < e.stats()["seconds"]
    e.generate([Request(p) for p in ps], SAMPLINGS["t1"], seed=4)
    assert e.stats()["capture_s"] == 0.0 and e.graphs.capture_s == first


def host_time_tool(*args: str) -> list[dict]:
    """tools/step_host_time.py at 2 and 8 running rows, two calls each (the tool times one thread: the test's
    thread count is put back)."""
    from tools.step_host_time import main

    threads = torch.get_num_threads()
    try:
        rows = main([*args, "--running", "2,8", "--reps", "2"])
    finally:
        torch.set_num_threads(threads)
    assert [r["running"] for r in rows] == [2, 8]
    return rows


def test_the_host_time_tool_reports_each_level():
    """tools/step_host_time.py (the host work a static step costs outside the step function) at a small size."""
    rows = host_time_tool("--tokens", "6")
    for r in rows:
        assert r["host_ms_per_step"] > 0 and r["host_us_per_row"] == pytest.approx(1e3 * r["host_ms_per_step"] / r["running"])


@pytest.mark.parametrize("rows", [1, 5, 31, 32, 100])
def test_a_packed_step_reads_back_the_same_by_rows_or_by_columns(rows):
    """StepResult.unpack reads few rows entry by entry and many by columns (through numpy): each reading of a
    packed [B, 3 L + 1] result is its columns as written (tokens and path as ints, accepted as int, finite)."""
    from fastgrpo.engines.embedded.steps import StepResult, pack

    g = torch.Generator().manual_seed(rows)
    L = 4
    tokens, path = torch.randint(0, 150_000, (rows, L), generator=g), torch.randint(0, 40, (rows, L - 1), generator=g)
    logprobs = -torch.rand(rows, L, generator=g, dtype=torch.float64) * 20
    accepted, finite = torch.randint(0, L, (rows,), generator=g), torch.rand(rows, generator=g) > 0.3
    r = StepResult.unpack(pack(tokens, logprobs, path, accepted, finite), L)
    assert r.tokens == tokens.tolist() and r.path == path.tolist() and r.accepted == accepted.tolist()
    assert r.logprobs == logprobs.tolist() and r.finite == finite.tolist()
    assert all(type(x) is int for row in r.tokens for x in row) and all(type(x) is bool for x in r.finite)


@pytest.mark.parametrize("name", ["greedy", "t1", "t0.7-k5-p0.9"])
def test_a_verify_that_samples_every_node_first_walks_the_same_path(name):
    """verify_tree's two ways (`at_once`: every node sampled first, each with its depth's noise; or the
    current node's at each level) emit the same tokens, log-probabilities and paths on random trees whose
    children often hold the target's sample (a vocabulary of 3), restricted trees included."""
    sampling = {"greedy": SamplingParams(temperature=0.0), "t1": SamplingParams(temperature=1.0),
                "t0.7-k5-p0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9)}[name]
    g = torch.Generator().manual_seed(3)
    B, N, D, V = 64, 12, 4, 3
    depth, parents = torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N, dtype=torch.long)
    for i in range(1, N):  # each node under a random earlier one no deeper than D - 1
        for b in range(B):
            options = [j for j in range(i) if depth[b, j] < D]
            parents[b, i] = options[int(torch.randint(len(options), (1,), generator=g))]
            depth[b, i] = depth[b, parents[b, i]] + 1
    tree = Tree(torch.randint(V, (B, N), generator=g), parents, depth, ancestor_mask(parents, D))
    tree = tree.restricted(torch.rand(B, N - 1, generator=g) < 0.9) if name == "t1" else tree
    logprobs = sampling_logprobs(3 * torch.randn(B, N, V, generator=g), sampling)
    u = None if sampling.greedy else torch.rand(B, D + 1, generator=g, dtype=torch.float64)
    walked, at_once = (verify_tree(logprobs, tree, sampling, u, depth=D, at_once=a) for a in (False, True))
    assert torch.equal(walked.accepted, at_once.accepted)
    for b, a in enumerate(walked.accepted.tolist()):
        assert walked.tokens[b, : a + 1].tolist() == at_once.tokens[b, : a + 1].tolist()
        assert walked.logprobs[b, : a + 1].tolist() == at_once.logprobs[b, : a + 1].tolist()
        assert walked.path[b, :a].tolist() == at_once.path[b, :a].tolist()
    assert walked.accepted.sum() >= B // 2 and (walked.accepted >= 2).sum() >= 5  # the walks went deep


def test_a_step_that_captures_its_graph_is_not_priced(dense, monkeypatch):
    """A CUDA graph's capture runs its step eagerly and records it (tens of replays' time): the engine
    hands the policy no time for that step, only its tokens, and the time of every other step. Captures
    are simulated on this CPU (a new key counts one and takes 50 ms more); each key's first step is the
    one given no time."""
    cfg, target, draft = dense

    class Recording(Static):
        def __init__(self):
            super().__init__(SpecConfig(3, 2, 6))
            self.seen = []

        def choose(self, running, context=None):
            return None if len(self.seen) % 3 == 0 else self.config  # plain and tree steps, both captured

        def observe(self, config, running, emitted, seconds, accepted=None):
            self.seen.append((config, seconds, accepted))

    policy = Recording()
    e = engine(cfg, target, True, draft, policy)
    run, keys, first_calls = e.graphs.run, set(), []

    def capturing(key, step):
        new = key not in keys
        keys.add(key)
        first_calls.append(new)
        if new:  # what a capture adds: a count, and time
            e.graphs.captures += 1
            time.sleep(0.05)
        return run(key, step)

    monkeypatch.setattr(e.graphs, "run", capturing)
    e.generate([Request(p, max_new_tokens=20) for p in prompts(4, seed=2)], GREEDY)
    assert len(first_calls) == len(policy.seen) and 2 <= sum(first_calls) < len(first_calls)
    assert [seconds is None for _, seconds, _ in policy.seen] == first_calls
    assert all(accepted is not None for config, _, accepted in policy.seen if config is not None)  # tokens learned


def test_each_static_step_calls_the_policys_ahead_while_it_waits_for_the_step(dense):
    """A static step calls the policy's `ahead` once, between the step's choice and its observation, with
    the step's running rows, context and tree (on a GPU the device is computing the step then); an eager
    step never does (it leaves the host no wait to fill). The tokens are those of a policy without it."""
    cfg, target, draft = dense

    class Recording(Static):
        def __init__(self):
            super().__init__(SpecConfig(3, 2, 6))
            self.calls = []

        def choose(self, running, context=None):
            config = None if len(self.calls) % 9 == 0 else self.config  # plain and tree steps
            self.calls.append(("choose", running, context, config))
            return config

        def ahead(self, running, context=None, config=None):
            self.calls.append(("ahead", running, context, config))

        def observe(self, config, running, emitted, seconds, accepted=None):
            self.calls.append(("observe", running, None, config))

    class Without(Recording):
        ahead = None  # (how the engine tells a policy without it)

    requests = [Request(p, max_new_tokens=20) for p in prompts(4, seed=2)]
    policy, eager = Recording(), Recording()
    e = engine(cfg, target, True, draft, policy)
    tokens = [c.token_ids for c in e.generate(requests, GREEDY)]
    assert e.stats()["ahead_s"] > 0 and e.stats()["wait_s"] == 0  # (a CPU's step is done by then)
    kinds = [call[0] for call in policy.calls]
    assert kinds == ["choose", "ahead", "observe"] * (len(kinds) // 3) and len(kinds) >= 9
    for choose, ahead, observe in zip(*[iter(policy.calls)] * 3):
        assert ahead[1:] == choose[1:] and observe[1] == choose[1] and observe[3] == choose[3]
    assert {call[3] for call in policy.calls} == {None, policy.config}
    assert tokens == [c.token_ids for c in engine(cfg, target, True, draft, Without()).generate(requests, GREEDY)]

    engine(cfg, target, False, draft, eager).generate(requests, GREEDY)
    kinds = [call[0] for call in eager.calls]
    assert "ahead" not in kinds and kinds == ["choose", "observe"] * (len(kinds) // 2) and len(kinds) >= 6


def test_the_engine_counts_the_policys_own_host_time(dense):
    """`policy_s`: the seconds of the policy's `choose` and `observe` (not its `ahead`, counted apart), so that
    a run reads what an adaptive policy's host work costs it: a policy that waits 2 ms in each shows at
    least 4 ms a step, and the same policy without the waits well under 1 ms a step."""
    cfg, target, draft = dense

    class Slow(Static):
        def __init__(self, wait):
            super().__init__(SpecConfig(3, 2, 6))
            self.wait, self.steps = wait, 0

        def choose(self, running, context=None):
            time.sleep(self.wait)
            self.steps += 1
            return self.config if self.steps % 2 else None

        def observe(self, config, running, emitted, seconds, accepted=None):
            time.sleep(self.wait)

        def ahead(self, running, context=None, config=None):
            time.sleep(0.01)  # (ahead_s's, not policy_s's)

    requests = [Request(p, max_new_tokens=12) for p in prompts(3, seed=4)]
    for wait in (0.002, 0.0):
        e = engine(cfg, target, True, draft, policy := Slow(wait))
        e.generate(requests, GREEDY)
        stats = e.stats()
        steps = stats["decode_steps"]
        assert steps == policy.steps >= 6 and stats["ahead_s"] >= 0.01 * steps
        if wait:
            assert 2 * wait * steps <= stats["policy_s"] < stats["seconds"]
        else:
            assert 0 < stats["policy_s"] < 1e-3 * steps
