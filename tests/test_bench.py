"""The benchmark commands on the test-size policy: every mode runs, the JSON holds what each
benchmark's documentation and BENCHMARKS.md section report, the tables are consistent with it. (Speed itself is judged from the bench-size runs in
BENCHMARKS.md, never here.)"""

import json

import pytest
import torch

from fastgrpo.models.layers import onednn_available
from tests.conftest import tiny_config, tiny_overrides


def test_bench_rollout_compares_all_modes(tmp_path, tiny_policy, tiny_draft, capsys):
    from fastgrpo.bench.rollout import MODES, bench_rollout

    cfg = tiny_config(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "rollout.max_batch": 64,
                                                "speculation.cost_model_dir": tmp_path / "costs"})
    bench_rollout(cfg, quick=True, output=tmp_path / "rollout.json", repetitions=1)
    assert f"--repetitions 1 --quick --output {tmp_path / 'rollout.json'}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "rollout.json").read_text())
    assert saved["meta"]["repetitions"] == 1
    assert [r["concurrency"] for r in saved["sweep"]] == [1, 4, 16, 64]
    for row in saved["sweep"]:
        assert all(row[f"{m}_tok_s"] > 0 for m in MODES)
        assert row["off_accept_len"] == 1.0 and row["off_spec_fraction"] == 0.0
        assert row["static_spec_fraction"] == 1.0 and row["static_accept_len"] > 1.0  # the draft does get accepted
    g = saved["grpo_batch"]
    assert g["static_best_s"] == min(v for k, v in g["all_s"].items() if k.startswith("static"))
    assert all(g[k] > 0 for k in ("off_s", "fastgrpo_s", "aware_s", "aware_per_sequence_s", "off_unshared_prefill_s"))
    assert all(saved["hf_generate"][k] > 0 for k in ("batch1_tok_s", "batch64_tok_s", "engine_batch1_tok_s"))
    b = saved["bound"]
    hf = saved["hf_generate"]
    # the decode step is timed itself (a median of steps) and the bound reports that same step
    assert b["batch1_step_ms"] == hf["engine_batch1_step_ms"] > 0
    assert hf["engine_batch1_prefill_ms"] > 0
    for shares in g["time_shares"].values():
        assert sum(shares.values()) == pytest.approx(1.0) and shares["prefill"] > 0
    # eager steps on a CPU (engine.steps auto): no padded rows; attention reads every row to the longest
    # row, and the batch's prompts differ in length
    for mode, pad in g["padding"].items():
        assert pad["static_share"] == pad["pad_row_share"] == 0.0 and 0 < pad["pad_kv_share"] < 1, mode
    assert (tmp_path / "rollout.png").stat().st_size > 10_000
    assert torch.backends.cpu.get_cpu_capability() in saved["meta"]["cpu"]


def test_bench_forward_times_every_shape_with_every_kernel(tmp_path, tiny_policy):
    from fastgrpo.bench.forward import SHAPES, bench_forward, markdown

    bench_forward(tiny_config(tmp_path, tiny_policy), quick=True, output=tmp_path / "forward.json")
    saved = json.loads((tmp_path / "forward.json").read_text())
    assert [(r["batch"], r["new_tokens"]) for r in saved["rows"]] == list(SHAPES)
    kernels = ["dense"] + (["onednn"] if onednn_available() else [])
    assert all(r[f"{k}_ms"] > 0 for r in saved["rows"] for k in kernels)
    table = markdown(saved, "cmd").splitlines()
    assert len(table) == 6 + len(SHAPES) + 8 and table[6].startswith("| 1 | 1 | ")
    assert [r["batch"] for r in saved["sampling"]] == [1, 16, 64]
    assert all(r["counter_ms"] > 0 and r["multinomial_ms"] > 0 for r in saved["sampling"])


