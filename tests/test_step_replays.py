"""Static steps held to a CUDA graph's contract on the CPU (engines/embedded/graphs.ReplayCheck): a graph
replays its first call's ops on the storages that call read, so every later step under the same key must
do exactly that, whatever ran on the engine in between (other modes, weight pushes, a new draft, routing
records), and still give the eager engine's tokens."""

import pytest
import torch

from fastgrpo.engines.embedded import constants
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.engines.embedded.graphs import ReplayCheck, StaleReplay, StepGraphs
from fastgrpo.models.policy import new_policy
from fastgrpo.speculation.policy import Off, Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import Request
from tests.test_families import trained_draft
from tests.test_moe_engine import hf_model, qwen3_moe
from tests.test_static_steps import SAMPLINGS, STOPS, assert_same, dense, engine, prompts  # noqa: F401 (fixture)

TREE = SpecConfig(4, 4, 12)


def checked(e: EmbeddedEngine) -> ReplayCheck:
    e.graphs.replay_check = ReplayCheck()
    return e.graphs.replay_check


class Tail(Static):
    """Plain steps while more than 3 sequences run, the tree in the long tail (as aware runs)."""

    name = "tail"

    def choose(self, running, context=None):
        return self.config if running <= 3 else None


class Holder:
    def __init__(self):
        self.t = torch.arange(4.0)
        self.scale = 2.0


def test_the_check_holds_a_step_to_its_first_call():
    """What a graph would get wrong, each caught by name; what it gets right passes and returns the first
    call's output tensors, overwritten."""
    h = Holder()
    graphs = StepGraphs(torch.device("cpu"))
    check = graphs.replay_check = ReplayCheck()
    step = lambda: h.t * h.scale + 1  # noqa: E731
    first = graphs.run("k", step)
    assert first.tolist() == [1.0, 3.0, 5.0, 7.0]
    h.t.copy_(torch.ones(4))  # written in place: a replay reads it
    again = graphs.run("k", step)
    assert again is first and first.tolist() == [3.0] * 4 and check.checked == 1  # the kept output, overwritten
    h.t = torch.ones(4)  # rebound: a replay would read the old storage
    with pytest.raises(StaleReplay, match="reads storage"):
        graphs.run("k", step)
    h.t = torch.ones(5)[:4]
    with pytest.raises(StaleReplay):  # another storage, and a view into it
        graphs.run("k", step)
    h2 = Holder()
    h2.scale = 3.0  # a scalar the key does not name: baked into the graph
    graphs.run("k2", lambda: h2.t * 2.0)
    with pytest.raises(StaleReplay, match="3.0"):
        graphs.run("k2", lambda: h2.t * h2.scale)
    graphs.run("k3", lambda: h2.t + 1 + 1)
    with pytest.raises(StaleReplay, match="ops where the first call"):  # a branch the key does not name
        graphs.run("k3", lambda: h2.t + 1)
    assert graphs.run("k4", lambda: torch.zeros(3) + h2.t[:3]).tolist() == [0.0, 1.0, 2.0]  # made inside: free
    assert graphs.run("k4", lambda: torch.zeros(3) + h2.t[:3]).tolist() == [0.0, 1.0, 2.0]


