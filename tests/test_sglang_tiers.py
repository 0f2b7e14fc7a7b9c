"""aware in the form SGLang's adaptive EAGLE runs it (speculation/sglang_tiers.py): what it learns from
SGLang's histograms, how it prices a slot, the contexts it replays, and the simulated comparison.
(Its model of SGLang's own controller is checked against SGLang's code in test_sglang_conformance.)"""

from __future__ import annotations

import types

import numpy as np
import pytest

from fastgrpo.speculation.policy import AcceptanceModel
from fastgrpo.speculation.roofline import H100, LLAMA3_8B, Roofline
from fastgrpo.speculation.sglang_tiers import AwareTiers, chain, observe_histogram, plain_steps, spec_capture_sizes


def histogram(alpha: float, depths: list[int], steps: int, rng: np.random.Generator) -> list[int]:
    """Accepted drafts per verify step of chains of the given depths (used in turn), each level
    accepted with probability alpha given the one before."""
    counts = [0] * (max(depths) + 1)
    for i in range(steps):
        depth, a = depths[i % len(depths)], 0
        while a < depth and rng.random() < alpha:
            a += 1
        counts[a] += 1
    return counts


@pytest.mark.parametrize("alpha", [0.4, 0.72, 0.9])
def test_the_acceptance_learned_from_histograms_of_mixed_chains_is_unbiased(alpha):
    """SGLang's histogram does not say which chain a step ran: counting only the levels every chain
    drafted recovers the per-level acceptance (passes alone would drive deep levels to 1)."""
    model = AcceptanceModel()
    observe_histogram(model, histogram(alpha, [2, 4, 6], 20_000, np.random.default_rng(0)), shortest=2)
    for d in range(1, 9):
        assert model.alpha(d) == pytest.approx(alpha, abs=0.02), d


def sglang_call(lengths: list[int], max_running: int, depth, alpha: float, rng: np.random.Generator) -> list[list[int]]:
    """Each request's `spec_correct_drafts_histogram` as SGLang 0.5.23 counts it over a call whose
    requests were all submitted at once: the first token from the prefill, then decode steps of every
    running row (up to max_running; waiting rows join as others finish) at the depth of the batch's
    slot, `depth(B)`; a chain accepts each level with probability alpha given the one before and emits
    the accepted drafts and a bonus token (cut at the request's length); a depth-0 step is a verify
    step with 0 correct drafts (eagle_worker_v2.py's trivial verify, batch_result_processor.py's
    counters)."""
    waiting = [i for i, n in enumerate(lengths) if n > 1][::-1]
    left = {}
    hist = [[0] for _ in lengths]
    while waiting or left:
        while waiting and len(left) < max_running:
            i = waiting.pop()
            left[i] = lengths[i] - 1
        d = depth(len(left))
        accepted = np.minimum(rng.geometric(1 - alpha, len(left)) - 1, d)  # levels passed before the first miss
        for i, a in zip(list(left), accepted.tolist()):
            hist[i].extend([0] * (a + 1 - len(hist[i])))
            hist[i][a] += 1
            left[i] -= a + 1
            if left[i] <= 0:
                del left[i]
    return hist


@pytest.mark.parametrize("alpha", [0.5, 0.6, 0.7, 0.8, 0.9])
@pytest.mark.parametrize("table", ["plain_from_64_else_1", "plain_from_96_else_2_or_5"])
def test_the_acceptance_learned_from_sglangs_histograms_leaves_out_its_depth_0_steps(alpha, table):
    """SGLang counts a step of a depth-0 slot as a verify step with 0 correct drafts; taken as a
    level-1 rejection it drags the learned acceptance far down (below 0.05 here for every true rate,
    so aware would stop speculating). The depth-0 steps replayed from the call's lengths and the depths
    set for it come out of the histogram, and the acceptance learned is the true one, within 0.02,
    with depth 0 at large batches and chains of 1 (or 2 and 5) below: GRPO calls of 384 requests of
    uneven lengths at most 128 running, one refresh after each."""
    rng = np.random.default_rng(int(alpha * 10))
    sizes = spec_capture_sizes(128)
    tiers = AwareTiers(Roofline(H100, LLAMA3_8B), sizes, max_context=4096)
    picks = {"plain_from_64_else_1": lambda s: 0 if s >= 64 else 1,
             "plain_from_96_else_2_or_5": lambda s: 0 if s >= 96 else 2 if s >= 16 else 5}[table]
    plain_total = 0
    for _ in range(3):
        tiers.table = {s: picks(s) for s in sizes}  # what the adapter set SGLang's slots to for the call
        lengths = [int(n) for n in rng.integers(2, 600, 384)]
        hists = sglang_call(lengths, 128, tiers.depth, alpha, rng)
        for h, plain in zip(hists, plain_steps(lengths, 128, tiers.depth)):
            tiers.count(h, plain)
            plain_total += plain
        tiers.refresh()
    assert plain_total > 50_000  # most steps ran at depth 0
    for d in range(1, 9):
        assert tiers.acceptance.alpha(d) == pytest.approx(alpha, abs=0.02), d