def test_bench_engines_times_one_engine_against_two_on_the_same_tokens(tmp_path, tiny_policy):
    """A world of two ranks rolls out one batch on one engine (one thread, then two) and on two
    engines; the bench refuses a run whose modes returned different tokens, so reaching the table
    means keyed requests gave every mode the same samples."""
    from fastgrpo.bench.engines import MODES, bench_engines

    out = bench_engines(tiny_config(tmp_path, tiny_policy), quick=True, output=tmp_path / "engines.json")
    saved = json.loads((tmp_path / "engines.json").read_text())
    assert list(saved["modes"]) == list(MODES) == list(out["modes"])
    assert saved["meta"]["sequences"] == 16 and saved["meta"]["tokens"] > 16
    assert all(len(m["runs"]) == 3 and m["median_s"] > 0 for m in saved["modes"].values())
    assert saved["modes"]["one engine"]["speedup_vs_one_engine"] == 1.0


def test_bench_shapes_keeps_the_size_and_deepens_the_policy(tmp_path, tiny_policy):
    from fastgrpo.bench.shapes import DEPTHS, bench_shapes, markdown

    bench_shapes(tiny_config(tmp_path, tiny_policy), quick=True, output=tmp_path / "shapes.json")
    rows = json.loads((tmp_path / "shapes.json").read_text())["rows"]
    base = rows[0]
    assert [r["layers"] for r in rows] == [base["layers"] * m for m in DEPTHS]
    assert all(abs(r["parameters"] / base["parameters"] - 1) < 0.35 for r in rows)  # about the same size
    assert all(r["draft_over_target"] > 0 and r["tree_step_break_even"] > 1 for r in rows)
    assert len(markdown(json.loads((tmp_path / "shapes.json").read_text()), "cmd").splitlines()) == 6 + len(DEPTHS)


def test_bench_draft_scores_drafts_alike_on_the_policys_own_samples(tmp_path, tiny_policy, tiny_draft, capsys):
    import shutil

    from fastgrpo.bench.draft_fit import TREES, markdown
    from fastgrpo.cli import main

    step = tmp_path / "checkpoints" / "step_00000002"  # a training checkpoint's layout: policy/ beside draft/
    shutil.copytree(tiny_policy, step / "policy")
    shutil.copytree(tiny_draft, step / "draft")
    overrides = tiny_overrides(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "task.eval_size": 48})
    output = tmp_path / "draft.json"
    policy = str(step / "policy")
    named = f"named={tiny_draft}"  # a draft named on the command line: the warm start again
    assert main(["bench", "draft", *overrides, "--quick", "--policy", policy, "--draft", named,
                 "--output", str(output)]) == 0
    # the printed section names the command that reproduces it, overrides included
    command = f"fastgrpo bench draft {' '.join(overrides)} --policy {policy} --draft {named} --quick --output {output}"
    assert f"`{command}`" in capsys.readouterr().out
    saved = json.loads(output.read_text())
    scores = saved["scores"]
    assert list(scores) == ["warm start", "checkpoint's online draft", "named", "warm start + 10 online steps"]
    # the checkpoint's and the named draft are copies of the warm start: same prompts, seeds and trees give
    # the same scores
    assert scores["warm start"] == scores["checkpoint's online draft"] == scores["named"]
    for s in scores.values():
        assert 0 <= s["heldout_top1"] <= 1 and 0 <= s["heldout_top1_4"] <= 1 and s["heldout_loss"] > 0
        assert all(1 <= s[f"accept_{t.name}"] <= t.depth + 1 for t in TREES)
    assert scores["warm start + 10 online steps"] != scores["warm start"]  # the online steps changed the draft
    assert len(markdown(saved, "cmd").splitlines()) == 8 + len(scores)
    for bad, said in ((str(tiny_draft), "takes NAME=PATH"), (f"gone={tmp_path / 'gone'}", "no draft there"),
                      (f"warm start={tiny_draft}", "is taken")):
        assert main(["bench", "draft", *overrides, "--quick", "--draft", bad, "--output", str(output)]) == 1
        assert said in capsys.readouterr().err