def test_modes_on_one_engine_replay_as_captured(dense):
    """One static engine, as the GPU check's rollout stage and a run's evaluation use it: plain decoding,
    then speculation, a weight push, a new draft, capture of the states, back to plain. Every step is held
    to its key's first call, and each call gives what a fresh eager engine gives, with the same acceptance.
    (Plain steps captured while nothing kept the draft's states, replayed under speculation, failed this.)
    The index constants the steps share are never written."""
    cfg, target, draft = dense
    other = new_policy(cfg, seed=11).eval()
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(3.0)
    other_draft = trained_draft(cfg, other, prompts(7, seed=5) + prompts(5, seed=7))
    ps = prompts(7, seed=5)
    requests = [Request(p) for p in ps]
    e = engine(cfg, target, True, draft, Off())
    check = checked(e)
    calls = [(target, draft, Off(), "greedy"), (target, draft, Tail(TREE), "greedy"), (target, draft, Off(), "t1"),
             (target, draft, Tail(TREE), "t1"), (other, other_draft, Static(TREE), "t1"),
             (other, other_draft, Off(), "greedy"), (other, other_draft, Tail(TREE), "greedy")]
    weights = draft_weights = None
    for i, (w, d, policy, name) in enumerate(calls):
        if w is not weights:
            e.update_weights(w.state_dict().items(), version=i)
            weights = w
        if d is not draft_weights:
            e.update_draft(d.state_dict().items(), version=i)
            draft_weights = d
        e.set_speculation(policy)
        got = e.generate(requests, SAMPLINGS[name], seed=5, capture=i == 3)
        fresh = engine(cfg, w, False, d, policy)
        want = fresh.generate(requests, SAMPLINGS[name], seed=5)
        assert_same(w, ps, got, want, SAMPLINGS[name], 5)
        if policy.name != "off":
            assert abs(e.stats()["accept_len"] - fresh.stats()["accept_len"]) < 0.05, (i, e.stats(), fresh.stats())
        if i == 3:  # the index constants the steps read (engines/embedded/constants.py), once trees ran
            kept = {key: t.clone() for key, t in constants._made.items()}
    assert check.checked > 100  # most steps were replays of an earlier key
    assert any(key[0] == "node_depths" for key in kept) and any(key[0] == "arange" for key in kept)
    changed = [key for key, t in kept.items() if not torch.equal(constants._made[key], t)]
    assert not changed, f"steps wrote into shared constants: {changed}"


def test_a_mixture_of_experts_replays_with_and_without_its_routing_record():
    cfg = qwen3_moe()
    hf = hf_model(cfg)
    ps = prompts(4, seed=3)
    draft = trained_draft(cfg, hf, ps)
    e = EmbeddedEngine(cfg, 4, 128, eos_id=STOPS, pad_id=0, policy=Static(SpecConfig(3, 2, 6)), static_steps=True)
    e.update_weights(hf.state_dict().items(), version=0)
    e.update_draft(draft.state_dict().items(), version=0)
    check = checked(e)
    for routing in (False, True, False, True):
        got = e.generate([Request(p) for p in ps], SAMPLINGS["t1"], seed=2, routing=routing)
        eager = EmbeddedEngine(cfg, 4, 128, eos_id=STOPS, pad_id=0, policy=Static(SpecConfig(3, 2, 6)))
        eager.update_weights(hf.state_dict().items(), version=0)
        eager.update_draft(draft.state_dict().items(), version=0)
        want = eager.generate([Request(p) for p in ps], SAMPLINGS["t1"], seed=2, routing=routing)
        assert_same(hf, ps, got, want, SAMPLINGS["t1"], 2)
        if routing:
            for a, b in zip(got, want):
                assert torch.equal(a.routing, b.routing)
    assert check.checked > 10


@pytest.mark.parametrize("drafts", ["hybrid", "index"])
def test_index_drafts_replay_as_captured(dense, drafts):
    """Drafts from the suffix index run static steps too (hybrid: the learned draft's step, the host's merge,
    the verify step), beside static plain steps of the same engine: every step replays as captured, and
    three visits of the same prompts (the index filling from their answers) give what an eager engine with
    the same history gives, accepting as much."""
    from fastgrpo.speculation.suffix_index import IndexLimits

    cfg, target, draft = dense
    ps = prompts(6, seed=4)
    requests = [Request(p) for _ in range(2) for p in ps]  # each prompt twice: siblings draft for each other
    static, eager = engine(cfg, target, True, draft, Tail(TREE)), engine(cfg, target, False, draft, Tail(TREE))
    for e in (static, eager):
        e.set_drafts(drafts, IndexLimits(window=8, depth=6))
    check = checked(static)
    keys, run = set(), static.graphs.run
    static.graphs.run = lambda key, step: keys.add(key[0]) or run(key, step)
    for visit in range(3):
        got = static.generate(requests, SAMPLINGS["t1"], seed=visit)
        want = eager.generate(requests, SAMPLINGS["t1"], seed=visit)
        assert_same(target, ps + ps, got, want, SAMPLINGS["t1"], visit)
        s, w = static.stats(), eager.stats()
        assert s["static_steps"] == s["decode_steps"] and s["spec_steps"] == w["spec_steps"] > 0
        assert abs(s["accept_len"] - w["accept_len"]) < 0.05 and s["index_accepted"] > 0
    assert check.checked > 0
    assert "verify" in keys and ("draft" in keys) == (drafts == "hybrid")