def test_depth_0_steps_are_replayed_from_a_calls_lengths():
    """The first token of each request comes from its prefill; at most two run; depth 0 with two rows
    running, 3 with one: the 5- and 9-token requests ran their first 4 steps plain together, the
    1-token one never decoded, the 7-token one joined when the 5-token one finished and ran 4 steps
    plain beside the 9-token one's last 4, then its last 2 alone at depth 3."""
    assert plain_steps([5, 9, 1, 7], 2, lambda b: 0 if b >= 2 else 3) == [4, 8, 0, 4]


def test_a_slot_is_priced_at_its_rows_context():
    """At long contexts a step reads the KV cache more than the weights, so verifying more tokens adds
    little: the same batch size speculates deeper there than at short contexts. The choice is one of
    the slot's candidates, which span contexts and acceptances."""
    sizes = spec_capture_sizes(128)
    tiers = AwareTiers(Roofline(H100, LLAMA3_8B), sizes, max_context=16384)
    short, long = tiers.depths(ctx=256), tiers.depths(ctx=8192)
    assert long[128] > short[128] >= 1
    assert all(short[s] in tiers.candidates[s] and long[s] in tiers.candidates[s] for s in sizes)
    config = tiers.sglang_config()
    assert sorted(map(int, config)) == sizes and all(c["candidate_steps"] == tiers.candidates[int(k)]
                                                    for k, c in config.items())


def test_contexts_are_replayed_from_a_calls_lengths():
    """Two requests of 10 and 30 tokens after 5-token prompts, one running at a time: the rows had 10
    cached tokens on average over the first one's 10 steps and 20 over the second's 30."""
    tiers = AwareTiers(Roofline(H100, LLAMA3_8B), [1, 2], max_context=64)
    tiers.saw_call([5, 5], [10, 30], max_running=1)
    tiers.refresh()
    assert tiers.contexts == {1: pytest.approx((10 * 10 + 20 * 30) / 40), 2: pytest.approx(17.5)}
    tiers.saw_call([5, 5], [10, 30], max_running=2)  # both at once: 10 steps of two rows, then one
    tiers.refresh()
    assert tiers.contexts[2] == pytest.approx(5 + 5) and tiers.contexts[1] == pytest.approx(5 + 20)


def test_the_refreshed_table_stays_within_the_candidates():
    tiers = AwareTiers(Roofline(H100, LLAMA3_8B), spec_capture_sizes(32), max_context=4096)
    tiers.count([0, 0, 0, 0, 0, 0, 0, 10_000])  # every chain accepted whole
    table = tiers.refresh()
    assert all(table[s] in tiers.candidates[s] for s in table)
    assert tiers.choose(3) == chain(table[3])  # 3 rows run in the slot of the captured size 3


def test_bench_sglang_tiers_quick(tmp_path):
    """The simulated comparison at its quick size: every policy ran, and the adaptive policies learned
    (aware_sglang beats SGLang's default tiers, which leave long contexts at high concurrency plain)."""
    from fastgrpo.bench.sglang_speculation import bench_sglang_tiers

    out = bench_sglang_tiers(types.SimpleNamespace(seed=0), True, tmp_path / "st.json")
    assert (tmp_path / "st.json").is_file() and out["meta"]["simulated"]
    assert {"off", "sglang_adaptive", "aware_sglang", "aware"} <= set(out["median_s"])
    r = out["ratios"]
    assert r["sglang_adaptive"]["speedup"] > 1.1 and r["off"]["speedup"] > 1.5
    assert all(len(v) == out["meta"]["repetitions"] for v in out["seconds"].values())
