"""`fastgrpo bench gpu-check` at its test size on the CPU: the same driver tools/gpu_check.sh runs on a
GPU, so that it cannot rot before a GPU runs it. Every stage succeeds with plausible numbers and the
JSON and markdown are written; the run imports nothing that a GPU machine with only torch,
transformers, safetensors and numpy (and their own requirements) lacks beyond the fetched wheels:
every other module is hidden from it, as absent there; and each wheel's own requirements are among
the wheels or come with those packages (they are fetched and installed without dependencies)."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fastgrpo.bench.gpu_check import (AWARE_MODES, BASE, DECODE_BATCHES, FUSED_SHAPES, GPU_TORCH, MERGED_SHAPES,
                                     PLANNED_S, SIZES, STAGES, STEP_SHAPES, SWEEP_MODES, WHEELS, gpu_requirements,
                                     wheels_to_install)
from fastgrpo.bench.gpu_check.targets import aware_verdict, level_ratio

ROOT = Path(__file__).resolve().parents[1]
GPU_PYTHON = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.0"}  # the GPU machine's

# Runs the driver with every module outside `allowed` hidden from the import system (as absent), and
# writes which modules it imported and which it looked for in vain.
BOOT = r"""
import atexit, json, runpy, sys

allowed, report = set(json.loads(sys.argv[1])), sys.argv[2]
before, hidden = set(sys.modules), set()
stdlib_data = "_sysconfigdata_"  # the standard library's build configuration, not in stdlib_module_names


class Gate:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in allowed and not top.startswith(stdlib_data):
            hidden.add(top)
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Gate(f) for f in sys.meta_path]


def _compiled_kernels(names):
    # Inductor's compiled kernels: top-level names of no package, of modules it made at run time from its
    # cache directory (its Python wrappers live under torch's own name)
    if "torch._inductor.runtime.cache_dir_utils" not in sys.modules:
        return set()
    cache = sys.modules["torch._inductor.runtime.cache_dir_utils"].cache_dir()
    return {n.partition(".")[0] for n in names if n.partition(".")[0] not in allowed
            and (getattr(sys.modules.get(n), "__file__", None) or "").startswith(cache)}


@atexit.register
def _report():
    new = set(sys.modules) - before
    kernels = _compiled_kernels(new)
    imported = {n.partition(".")[0] for n in new} - kernels
    with open(report, "w") as f:
        json.dump({"imported": sorted(imported), "hidden": sorted(hidden), "compiled_kernels": len(kernels)}, f)


sys.argv = ["gpu_check", *sys.argv[3:]]
runpy.run_module("fastgrpo.bench.gpu_check", run_name="__main__", alter_sys=True)
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str) -> list[str]:
    """The distributions `dist` requires on the GPU machine's Python (no extras)."""
    reqs = [Requirement(r) for r in md.distribution(dist).requires or []]
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate(GPU_PYTHON)]