def test_noise_scale_recovers_a_known_signal_and_noise():
    """Gradients built as G + noise of known size: the estimator finds |G|^2 and B_noise."""
    from fastgrpo.bench.noise import noise_scale

    gen = torch.Generator().manual_seed(0)
    dim, K, B = 200_000, 12, 16
    G = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.01  # |G|^2 = 20
    per_batch_noise = 0.02  # tr(Sigma)/B = 0.02^2 * dim = 80, so B_noise = 4 B = 64
    grads = [G + per_batch_noise * torch.randn(dim, generator=gen, dtype=torch.float64) for _ in range(K)]
    out = noise_scale(grads, B)
    assert out["signal_sq"] == pytest.approx(float(G @ G), rel=0.05)
    assert out["grad_sq"] == pytest.approx(float(G @ G) + 80, rel=0.02)
    assert out["b_noise_prompts"] == pytest.approx(64, rel=0.1)
    assert out["mean_cosine"] == pytest.approx(20 / 100, abs=0.02)
    pure_noise = noise_scale([per_batch_noise * torch.randn(dim, generator=gen, dtype=torch.float64)
                              for _ in range(K)], B)
    assert abs(pure_noise["signal_sq"]) < 2 * pure_noise["signal_sq_se"]  # nothing to find: within the error bar
    assert pure_noise["b_noise_prompts_lower_bound"] > 100 * B


def test_bench_noise_measures_the_loops_own_gradients(tmp_path, tiny_policy, capsys):
    from fastgrpo.cli import main

    out = tmp_path / "noise.json"
    overrides = tiny_overrides(tmp_path, tiny_policy, **{"speculation.policy": "off", "draft.online": "off",
                                                        "task.max_steps": 2, "rollout.prompts_per_step": 4})
    assert main(["bench", "noise", "--batches", "3", "--output", str(out), *overrides]) == 0
    assert "draft-pretrain" not in capsys.readouterr().out  # rollouts without speculation: no draft built for them
    saved = json.loads(out.read_text())
    assert len(saved["batches"]) == 3 and saved["prompts_per_batch"] == 4
    assert saved["grad_sq"] == pytest.approx(sum(b["grad_sq"] for b in saved["batches"]) / 3)
    assert all(b["grad_sq"] > 0 and 1 <= b["groups_kept"] <= 4 for b in saved["batches"])
    assert main(["bench", "noise", "--batches", "3", "--seeds", "2", "--output", str(out), *overrides]) == 1
    assert main(["bench", "noise", "--batches", "2", "--output", str(out), *overrides]) == 1


def test_guarantee_step_accounting_prices_speculative_steps_at_off_plain_steps():
    """Aware's plain steps against off's at the same running count (the nearest where off ran none); its
    speculative steps against the plain steps that would have emitted the same tokens (off's median step
    at that running count); its steps at fewer rows than off ever ran, its tail, apart."""
    from fastgrpo.bench.guarantee import step_accounting

    off = [(4, "off", 4, 1.0), (4, "off", 4, 3.0), (4, "off", 4, 1.0), (2, "off", 2, 0.5)]
    aware = [(4, "off", 4, 1.1), (3, "off", 3, 0.9), (4, "d2-k1-n3", 8, 3.0), (2, "off", 2, 0.5),
             (2, "d2-k1-n3", 6, 1.0), (1, "off", 1, 0.4)]  # off ran no step at 3 (nearest: 4, 2; the first), nor at 1
    got = step_accounting(aware, off)
    assert got["plain_step_vs_off"] == pytest.approx((1.1 + 0.9 + 0.5) / (1.0 + 1.0 + 0.5))
    # speculative: 4.0 s against 8 / 4 x 1.0 + 6 / 2 x 0.5 = 3.5 s of plain steps, over 6.9 s of decoding
    assert got["spec_net_fraction"] == pytest.approx((4.0 - 3.5) / 6.9)
    assert got["tail_fraction"] == pytest.approx(0.4 / 6.9)  # the step at 1 row


