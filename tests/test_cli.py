"""The `fastgrpo` command's own logic, without running a benchmark or a run: each benchmark's sub-parser
(its module's flags, loaded only when it is used), the refusals naming the benchmark, and the process
roles of `fastgrpo train` with their pre-flight checks made once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastgrpo.bench.command import BENCHES
from fastgrpo.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_bench_help_lists_every_benchmark_without_importing_them():
    code = ("import sys\nfrom fastgrpo.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in sys.modules if m.startswith('fastgrpo.bench.')), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in BENCHES:
        assert f"    {name}" in out.stdout, name
    assert "IMPORTED ['fastgrpo.bench.command'] False" in out.stdout


@pytest.mark.parametrize("argv, named", [
    (["bench", "noise", "--seeds", "2"], "`bench noise` has no argument --seeds"),  # learning's flag
    (["bench", "rollout", "--runs", "6"], "`bench rollout` has no argument --runs"),  # guarantee's
    (["bench", "rollout", "--repetitions", "0"], "`bench rollout`: argument --repetitions: must be >= 1"),
    (["bench", "learning", "--policy", "x"], "`bench learning` has no argument --policy"),  # draft's
    (["bench", "gpu-check", "--no-such-flag"], "`bench gpu-check` has no argument --no-such-flag"),
    (["bench", "simulate", "--repetitions", "0"], "`bench simulate`: argument --repetitions: must be >= 1"),
    (["bench", "guarantee", "--threads", "0,1"], "`bench guarantee`: argument --threads: thread counts must be >= 1"),
    (["bench", "learning", "--every", "x"], "`bench learning`: argument --every: expected an integer"),
    (["bench", "learning", "--variants", "gspo:ratio"], "argument --variants: 'gspo:ratio' is not name or name:key=value"),
])
def test_a_flag_a_benchmark_does_not_have_is_refused_with_the_benchmark_named(argv, named, tmp_path, capsys):
    assert main([*argv, "--output", str(tmp_path / "out.json")]) == 1
    assert named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work


def test_each_benchmark_parses_its_own_flags_and_says_what_it_needs():
    parse = build_parser().parse_known_args
    args, rest = parse(["bench", "learning", "--seeds", "2", "a=1", "--modes", "off,aware", "b=2", "--quick"])
    assert (args.what, args.seeds, args.modes, args.quick, args.needs) == ("learning", 2, "off,aware", True, "draft")
    assert args.overrides == ["a=1"] and rest == ["b=2"]  # main appends overrides found after options
    assert args.run.__module__ == "fastgrpo.bench.learning"
    args, _ = parse(["bench", "learning", "--variants", "default,gspo:grpo.ratio_level=sequence+grpo.eps_low=3e-4"])
    assert args.variants == {"default": [], "gspo": ["grpo.ratio_level=sequence", "grpo.eps_low=3e-4"]}
    args, _ = parse(["bench", "draft", "--policy", "ckpt/policy"])
    assert args.policy == "ckpt/policy" and args.run.__module__ == "fastgrpo.bench.draft_fit"
    args, _ = parse(["bench", "guarantee", "--runs", "2", "--threads", "1,2"])
    assert (args.runs, args.threads) == (2, [1, 2])
    assert parse(["bench", "simulate", "--repetitions", "4"])[0].repetitions == 4
    assert parse(["bench", "noise", "--batches", "3"])[0].batches == 3
    needs = {name: parse(["bench", name])[0].needs for name in BENCHES}
    assert needs == {**{name: "draft" for name in BENCHES}, "engines": "policy", "sglang-tiers": "config",
                     "replay": "config", "gpu-check": None}
    for name, (module, _) in BENCHES.items():  # each registered by its own module
        assert parse(["bench", name])[0].run.__module__ == module, name


def test_bench_gpu_check_refuses_a_config(capsys):
    assert main(["bench", "gpu-check", "--config", CONFIG]) == 1
    assert "builds its own config" in capsys.readouterr().err


@pytest.fixture
def layout_checks(monkeypatch):
    """Counts the layout checks (`run_setup.check_layout`, wherever it is called from)."""
    import fastgrpo.run_setup as run_setup
    import fastgrpo.train as train

    calls = []
    check = run_setup.check_layout

    def counted(cfg):
        calls.append(cfg)
        check(cfg)

    monkeypatch.setattr(run_setup, "check_layout", counted)
    monkeypatch.setattr(train, "check_layout", counted, raising=False)
    return calls


def test_a_policy_rank_checks_the_layout_once(tmp_path, layout_checks, capsys):
    rc = main(["train", "--config", CONFIG, f"model.path={tmp_path / 'no-policy'}", f"run_dir={tmp_path / 'run'}",
               "tracking.enabled=false"])
    assert rc == 1 and "no policy at model.path" in capsys.readouterr().err  # setup stops at the missing policy
    assert len(layout_checks) == 1


def test_a_draft_rank_checks_the_layout_once_and_never_trains(tmp_path, layout_checks, monkeypatch):
    import fastgrpo.cli as cli
    import fastgrpo.distributed as distributed
    import fastgrpo.draft_learning.async_learner as async_learner
    import fastgrpo.train as train

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # the world's last rank: the draft slice
    served = []
    monkeypatch.setattr(distributed, "init_world", lambda draft_ranks: "channel")
    monkeypatch.setattr(async_learner, "serve_draft_slice", lambda cfg, channel: served.append(channel))
    monkeypatch.setattr(train, "train", lambda *a: pytest.fail("a draft rank ran the policy loop"))

    def leave():
        raise SystemExit(0)

    monkeypatch.setattr(cli, "_leave", leave)
    with pytest.raises(SystemExit):
        main(["train", "--config", CONFIG, "trainer.backend=megatron", "draft.online=async", "parallel.draft_ranks=1",
              f"run_dir={tmp_path / 'run'}", "tracking.enabled=false"])
    assert served == ["channel"] and len(layout_checks) == 1


def test_a_learning_variant_is_the_config_with_its_overrides_validated():
    from fastgrpo.bench.learning import with_overrides
    from fastgrpo.config import ConfigError, load_config

    cfg = load_config(None)
    gspo = with_overrides(cfg, ["grpo.ratio_level=sequence", "rollout.refill_rounds=2"])
    assert (gspo.grpo.ratio_level, gspo.rollout.refill_rounds, cfg.grpo.ratio_level) == ("sequence", 2, "token")
    with pytest.raises(ConfigError, match="grpo.no_such_key"):
        with_overrides(cfg, ["grpo.no_such_key=1"])
    with pytest.raises(ConfigError, match="rollout.refill_rounds"):  # a rule across sections
        with_overrides(cfg, ["rollout.refill_rounds=2", "grpo.drop_equal_reward_groups=false"])


def test_bench_learning_without_speculation_needs_no_draft():
    from fastgrpo.bench.learning import needs
    from fastgrpo.config import load_config

    parse = build_parser().parse_known_args
    cfg = load_config(None, ["speculation.policy=aware"])
    assert needs(parse(["bench", "learning", "--modes", "off"])[0], cfg) == "policy"
    assert needs(parse(["bench", "learning", "--modes", "off,aware"])[0], cfg) == "draft"
    assert needs(parse(["bench", "learning"])[0], cfg) == "draft"  # the config's aware, and off
    assert needs(parse(["bench", "learning"])[0], load_config(None, ["speculation.policy=off"])) == "policy"