def closure(names) -> set[str]:
    """`names` and every distribution they require, recursively (those installed here)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += _requirements(name)
        except md.PackageNotFoundError:
            pass
    return seen


def wheel_names() -> set[str]:
    return {_norm(Requirement(w).name) for w in WHEELS}


def allowed_modules() -> set[str]:
    """Top-level modules a GPU machine has: the standard library, the base packages with what they
    require, the wheels, and this repository's own packages."""
    dists = closure(BASE) | wheel_names()
    packages = {m for m, owners in md.packages_distributions().items() if any(_norm(o) in dists for o in owners)}
    for dist in dists:  # what a package vendors and puts on sys.path itself (setuptools: jaraco, more_itertools)
        try:
            files = md.distribution(dist).files or []
        except md.PackageNotFoundError:
            continue
        for f in files:
            parts = f.parts
            if "_vendor" in parts[:-1] and not parts[parts.index("_vendor") + 1].endswith(".dist-info"):
                packages.add(parts[parts.index("_vendor") + 1].removesuffix(".py"))
    return set(sys.stdlib_module_names) | set(sys.builtin_module_names) | packages | {
        "fastgrpo", "megatron_patches", "__main__", "__mp_main__"}


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    out, report = tmp / "out", tmp / "imports.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", BOOT, json.dumps(sorted(allowed_modules())), str(report),
                           "--size", "test", "--device", "cpu", "--out", str(out), "--work", str(tmp / "work"),
                           # static steps as on a GPU, each held to what its graph's replay would compute
                           "--check-replays", "engine.steps=static"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-6000:], sep="\n")
    return {"returncode": proc.returncode, "result": json.loads((out / "gpu_check.json").read_text()),
            "markdown": (out / "gpu_check.md").read_text(), "imports": json.loads(report.read_text()),
            "log": proc.stdout}


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow  # the whole check at test size on the CPU: ~60 s (one run shared by three tests)
def test_every_stage_runs_on_the_cpu_with_plausible_numbers(check):
    """The driver at test size: every stage ok, each with numbers of the right kind and range."""
    stages = check["result"]["stages"]
    assert list(stages) == list(STAGES)
    failed = {n: s["error"] for n, s in stages.items() if s["status"] != "ok"}
    assert not failed and check["returncode"] == 0, failed
    d = {n: s["data"] for n, s in stages.items()}
    assert all(s["seconds"] > 0 for s in stages.values())
    assert _positive(d["environment"]["copy_bandwidth_gb_s"]) and d["environment"]["device"] == "cpu"

    assert d["sft"]["steps"] == d["sft"]["planned_steps"] == 1600 // 32 and d["sft"]["complete"] == 1.0
    assert 0 < d["sft"]["train_loss"] < math.log(512) and d["sft"]["parameters"] > 50_000
    assert d["draft"]["steps"] == 40 and 0 <= d["draft"]["eval_top1"] <= 1 and _positive(d["draft"]["eval_loss"])
    # the online learner's round: trained where the run computes, published once
    assert d["draft"]["online_device"] == "cpu" and d["draft"]["online_steps"] >= 1 and d["draft"]["online_version"] == 1
    assert _positive(d["draft"]["online_loss"]) and _positive(d["draft"]["online_loss_fresh"])

    t = d["train_step"]  # fp32 on the CPU: the two trainers agree to rounding
    assert t["megatron_backend"] == "gloo" and t["sequences"] == SIZES["test"].train_sequences
    assert t["loss_relative_diff"] < 1e-4 and t["grad_norm_relative_diff"] < 1e-4 and t["logprob_max_abs_diff"] < 1e-4
    assert _positive(t["torch_step_s"], t["megatron_step_s"], t["torch_metrics"]["grad_norm"])
    assert t["torch_metrics"]["updates"] == t["megatron_metrics"]["updates"] == 2

    w = d["weight_push"]
    assert w["engine_holds_trainer_weights"] and w["corrupted_push_refused"] and w["serving_after_refusal"]
    assert "differs from what the trainer sent" in w["refusal"] and w["megatron_engine_holds_weights"]
    assert w["bytes"] >= 4 * d["sft"]["parameters"] and _positive(w["push_s"], w["memcpy_s"], w["push_gb_s"])

    b = d["decode_bound"]
    assert b["weight_bytes"] >= 4 * d["sft"]["parameters"] and "measured copy" in b["bandwidth_source"]
    assert set(b["batches"]) == {str(B) for B in DECODE_BATCHES}
    for row in b["batches"].values():
        assert _positive(row["step_ms"], row["bound_ms"], row["forward_ms"], row["matmul_chain_ms"])
        assert row["step_vs_bound"] > 1  # no step beats the bytes it must read
    assert b["batches"]["64"]["kv_bytes"] > b["batches"]["1"]["kv_bytes"]

    size = SIZES["test"]
    r = d["rollout"]
    assert [row["concurrency"] for row in r["sweep"]] == list(size.levels) and r["repetitions"] == size.reps >= 3
    for row in r["sweep"]:
        assert _positive(*(row[f"{mode}_tok_s"] for mode in SWEEP_MODES)) and row["aware_accept_len"] >= 1
        # every mode as many repetitions: 3, and more only while aware was within noise of its line (no budget)
        n = row["aware_runs"]
        assert all(row[f"{mode}_runs"] == n and row[f"{mode}_tok_s_se"] >= 0 for mode in SWEEP_MODES)
        assert size.reps <= n <= size.reps + size.extra_reps
        assert n == size.reps + size.extra_reps or aware_verdict(*level_ratio(row)) != "within noise"
        assert row["aa_ratio"] == pytest.approx(row["static_aa_tok_s"] / row["static_tok_s"])
        assert row["aware_ahead_s"] > 0 and row["aware_wait_s"] == 0  # static steps on the CPU: nothing to wait for
        assert 0 < row["aware_policy_share"] < 1 and row["aware_policy_s"] > 0
        assert row["aware_vs_best"] == pytest.approx(row["aware_tok_s"] / max(row[f"{m}_tok_s"] for m in
                                                                                ("off", "static", "fastgrpo", "tlt")))
    g = r["grpo_batch"]
    assert set(SWEEP_MODES) | {"off_unshared_prefill"} <= set(g["all_s"]) and _positive(*g["all_s"].values())
    assert any(m.startswith("static_") for m in g["all_s"]) and g["aa_ratio"] == pytest.approx(
        g["all_s"]["static"] / g["all_s"]["static_aa"])
    assert set(g["se_s"]) == set(g["all_s"]) and len(set(g["runs"].values())) == 1
    assert size.reps <= g["runs"]["aware"] <= size.reps + size.extra_reps
    # every call kept, each mode once a repetition in an order rotated by one per repetition, with its trace
    calls = r["calls"]
    grpo_modes = list(g["all_s"])
    assert len(calls) == (sum(row["aware_runs"] + 1 for row in r["sweep"]) * len(SWEEP_MODES)
                          + (g["runs"]["aware"] + 1) * len(grpo_modes))
    for call in calls:
        modes = list(SWEEP_MODES) if call["workload"].startswith("sweep_") else grpo_modes
        # the contenders in their own order, the repetition's first mode at position 0
        assert call["position"] == (modes.index(call["mode"]) - call["rep"]) % len(modes)
        assert len(call["trace"]["ms"]) == call["decode_steps"] == sum(n for counts in call["configs"].values()
                                                                      for n in counts.values())
        assert call["capture_s"] == 0 and call["seconds"] == call["wall_s"]  # a CPU captures nothing
    aware_calls = [c for c in calls if c["mode"] in AWARE_MODES]
    assert [(s["workload"], s["mode"], s["rep"]) for s in r["aware_states"]] == [
        (c["workload"], c["mode"], c["rep"]) for c in aware_calls]
    assert all(s["state"] and "error" not in s["state"] for s in r["aware_states"])
    # one static engine ran every mode, each step as its graph would replay (StaleReplay fails the stage)
    assert r["engine"]["static_steps"] and r["engine"]["replays_checked"] > 100
    assert 0 < r["engine"]["graphs_a_gpu_would_capture"] < r["engine"]["replays_checked"]
    assert _positive(*r["cost_model"]["target_s"].values())
    # static steps throughout (this engine has them and the static_steps override), padding counted
    assert g["padding"]["off"]["static_share"] == 1.0 and 0 <= g["padding"]["aware"]["pad_row_share"] < 0.5
    assert 0 < g["padding"]["off"]["pad_kv_share"] < 1 and "of cache positions read beyond" in check["markdown"]

    sb = d["step_bench"]  # every shape at every level, in both engines, each from every call; two fused too
    shapes = ["plain", *(f"d{a}k{b}n{c}" for a, b, c in STEP_SHAPES)]
    assert sb["levels"] == list(size.step_levels) and sb["shapes"] == shapes
    assert sb["engines"]["eager"]["static_steps"] is False and sb["engines"]["static"]["static_steps"] is True
    assert sb["engines"]["static"]["replays_checked"] > 0 and sb["engines"]["fused"]["replays_checked"] > 0
    assert sb["fused_error"] is None and len(sb["fused_first_calls_s"]) == 2 * len(FUSED_SHAPES)
    assert set(FUSED_SHAPES) <= set(shapes)
    assert len(sb["cells"]) == len(size.step_levels) * (len(shapes) * 2 + len(FUSED_SHAPES) + len(MERGED_SHAPES))
    assert {c["shape"] for c in sb["cells"] if c["engine"] == "fused"} == set(FUSED_SHAPES)
    # hybrid trees in static steps, held to their graphs' contract, drafting from the stage's earlier calls
    assert {c["shape"] for c in sb["cells"] if c["engine"] == "hybrid"} == set(MERGED_SHAPES)
    assert sb["engines"]["hybrid"]["static_steps"] and sb["engines"]["hybrid"]["replays_checked"] > 0
    assert "| hybrid ms (tokens a row-step; host ms a step, of it hidden) |" in check["markdown"]
    # the targets, each read from its stage: a verdict on every level of the sweep, none failing to render
    assert "| target | measured | verdict |" in check["markdown"] and "targets failed" not in check["markdown"]
    assert all(f"at {B} running | " in check["markdown"] for B in size.levels)
    # and the log ends with them (a short-lived machine hands back the log's tail)
    tail = check["log"].strip().splitlines()[-3:]
    assert all(line.startswith("[gpu-check] target: ") for line in tail), tail
    # the host's work a hybrid step (the index, the merge), of which a part runs while the draft's step computes
    hybrid = [c for c in sb["cells"] if c["engine"] == "hybrid"]
    assert all(0 < c["host_hidden_ms"] < c["host_ms"] for c in hybrid), hybrid
    # kernels a step (here the profiler's kernel-launching ops): a tree step launches more than a plain one,
    # and the fused regions fewer than op by op
    k = sb["step_kernels"]
    assert set(k) == {"static", "fused"} and all(set(by) == set(FUSED_SHAPES) for by in k.values())
    assert k["static"]["d4k4n12"] > k["static"]["plain"] > k["fused"]["plain"] > 0
    assert k["static"]["d4k4n12"] > k["fused"]["d4k4n12"] > k["fused"]["plain"]
    for cell in sb["cells"]:
        # a call of a tree that emits several tokens a step may end inside its warm-up: plain calls never do
        assert cell["calls"] == size.step_reps and 1 <= cell["step_ms"]["n"] <= size.step_reps
        assert _positive(cell["step_ms"]["median"]) and cell["step_ms"]["se"] >= 0
        assert cell["tokens_per_row_step"] == 1 if cell["shape"] == "plain" else cell["tokens_per_row_step"] >= 1
        assert cell["step_ms"]["n"] == size.step_reps or cell["shape"] != "plain"
    fit = d["simulator_fit"]
    assert len(fit["points"]) == len(size.step_levels) * len(shapes) and "not a GPU" in fit["note"]
    # the fit minimises the squared relative error, and the simulator's own constants are one candidate
    assert (sum(p["error_after"] ** 2 for p in fit["points"])
            <= sum(p["error_before"] ** 2 for p in fit["points"]) * (1 + 1e-9))
    big = d["decode_8b"]
    assert not big["full_shape"] and "scaled-down" in big["skipped_full_shape"] and big["model"]["layers"] == 2
    assert set(big["batches"]) == {str(B) for B in size.big_batches}
    for row in big["batches"].values():
        assert _positive(row["step_ms"], row["bound_ms"]) and row["step_vs_bound"] > 1
    # the same batches with the layers' pointwise regions fused (compiled by Inductor's C++ backend here)
    assert "error" not in big["fused"] and set(big["fused"]["batches"]) == set(big["batches"])
    for row in big["fused"]["batches"].values():
        assert _positive(row["step_ms"], row["first_call_s"]) and row["step_vs_bound"] > 1
    assert big["engine"]["replays_checked"] > 0  # both variants held to their graphs' contract
    # no budget at test size: nothing skipped for time
    assert sb["levels_skipped_for_time"] == [] and big["skipped_for_time"] == [] and r["levels_skipped_for_time"] == []