def test_bench_guarantee_pairs_aware_with_off_at_each_thread_count(tmp_path, tiny_policy, tiny_draft):
    from fastgrpo.bench.guarantee import LEVELS, bench_guarantee, markdown

    cfg = tiny_config(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "rollout.max_batch": 64,
                                                "speculation.cost_model_dir": tmp_path / "costs"})
    before = torch.get_num_threads()
    bench_guarantee(cfg, quick=True, output=tmp_path / "guarantee.json", runs=1, threads=[1, 2], repetitions=1, aa=True)
    assert torch.get_num_threads() == before
    saved = json.loads((tmp_path / "guarantee.json").read_text())
    assert saved["meta"]["repetitions"] == 1
    assert list(saved["threads"]) == ["1", "2"]
    for t, passed in saved["threads"].items():
        assert passed["torch_threads"] == int(t)  # each pass ran at its own thread count
        loads = passed["aware_vs_off"]
        assert list(loads)[:len(LEVELS)] == [f"running {b}" for b in LEVELS] and list(loads)[-1].startswith("GRPO")
        for r in [*loads.values(), passed["engine_vs_hf_batch1"]]:
            assert len(r["ratios"]) == len(r["runs"]) == 1
            for ratio, pairs in zip(r["ratios"], r["runs"]):
                assert len(pairs) == saved["meta"]["repetitions"]
                ratios = sorted(p["aware_tok_s"] / p["off_tok_s"] if "off_tok_s" in p else p["hf_s"] / p["engine_s"]
                                for p in pairs)
                assert ratio == pytest.approx(ratios[len(ratios) // 2])  # an odd count: the middle pair
        for r in loads.values():  # the pooled median over every pair of every run, inside its interval
            every = sorted(p["aware_tok_s"] / p["off_tok_s"] for pairs in r["runs"] for p in pairs)
            pool = r["pooled"]
            assert pool["pairs"] == len(every) and pool["median"] == pytest.approx(every[len(every) // 2])
            assert every[0] <= pool["ci95"][0] <= pool["median"] <= pool["ci95"][1] <= every[-1]
            for p in (p for pairs in r["runs"] for p in pairs):  # a block without speculative steps lost nothing to them
                assert p["probes"] >= 0 and (p["spec_fraction"] > 0 or p["spec_net_fraction"] == 0)
                assert 0 < p["policy_fraction"] < 0.5  # aware's host time: some, and no more than it plausibly is
        assert list(passed["aa"]) == list(loads)  # the noise floor of every workload
        for r in passed["aa"].values():
            blocks = [b for run in r["runs"] for b in run]
            assert len(blocks) == saved["meta"]["repetitions"] and r["pooled"]["pairs"] == len(blocks)
            for b in blocks:  # plain decoding twice on the block's seeds: the same tokens, timed twice
                assert b["tokens"]["off"] == b["tokens"]["off_aa"] > 0
                speeds = {m: b["tokens"][m] / b["seconds"][m] for m in b["tokens"]}
                assert b["ratio"] == pytest.approx(speeds["off_aa"] / speeds["off"])
    table = markdown(saved, "cmd")
    assert "The noise floor" in table
    # the CPU named (timings compare only on one CPU type): its ISA as torch's kernels see it
    assert torch.backends.cpu.get_cpu_capability() in saved["meta"]["cpu"] and saved["meta"]["cpu"] in table
    worst = min(min(r["ratios"]) for passed in saved["threads"].values() for r in passed["aware_vs_off"].values())
    assert f"| {worst:.3f}x |" in table
    assert table.count("| yes |") + table.count("| no |") == 2 * 2 * (len(LEVELS) + 1)  # aware's rows and A/A's


def test_simulate_repetitions_are_checked_before_any_work(tmp_path):
    from fastgrpo.cli import main

    out = tmp_path / "x.json"
    assert main(["bench", "rollout", "--runs", "6", "--output", str(out)]) == 1  # not rollout's flag (guarantee's)
    assert main(["bench", "simulate", "--repetitions", "0", "--output", str(out)]) == 1
    assert not out.exists()


def test_the_aware_trace_tool_splits_each_call_by_shape(tmp_path, tiny_policy, tiny_draft):
    """tools/aware_trace.py at test size: the bench's order and seeds, `off`'s calls all plain steps (each row
    `--tokens` tokens, the first at prefill) with no tail, a tree step at least a token a row, and the rows go
    to --json."""
    from tools.aware_trace import main

    overrides = tiny_overrides(tmp_path, tiny_policy,
                               **{"draft.path": tiny_draft, "speculation.cost_model_dir": tmp_path / "costs"})
    rows = main(["--config", "", "--running", "4", "--tokens", "12", "--calls", "2", "--threads", "1",
                 "--json", str(tmp_path / "trace.json"), *overrides])
    assert [(r["call"], r["mode"]) for r in rows] == [(0, "off"), (0, "aware"), (1, "aware"), (1, "off")]
    for r in rows:
        shapes = r["shapes"]
        if r["mode"] == "off":  # every row one token a step, the first at prefill: the rows finish together
            assert set(shapes) == {"off"} and shapes["off"]["steps"] == 12 - 1
            assert r["tail"] == {"steps": 0, "share": 0.0}
        else:  # a tail step is a decode step: no more of them than steps in all
            assert 0 <= r["tail"]["steps"] <= sum(v["steps"] for v in shapes.values()) and 0 <= r["tail"]["share"] <= 1
        for name, v in shapes.items():  # plain: one token a row; a tree's verify at least one
            assert name == "off" and v["tokens_a_row"] == 1.0 or name.startswith("d") and v["tokens_a_row"] >= 1.0
            assert v["rate"] == pytest.approx(v["tokens_a_row"] / v["ms"])
    assert json.loads((tmp_path / "trace.json").read_text()) == json.loads(json.dumps(rows))


def test_the_rollout_modes_tool_accounts_for_aware_against_off(tmp_path, tiny_policy, tiny_draft):
    """tools/rollout_modes.py at test size: every mode timed on every repetition, the static trees speculating
    on every step and `off` on none; `net_split` against a hand-priced trace."""
    from tools.rollout_modes import SPLIT, main, net_split

    overrides = tiny_overrides(tmp_path, tiny_policy, **{"draft.path": tiny_draft, "rollout.prompts_per_step": 2,
                                                         "speculation.cost_model_dir": tmp_path / "costs"})
    out = main(["--config", "", "--reps", "2", "--threads", "1", *overrides])
    assert set(out["modes"]) == {"off", "d2k2n4", "d4k4n12", "aware"}
    assert out["modes"]["off"]["speculative"] == 0 and out["modes"]["off"]["accept_len"] == 1.0
    assert out["modes"]["d2k2n4"]["speculative"] == out["modes"]["d4k4n12"]["speculative"] == 1.0
    assert len(out["aware_accounting"]) == len(out["aware_net_split_s"]) == 2
    # off's plain steps: 20 ms at 32 rows, 10 ms at 8; aware: a tree after plain at 30 rows (priced at 32's
    # step), another after it, plain, then a tree after plain at 8 rows
    off = [(32, "off", 32, 0.020), (32, "off", 32, 0.020), (8, "off", 8, 0.010)]
    aware = [(30, "off", 30, 0.020), (30, "d2k2n4", 60, 0.060), (30, "d2k2n4", 90, 0.050), (8, "off", 8, 0.010),
             (8, "d2k2n4", 24, 0.020)]
    split = net_split(aware, off)
    assert split[SPLIT[0]] == pytest.approx(0.060 - 2 * 0.020)  # 2 tokens a row: two plain steps
    assert split[SPLIT[2]] == pytest.approx(0.050 - 3 * 0.020)  # 3 a row, cheaper than plain: negative
    assert split[SPLIT[1]] == pytest.approx(0.020 - 3 * 0.010) and split[SPLIT[3]] == 0.0
