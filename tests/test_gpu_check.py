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
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fastgrpo.bench.gpu_check import (BASE, DECODE_BATCHES, GPU_TORCH, SIZES, STAGES, SWEEP_MODES, WHEELS,
                                     gpu_requirements, wheels_to_install)

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


@atexit.register
def _report():
    imported = {n.partition(".")[0] for n in set(sys.modules) - before}
    with open(report, "w") as f:
        json.dump({"imported": sorted(imported), "hidden": sorted(hidden)}, f)


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
                           "--size", "test", "--device", "cpu", "--out", str(out), "--work", str(tmp / "work")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-6000:], sep="\n")
    return {"returncode": proc.returncode, "result": json.loads((out / "gpu_check.json").read_text()),
            "markdown": (out / "gpu_check.md").read_text(), "imports": json.loads(report.read_text())}


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow  # the whole check at test size on the CPU: ~30 s (one run shared by three tests)
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

    r = d["rollout"]
    assert [row["concurrency"] for row in r["sweep"]] == list(SIZES["test"].levels)
    for row in r["sweep"]:
        assert _positive(*(row[f"{mode}_tok_s"] for mode in SWEEP_MODES)) and row["aware_accept_len"] >= 1
    g = r["grpo_batch"]
    assert set(SWEEP_MODES) | {"off_unshared_prefill"} <= set(g["all_s"]) and _positive(*g["all_s"].values())
    assert any(m.startswith("static_") for m in g["all_s"])


@pytest.mark.slow  # the whole check at test size on the CPU: ~30 s (one run shared by three tests)
def test_the_markdown_has_every_table(check):
    md_text = check["markdown"]
    assert "| stage | status | seconds | planned s | peak GPU memory GB | result |" in md_text
    assert "every stage ok" in md_text
    for name in STAGES:
        assert f"| {name} | ok |" in md_text, name
    for table in ("Rollout at fixed concurrency", "GRPO batch", "memory-bandwidth bound", "One GRPO step"):
        assert table in md_text, table
    assert "| 16 |" in md_text  # a sweep row


@pytest.mark.slow  # the whole check at test size on the CPU: ~30 s (one run shared by three tests)
def test_the_run_imports_only_what_a_gpu_machine_has(check):
    """Every module outside the base packages' and the wheels' was hidden, and the run still passed;
    what it imported is among those allowed (what it looked for in vain, optional imports of the
    libraries, is printed)."""
    imports = check["imports"]
    print("looked for and not there:", ", ".join(imports["hidden"]))
    allowed = allowed_modules()
    # made at run time, not found on any path: Cython's runtime, torch.distributed.nn's generated remote module
    made = ("_cython", "cython_runtime", "_sysconfigdata_", "_remote_module_non_scriptable")
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
    assert f"| 1 | 25.1 | 0.932 | 26.9x |" in text