@pytest.mark.slow  # sft, the draft and three stages at test size on the CPU: ~60 s
def test_a_stage_out_of_time_cuts_its_own_work_so_the_stages_after_it_keep_their_plans(tmp_path):
    """A budget spent before step_bench starts: each stage that can cut its work measures its first part
    (step_bench one compiling call and its first level, decode_8b its first batch op by op, rollout its
    first level, each as `gpu_check.json` then says) and records what it skipped; every stage still
    succeeds, and the report says what was skipped."""
    from fastgrpo.bench.gpu_check.driver import run

    out = tmp_path / "out"
    stages = ("environment", "sft", "draft", "step_bench", "decode_8b", "rollout")
    # 20 s: less than the 15 s margin plus sft's and the draft's time, and the plans after step_bench (210 s)
    assert run(out, "test", "cpu", tmp_path / "work", stages, ["engine.steps=static"], budget_s=20.0) == 0
    result = json.loads((out / "gpu_check.json").read_text())
    d = {n: s["data"] for n, s in result["stages"].items()}
    size = SIZES["test"]
    sb = d["step_bench"]
    assert sb["levels"] == [1] and sb["levels_skipped_for_time"] == list(size.step_levels[1:])
    assert len(sb["fused_first_calls_s"]) == 1 and sb["fused_error"].startswith("stopped for time after 1 compiling call (")
    assert not any(c["engine"] == "fused" for c in sb["cells"]) and {c["level"] for c in sb["cells"]} == {1}
    big = d["decode_8b"]
    assert list(big["batches"]) == ["1"] and big["fused"]["batches"] == {}
    # batch 1 op by op then fused; the next batches in rotated order (fused first at the second)
    assert big["skipped_for_time"] == [{"batch": 1, "fused": True}, {"batch": 16, "fused": True},
                                       {"batch": 16, "fused": False}, {"batch": 64, "fused": False},
                                       {"batch": 64, "fused": True}]
    r = d["rollout"]
    assert r["levels"] == [size.levels[0]] and r["levels_skipped_for_time"] == list(size.levels[1:])
    markdown = (out / "gpu_check.md").read_text()
    assert "no fused cells (stopped for time after 1 compiling call (" in markdown
    assert "Skipped for time (the stages after this one kept their plans): batch 1 fused, batch 16 fused" in markdown


@pytest.mark.slow  # the whole check at test size on the CPU: ~60 s (one run shared by three tests)
def test_the_markdown_has_every_table(check):
    md_text = check["markdown"]
    assert "| stage | status | seconds | planned s | peak GPU memory GB | result |" in md_text
    assert "every stage ok" in md_text
    for name in STAGES:
        assert f"| {name} | ok |" in md_text, name
    for table in ("Rollout at fixed concurrency", "GRPO batch", "memory-bandwidth bound", "One GRPO step",
                  "| running | off | static | static_aa |", "A/A", "aware's step shapes", "Decode steps alone",
                  "| running | shape | eager ms | static ms |", "| fused ms | static / fused |", "Kernels one step launches", "fitted to the static steps", "| max abs |",
                  "A scaled-down Llama-3.1-8B structure", "| fused: step ms |",
                  "CUDA graphs a GPU would capture (each step key's first call, counted by the replay check here): ",
                  "aware's own host time a call", "; aware's own host time "):
        assert table in md_text, table
    assert "| 4 | d6k8n48 |" in md_text and " ± " in md_text  # a step row, standard errors


@pytest.mark.slow  # the whole check at test size on the CPU: ~60 s (one run shared by three tests)
def test_the_run_imports_only_what_a_gpu_machine_has(check):
    """Every module outside the base packages' and the wheels' was hidden, and the run still passed;
    what it imported is among those allowed (what it looked for in vain, optional imports of the
    libraries, is printed)."""
    imports = check["imports"]
    print("looked for and not there:", ", ".join(imports["hidden"]))
    allowed = allowed_modules()
    # made at run time, not found on any path: Cython's runtime, torch.distributed.nn's generated remote module
    # (and Inductor's compiled kernels, loaded from its cache: counted apart, the fused regions of decode_8b)
    made = ("_cython", "cython_runtime", "_sysconfigdata_", "_remote_module_non_scriptable")
    assert imports["compiled_kernels"] > 0
    extra = [m for m in imports["imported"] if m not in allowed and not m.startswith(made)]
    assert not extra, f"imported beyond the GPU machine's packages and the wheels: {extra}"
    assert check["returncode"] == 0
    for needed in ("omegaconf", "math_verify", "megatron", "torch", "transformers"):
        assert needed in imports["imported"], needed
    for unwanted in ("mlflow", "matplotlib", "pyarrow", "deepspeed", "sglang"):
        assert unwanted not in imports["imported"], unwanted


def test_the_wheels_are_pinned_to_what_is_tested_and_bring_their_requirements():
    """Each wheel is pinned to the version installed here (what the tests ran), and each one's own
    requirements on Python 3.12 are other wheels or come with torch / transformers / safetensors / numpy."""
    base, wheels = closure(BASE), wheel_names()
    for spec in WHEELS:
        req = Requirement(spec)
        assert md.version(req.name) in req.specifier, f"{spec}: installed here is {md.version(req.name)}"
        missing = [r for r in _requirements(req.name) if _norm(r) not in base | wheels]
        assert not missing, f"{spec} needs {missing}, neither a wheel nor a requirement of {BASE}"


def test_both_gpu_installs_take_the_same_pins():
    """`make install-gpu` (tools/gpu_requirements.py) and the offline check's wheels (tools/gpu_wheels.sh,
    `--wheel-specs`) read one list: every wheel pin is in the GPU install verbatim, no other line of it
    names a wheel's package, each pin satisfies what pyproject.toml asks of that package, and the two
    tools print what pins.py says."""
    import tomllib

    reqs = gpu_requirements()
    by_name = {}
    for r in map(Requirement, reqs):
        assert _norm(r.name) not in by_name, f"{r.name} twice in the GPU install"
        by_name[_norm(r.name)] = r
    for spec in WHEELS:
        pin = Requirement(spec)
        assert str(by_name[_norm(pin.name)]) == str(pin), f"make install-gpu takes {by_name[_norm(pin.name)]}, the wheels {pin}"
    assert str(by_name["torch"]) == GPU_TORCH
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    asked = [Requirement(r) for r in project["dependencies"] + [r for e in project["optional-dependencies"].values()
                                                                    for r in e]]
    for spec in WHEELS:
        pin = Requirement(spec)
        version = next(iter(pin.specifier)).version
        for r in asked:
            if _norm(r.name) == _norm(pin.name):
                assert r.specifier.contains(version), f"{spec} outside pyproject.toml's {r}"
    tool = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_requirements.py")], cwd="/", capture_output=True,
                          text=True, timeout=60)
    assert tool.returncode == 0, tool.stderr
    assert tool.stdout.split() == reqs  # what `make install-gpu` installs (the script, run from anywhere)
    specs = subprocess.run([sys.executable, "-m", "fastgrpo.bench.gpu_check", "--wheel-specs"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert specs.stdout.split() == list(WHEELS)  # what tools/gpu_wheels.sh fetches


def test_a_carried_wheel_wins_over_an_older_installed_version_only():
    have = {"omegaconf": "2.1.1", "tqdm": "4.71.0", "sympy": "1.14.0"}
    wheels = [Path(f"{name}-{v}-py3-none-any.whl") for name, v in
              (("omegaconf", "2.4.0"), ("tqdm", "4.70.1"), ("sympy", "1.14.0"), ("psutil", "7.2.2"))]
    chosen = wheels_to_install(wheels, installed=have.get)
    assert sorted(w.name.split("-")[0] for w in chosen) == ["omegaconf", "psutil"]  # older, absent


def test_the_report_of_the_committed_h100_run_sets_it_against_the_simulator(tmp_path):
    """The committed H100 result re-rendered: its tables, and the decode step against bench simulate's
    roofline for the same shape (the simulator's price is a function of the recorded shape alone)."""
    run = tmp_path / "gpu_check.json"
    run.write_text((ROOT / "bench" / "gpu" / "gpu_check.json").read_text())
    out = subprocess.run([sys.executable, "-m", "fastgrpo.bench.gpu_check", "--report", str(run)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "gpu_check.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "every stage ok" in text
    sim = json.loads(run.read_text())["against_simulator"]
    one = sim["batches"]["1"]
    assert one["step_ms"] == pytest.approx(25.07, abs=0.01)
    # the roofline's price of this policy's decode step at batch 1: bf16 weights (24 layers of 12,845,056
    # parameters and a 296 x 1024 head) and the KV of 46 cached tokens (98,304 bytes each) over 80% of
    # 3.35 TB/s, plus 0.4 + 0.3 ms of overheads
    megabytes = 2 * (24 * 12_845_056 + 296 * 1024) / 1e6 + 46 * 98_304 / 1e6
    assert one["simulated_step_ms"] == pytest.approx(megabytes / (0.8 * 3350) + 0.7, rel=1e-6)
    assert one["step_ratio"] == pytest.approx(one["step_ms"] / one["simulated_step_ms"])
    assert "| 1 | 25.1 | 0.932 | 26.9x |" in text



def test_the_gpu_stages_fit_one_600_second_command():
    """Every stage has a plan; the plans fit the run's budget, and the budget leaves a minute of the
    600-second command for installing the wheels, starting Python and the report."""
    assert set(PLANNED_S) == set(STAGES)
    assert sum(PLANNED_S.values()) <= SIZES["gpu"].budget_s <= 540
    gpu = SIZES["gpu"]
    assert gpu.reps >= 3 and gpu.levels == gpu.step_levels == (1, 4, 16, 64, 256) and gpu.big_batches == (1, 16, 64)
    overrides = dict(o.split("=", 1) for o in gpu.overrides)
    # SFT and the draft's pretraining, each held to its plan less its evaluation and saving
    assert 60 * float(overrides["sft.max_minutes"]) <= PLANNED_S["sft"] - 30
    assert 60 * float(overrides["draft.pretrain_minutes"]) <= PLANNED_S["draft"] - 10


def test_the_8b_shape_is_the_configs_llama_3_1_8b():
    from transformers import LlamaConfig

    from fastgrpo.bench.gpu_check.decode import BIG_MODEL, ROOT, SCALED_8B, decoder_parameters

    config = LlamaConfig.from_json_file(str(ROOT / "configs" / "models" / BIG_MODEL))
    assert decoder_parameters(config) == 8_030_261_248  # the published size (configs/models/README.md)
    scaled = LlamaConfig.from_dict({**config.to_dict(), **SCALED_8B})
    # the structure kept: 4 query heads a KV head, an MLP 3.5x the width, untied, llama3 rope scaling
    assert scaled.num_attention_heads // scaled.num_key_value_heads == config.num_attention_heads // config.num_key_value_heads
    assert scaled.intermediate_size / scaled.hidden_size == config.intermediate_size / config.hidden_size
    assert not scaled.tie_word_embeddings and scaled.rope_scaling == config.rope_scaling
    assert scaled.head_dim * scaled.num_attention_heads == scaled.hidden_size


def test_the_rehearsal_runs_the_versions_the_last_gpu_check_found():
    """tools/gpu_rehearsal.sh installs pins.GPU_MACHINE: the torch and transformers the GPU machine's image
    held at the committed run. A new GPU run that finds other versions fails this until the pins follow."""
    from fastgrpo.bench.gpu_check.pins import GPU_MACHINE

    env = json.loads((ROOT / "bench" / "gpu" / "gpu_check.json").read_text())["stages"]["environment"]["data"]
    found = {"torch": env["torch"].split("+")[0], "transformers": env["transformers"]}
    assert dict(pin.split("==") for pin in GPU_MACHINE) == found
    script = (ROOT / "tools" / "gpu_rehearsal.sh").read_text()
    assert "GPU_MACHINE" in script and "--check-replays engine.steps=static" in script


def test_the_gpu_script_builds_the_c_parts_for_a_python_that_lacks_them(tmp_path):
    """tools/gpu_check.sh on a checkout whose C extensions are not built for its Python (the device machine's
    3.12 gets this machine's build for another Python, or none): it builds them in place before the run, and
    the environment stage records that the run has them (without them the index and the hybrid merge would
    run their slower Python equivalents, and the step timings would include that)."""
    from fastgrpo.bench.gpu_check.stages import compiled_extensions

    if not all(compiled_extensions().values()):
        pytest.skip("this install has no C compiler: the extensions are not built here either")
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".git", ".venv", "artifacts", "runs", "mlruns", "bench", "build", "*.so", "__pycache__", "gpu_wheels"))
    env = dict(os.environ, PYTHON=sys.executable, GPU_WHEELS=str(tmp_path / "none"), PYTHONPATH="")
    proc = subprocess.run(["bash", "tools/gpu_check.sh", "--size", "test", "--device", "cpu", "--stages", "environment",
                           "--out", str(tmp_path / "out")], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "building the C extensions" in proc.stdout
    assert {p.name.split(".")[0] for p in repo.glob("fastgrpo/**/*.so")} == {"_suffix_trie", "_tree_merge"}
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["stages"]["environment"]["data"]["compiled_extensions"] == {"suffix_trie": True, "tree_merge": True}
    assert "C extensions built" in (tmp_path / "out" / "gpu_check.md").read_text()
