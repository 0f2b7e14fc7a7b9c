"""The SGLang adapter and its emulation against sglang 0.5.23's own source (the pinned wheel, read
with ast by tests/sglang_conformance/: nothing of SGLang is imported, nothing needs CUDA), and
the GPU install against the wheel's pins. Skipped, with the reason, only when the wheel cannot be
downloaded."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

from fastgrpo.engines.sglang import adapter as sglang_engine
from fastgrpo.engines.sglang import requests as sglang_requests
from fastgrpo.engines.sglang.adapter import SGLANG_VERSION, server_args
from fastgrpo.engines.sglang.requests import sampling_params
from fastgrpo.config import load_config
from fastgrpo.types import Request, SamplingParams
from tests import sglang_conformance as conformance
from tests.sglang_conformance import ATTRIBUTE_TYPES, EMULATION, check_adapter, check_emulation, check_keys

ADAPTER = Path(sglang_engine.__file__)
ADAPTER_FILES = (ADAPTER, Path(sglang_requests.__file__))  # the adapter and its request/output formats


def scan_adapter(src):
    """Every SGLang use of the adapter's modules, as one scan's problems, uses and string keys."""
    scans = [check_adapter(src, f.read_text(), f.name) for f in ADAPTER_FILES]
    return SimpleNamespace(problems=[p for s in scans for p in s.problems], uses=[u for s in scans for u in s.uses],
                           string_keys=[k for s in scans for k in s.string_keys])

# keys the adapter reads that are not SGLang's: its own dicts, the environment, Hugging Face configs
ADAPTER_OWN_KEYS = {
    "spec_steps": "Completion.spec",
    "spec_emitted": "Completion.spec",
    "LOCAL_RANK": "the environment (torchrun)",
    "rope_parameters": "a Hugging Face config (transformers 5)",
    "candidate_steps": "SGLang's adaptive tiers file (checked below against adaptive_spec_params.py)",
    "SGLANG_PLUGINS": "the environment (SGLang's plugin allow-list: test_the_plugin_reaches_what_sglang_loads_and_calls)",
}


@pytest.fixture(scope="module")
def src():
    try:
        return conformance.source()
    except conformance.SourceUnavailable as e:
        pytest.skip(f"the sglang {SGLANG_VERSION} wheel could not be downloaded: {e}")


def test_the_source_read_is_the_pinned_sglang(src):
    version = src.module("sglang._version").defs["__version__"]
    assert ast.literal_eval(version.value) == SGLANG_VERSION
    assert hashlib.sha256(conformance.fetch_wheel().read_bytes()).hexdigest() == conformance.WHEEL_SHA256


def test_every_sglang_use_of_the_adapter_is_in_sglangs_source(src):
    scan = scan_adapter(src)
    assert scan.problems == []
    uses = set(scan.uses)
    # the scan saw what the adapter does (a scan that typed nothing would pass vacuously)
    for expected in [
        "sglang.srt.managers.io_struct.GenerateReqInput(input_ids, sampling_params, return_logprob, "
        "return_sampling_mask, return_hidden_states, return_routed_experts)",
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request()",
        "sglang.srt.managers.io_struct.UpdateWeightsFromTensorReqInput(serialized_named_tensors, flush_cache, "
        "weight_version, selector)",
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_weights_from_tensor()",
        "sglang.srt.entrypoints.engine.Engine.begin_weight_update(selector)",
        "sglang.srt.entrypoints.engine.Engine.release_memory_occupation(tags)",
        "sglang.srt.entrypoints.engine.Engine.resume_memory_occupation(tags)",
        "sglang.srt.entrypoints.engine.Engine.flush_cache()",
        "sglang.srt.entrypoints.engine.Engine.loop",
        "sglang.srt.utils.patch_torch.monkey_patch_torch_reductions()",
        "sglang.srt.utils.common.MultiprocessingSerializer.serialize()",
        "from sglang.srt.constants import GPU_MEMORY_ALL_TYPES",
        "sglang.__version__",
    ]:
        assert expected in uses, expected


WRONG = '''
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sglang


class Adapter:
    def __init__(self, engine: sglang.Engine):
        self._engine = engine

    def generate(self, requests, masked, capture):
        # a call SGLang refuses: Engine.generate has no return_sampling_mask (the check must say so)
        return self._engine.generate(input_ids=[r.prompt_ids for r in requests], sampling_params=[],
                                     return_logprob=True, return_sampling_mask=masked or None,
                                     return_hidden_states=capture)

    def more(self):
        from sglang.srt.managers.io_struct import GenerateReqInput, UpdateWeightsFromTensorReqInput
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorRequest
        from sglang.srt.utils import MultiprocessingSerializer

        UpdateWeightsFromTensorReqInput(serialized_named_tensors=[], selectors="draft")
        UpdateWeightsFromTensorReqInput(flush_cache=False)
        self._engine.update_weights_from_tensor([], selector="draft")
        self._engine.loop.run_until_complete(self._engine.tokenizer_manager.begin_weight_update(None, None, None))
        self._engine.tokenizer_manager.flush_cache()
        self._engine.loop.run_until_complete(self._engine.tokenizer_manager.flush_cache().__anext__())
        self._engine.scheduler.run()
        self._engine.release_memory_occupation(tag=["weights"])
        MultiprocessingSerializer.serialise([])
        obj = GenerateReqInput(input_ids=[[1]], return_hidden_state=True)


def stop(engine: sglang.Engine | None, other: None | sglang.Engin):
    # an optional SGLang parameter is still typed: its wrong call and the misspelt class are reported
    engine.shut_down()
'''


def test_the_checker_catches_wrong_uses_of_sglang(src):
    """A deliberately wrong adapter: the call the adapter made before its fix, and one of each kind
    of mistake the checker reads for."""
    problems = check_adapter(src, WRONG, "wrong.py").problems
    expected = [
        "Engine.generate has no parameter 'return_sampling_mask'",
        "has no such name",  # UpdateWeightsFromTensorRequest
        "UpdateWeightsFromTensorReqInput has no field 'selectors'",
        "UpdateWeightsFromTensorReqInput requires 'serialized_named_tensors'",
        "Engine.update_weights_from_tensor has no parameter 'selector'",
        "TokenizerManager.begin_weight_update takes at most 2 positional arguments, the call passes 3",
        "TokenizerManager.flush_cache(...) is a coroutine and is never run",
        "is a coroutine, not an async generator: it has no __anext__",
        "Engine has no attribute 'scheduler'",
        "Engine.release_memory_occupation has no parameter 'tag'",
        "MultiprocessingSerializer has no attribute 'serialise'",
        "GenerateReqInput has no field 'return_hidden_state'",
        "Engine has no attribute 'shut_down'",
        "annotation sglang.Engin: not a class",
        "sglang.Engin: sglang 0.5.23 has no such name",
    ]
    for message in expected:
        assert any(message in p for p in problems), (message, problems)
    assert len(problems) == len(expected), "\n".join(problems)


def test_the_keys_the_adapter_reads_are_sglangs(src):
    scan = scan_adapter(src)
    keys = {k for k, _ in scan.string_keys}
    sglang_keys = src.output_keys | set(src.server_args_fields)
    assert sorted(keys - sglang_keys - set(ADAPTER_OWN_KEYS)) == []
    assert {"output_token_sampling_mask", "output_token_sampling_logprobs", "output_token_logprobs", "cached_tokens",
            "hidden_states", "finish_reason", "spec_verify_ct", "num_retractions",
            "spec_correct_drafts_histogram", "routed_experts"} <= keys & src.output_keys
    tiers = src.module("sglang.srt.speculative.adaptive_spec_params").path.read_text()
    assert 'entry.get("candidate_steps")' in tiers and 'entry["candidate_steps"]' in tiers
    assert set(sglang_requests.FINISH_REASONS) <= src.finish_types == {"stop", "length", "abort"}


CONFIGS = [[f"speculation.policy={policy}", f"draft.online={online}", f"rollout.top_k={top_k}", "engine.tensor=2"]
           for policy in ("off", "static", "fastgrpo", "aware") for online in ("off", "sync")
           for top_k in (0, 20) if not (policy == "off" and online != "off")]


def test_the_engine_arguments_are_serverargs_fields_the_emulation_models(src):
    emulated = conformance.Source(EMULATION).class_named("sglang.srt.server_args.ServerArgs").fields
    for overrides in CONFIGS:
        cfg = load_config(None, ["engine.backend=sglang", "trainer.backend=megatron", "parallel.tensor=2", *overrides])
        mode = cfg.speculation.policy
        args = server_args(cfg, mode, Path("draft") if mode != "off" else None,
                           Path("tiers.json") if mode == "fastgrpo" else None, 0)
        assert check_keys(src, "server_args", args, owner=f"{overrides}: ") == []
        assert sorted(set(args) - set(emulated)) == []
    # routing replay: a mixture of experts' engine records its routing (without speculation: the config refuses it)
    cfg = load_config(None, ["engine.backend=sglang", "trainer.routing_replay=rollout", "speculation.policy=off",
                             "draft.online=off"])
    args = server_args(cfg, "off", None, None, 0, moe=True)
    assert args["enable_return_routed_experts"] is True
    assert check_keys(src, "server_args", args) == [] and sorted(set(args) - set(emulated)) == []


def test_the_sampling_parameters_are_sglangs(src):
    for sampling in (SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.9)):
        params = sampling_params(sampling, Request([1, 2], key=3), seed=1, index=0, max_new_tokens=7, stop_ids=[2, 9])
        assert params["stop_token_ids"] == [2, 9]
        assert check_keys(src, "sampling_params", params) == []


def test_the_emulation_declares_only_what_sglang_has(src):
    problems, checked = check_emulation(src)
    assert problems == []
    for name in ["sglang.srt.entrypoints.engine.Engine", "sglang.srt.managers.tokenizer_manager.TokenizerManager",
                 "sglang.srt.managers.io_struct.GenerateReqInput", "sglang.srt.server_args.ServerArgs",
                 "sglang.srt.sampling.sampling_params.SamplingParams", "sglang.srt.utils.MultiprocessingSerializer",
                 "sglang.srt.utils.patch_torch.monkey_patch_torch_reductions", "sglang.srt.constants.GPU_MEMORY_ALL_TYPES",
                 "sglang.__version__"]:
        assert name in checked


DRIFTS = [  # (file, old, new, what the checker says)
    ("sglang/srt/entrypoints/engine.py", 'def begin_weight_update(self, selector: str = "all"):',
     'def begin_weight_update(self, selector: str = "target"):', "'selector' defaults to 'target' here, 'all'"),
    ("sglang/srt/entrypoints/engine.py", "        rid: Optional[Union[List[str], str]] = None,\n    ):",
     "        rid: Optional[Union[List[str], str]] = None,\n        return_sampling_mask=None,\n    ):",
     "parameter 'return_sampling_mask' is not sglang's"),
    ("sglang/srt/managers/io_struct.py", "    timeout_s: Optional[float] = None",
     "    timeout_s: Optional[float] = None\n    force: bool = False", "FlushCacheReqInput.force: no such field"),
    ("sglang/srt/managers/tokenizer_manager.py", "async def flush_cache(", "def flush_cache(",
     "flush_cache is a sync here, a coroutine in sglang"),
    ("sglang/srt/server_args.py", "    sampling_mask_max_tokens: int = 4096", "    sampling_mask_max_tokens: int = 64",
     "sampling_mask_max_tokens defaults to 64 here, 4096 in sglang"),
    ("sglang/srt/constants.py", 'GPU_MEMORY_TYPE_WEIGHTS = "weights"', 'GPU_MEMORY_TYPE_WEIGHTS = "weight"',
     "GPU_MEMORY_TYPE_WEIGHTS = 'weight' here, 'weights' in sglang"),
    ("sglang/srt/entrypoints/engine.py", "        self.loop = asyncio.new_event_loop()",
     "        self.loop = asyncio.new_event_loop()\n        self.scheduler = None", "Engine.scheduler: sglang's Engine has no"),
]


@pytest.mark.parametrize("path, old, new, message", DRIFTS, ids=[d[3][:40] for d in DRIFTS])
def test_the_emulation_checker_catches_drift(src, tmp_path, path, old, new, message):
    copy = tmp_path / "emulation"
    shutil.copytree(EMULATION, copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / path).read_text()
    assert old in text
    (copy / path).write_text(text.replace(old, new, 1))
    problems, _ = check_emulation(src, copy)
    assert any(message in p for p in problems), problems


def test_sglang_values_the_adapter_and_the_emulation_mirror(src):
    fields = src.server_args_fields
    assert ast.literal_eval(fields["sampling_mask_max_tokens"]) == sglang_requests.SGLANG_MASK_CAP
    default_tiers = ast.literal_eval(src.module("sglang.srt.speculative.adaptive_spec_params")
                                     .defs["DEFAULT_ADAPTIVE_CONFIG"].value)
    steps = {k: v["candidate_steps"] for k, v in default_tiers.items()}
    assert max(max(v) for v in steps.values()) == sglang_requests.SGLANG_DEFAULT_ADAPTIVE_STEPS
    emulator = (EMULATION / "_sglang_emulator" / "common.py").read_text()
    assert f"DEFAULT_ADAPTIVE_CONFIG = {json.dumps(steps)}" in emulator
    assert conformance.literal(src.module("sglang.srt.sampling.sampling_params").defs["TOP_K_ALL"].value) == 1 << 30
    assert "TOP_K_ALL = 1 << 30" in emulator
    engine = src.class_named("sglang.srt.entrypoints.engine.Engine")
    for (owner, attribute), _ in ATTRIBUTE_TYPES.items():  # the attribute types the adapter scan relies on
        assert owner == engine.qualname and attribute in engine.attributes
    # reserved context slots for EAGLE: what eagle_reservation reproduces
    reserved = src.resolve("sglang.srt.managers.utils", "compute_num_reserved_tokens").node
    assert "spec.speculative_eagle_topk * spec.speculative_num_steps" in ast.unparse(reserved)
    assert "max_speculative_num_draft_tokens()" in ast.unparse(reserved)
    adaptive = src.resolve("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm").node
    assert "return max(candidate_steps) + 1" in ast.unparse(adaptive)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> Path:
    """A randomly initialised Llama of a few thousand parameters (what runs does not matter here)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 eos_token_id=2)).save_pretrained(path)
    return path


def test_the_emulated_outputs_carry_sglangs_keys(src, small_llama):
    from tests.sglang_emulated import emulated_sglang

    with emulated_sglang():
        import sglang

        engine = sglang.Engine(model_path=str(small_llama), enable_return_hidden_states=True,
                               enable_deterministic_inference=True)
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=[[1, 5, 6], [1, 5, 7]], return_logprob=True, return_sampling_mask=True,
                               return_hidden_states=True,
                               sampling_params=[{"top_k": 3, "max_new_tokens": 3, "sampling_seed": 1}] * 2)
        outs = engine.loop.run_until_complete(engine.tokenizer_manager.generate_request(obj, None).__anext__())
        engine.shutdown()
    keys = {k for o in outs for k in o} | {k for o in outs for k in o["meta_info"]} | {
        k for o in outs for k in o["meta_info"]["finish_reason"]}
    assert check_keys(src, "output", keys) == []
    assert {o["meta_info"]["finish_reason"]["type"] for o in outs} <= src.finish_types


# -- the GPU install ----------------------------------------------------------------------------------------

def gpu_requirements() -> list[str]:
    from tools.gpu_requirements import requirements

    return requirements()


def test_the_gpu_install_takes_sglangs_own_pins(src):
    reqs = {Requirement(r).name.lower(): Requirement(r) for r in gpu_requirements()}
    pins = {}
    for line in conformance.metadata_requirements():
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate({"extra": "", "sys_platform": "linux", "platform_machine": "x86_64"}):
            pins[r.name.lower()] = r
    assert str(reqs["sglang"].specifier) == f"=={SGLANG_VERSION}"
    assert str(reqs["torch"].specifier) == str(pins["torch"].specifier) == "==2.14.1"  # not the CPU pin
    for name, r in reqs.items():  # every exact pin of SGLang's satisfies what fastgrpo asks of that package
        exact = [s.version for s in pins[name].specifier if s.operator == "=="] if name in pins else []
        for version in exact:
            assert r.specifier.contains(version), f"{r} excludes sglang's {name}=={version}"


def test_the_gpu_install_resolves(src):
    """pip resolves the GPU install (`--dry-run`, nothing installed); a success is remembered per
    requirement list in the cache, so this reaches PyPI once per change of the list."""
    from tools.gpu_requirements import resolve, unreachable

    reqs = gpu_requirements()
    marker = conformance.cache_dir() / f"gpu-resolves-{hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:16]}.json"
    if not marker.is_file():
        ok, chosen, out = resolve(reqs)
        if not ok:
            if unreachable(out):
                pytest.skip(f"pip could not reach the package index to resolve the GPU install: {out.strip()[-300:]}")
            pytest.fail(f"the GPU install does not resolve:\n{out[-3000:]}")
        marker.write_text(json.dumps(chosen))
    chosen = json.loads(marker.read_text())
    assert chosen["torch"] == "2.14.1" and chosen["sglang"] == SGLANG_VERSION
    assert Requirement(next(r for r in reqs if r.startswith("transformers"))).specifier.contains(chosen["transformers"])


def test_only_an_unreachable_index_skips_the_gpu_resolve(tmp_path):
    """test_the_gpu_install_resolves skips only when pip could not reach the package index: a pin the
    index has no distribution for fails it (pip's "No matching distribution found"), as a conflict
    does. pip's own outputs, offline: a local index listing only version 1.0 of a package asked at
    2.0, one listing nothing, and an index nobody answers at (where pip says "No matching
    distribution found" too, after warning of the connection errors as it retries)."""
    from tools.gpu_requirements import resolve, unreachable

    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "fastgrpo_probe-1.0-py3-none-any.whl").write_bytes(b"")  # pip lists it by its name
    local = ["--no-index", "--find-links", str(tmp_path / "index")]
    for pin in ("fastgrpo-probe==2.0", "fastgrpo-absent==1.0"):
        ok, _, out = resolve([pin], timeout=120, index=local)
        assert not ok and "No matching distribution found" in out and not unreachable(out), out
    ok, _, out = resolve(["fastgrpo-probe==2.0"], timeout=120,
                         index=["--index-url", "http://127.0.0.1:9/simple", "--retries", "1", "--timeout", "5"])
    assert not ok and unreachable(out), out


# -- aware on SGLang: the plugin, the slots, the capture sizes, the EMA (speculation/sglang_tiers.py) --
def _source_of(src, module: str, name: str) -> str:
    return ast.unparse(src.resolve(module, name).node)


def test_the_plugin_reaches_what_sglang_loads_and_calls(src):
    """fastgrpo's entry point is in the group SGLang loads in each scheduler process before the
    Scheduler exists; collective_rpc calls a Scheduler method by name with flat scalar arguments; the
    chain of attributes the plugin follows is assigned where SGLang builds it."""
    plugins = src.module("sglang.srt.plugins")
    assert ast.literal_eval(plugins.defs["GENERAL_PLUGINS_GROUP"].value) == "sglang.srt.plugins"
    assert "allowed_str = envs.SGLANG_PLUGINS.get()" in plugins.path.read_text()
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]\nfastgrpo = "fastgrpo.engines.sglang.plugin:register"' in pyproject
    run = _source_of(src, "sglang.srt.managers.scheduler", "run_scheduler_process")
    assert run.index("load_plugins()") < run.index("Scheduler(")
    rpc = src.class_named("sglang.srt.entrypoints.engine.Engine").method("collective_rpc")
    assert [a.arg for a in rpc.args.args] == ["self", "method"] and rpc.args.kwarg is not None
    assert "RpcReqInput(method=method, parameters=kwargs)" in ast.unparse(rpc)
    scheduler = src.class_named("sglang.srt.managers.scheduler.Scheduler")
    handle = ast.unparse(scheduler.method("handle_rpc_request"))
    assert "getattr(self, recv_req.method)" in handle and "func(**recv_req.parameters)" in handle
    assert "self.draft_worker = DraftWorkerClass(**draft_worker_kwargs)" in ast.unparse(scheduler.method("maybe_init_draft_worker"))
    worker = src.class_named("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2")
    assert "self.adaptive_controller = AdaptiveController(" in ast.unparse(worker.method("__init__"))
    assert "self.activate_step_by_batch(batch.seq_lens.shape[0])" in ast.unparse(worker.method("forward_batch_generation"))
    controller = src.class_named("sglang.srt.speculative.adaptive_runtime_state.AdaptiveController")
    assert "self.params: AdaptiveSpecPolicy = policy" in ast.unparse(controller.method("__init__"))
    assert "self.params.get_steps_for_batch(batch_size)" in ast.unparse(controller.method("activate_step_by_batch"))
    params = src.class_named("sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams")
    assert "self._slots[bs] = AdaptiveStepSlot(" in ast.unparse(params.method("__init__"))
    assert "return self._route(batch_size).current_steps" in ast.unparse(params.method("get_steps_for_batch"))
    slot = src.class_named("sglang.srt.speculative.adaptive_spec_params.AdaptiveStepSlot")
    assert {"candidate_steps", "current_steps", "warmup_batches"} <= slot.attributes
    assert "if self._batch_count <= self.warmup_batches:\n        return False" in ast.unparse(slot.method("update"))


def test_sglang_counts_a_depth_0_step_as_a_verify_step(src):
    """What the emulation does and `plain_steps` undoes: a depth-0 slot's step is a trivial verify
    (a one-node tree), which the scheduler counts as a verify step, its correct drafts (0) into the
    histogram."""
    worker = src.class_named("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2")
    forward = ast.unparse(worker.method("forward_batch_generation"))
    assert "elif self.speculative_num_steps == 0:\n            verify_input = self._build_trivial_verify_input(batch)" in forward
    processor = src.module("sglang.srt.managers.scheduler_components.batch_result_processor").path.read_text()
    counted = processor[processor.index("def _resolve_spec_v2_tokens"):]
    assert "length - num_non_draft for length in accept_lens" in counted
    assert counted.index("req.spec_verify_ct += 1") < counted.index("req.update_spec_correct_drafts_histogram(num_correct_drafts)")


def test_sglang_loads_plugins_as_emulated(src):
    """SGLANG_PLUGINS is read as it is, any non-empty value an allow-list (commas or blanks alone: an
    empty one); a plugin that fails to load or raises is logged and skipped."""
    plugins = src.module("sglang.srt.plugins").path.read_text()
    assert "if allowed_str:\n        allowed_set = {x.strip() for x in allowed_str.split(\",\") if x.strip()}" in plugins
    assert "if allowed_set is not None and ep.name not in allowed_set:" in plugins
    env = src.class_named("sglang.srt.environ.EnvStr")
    assert ast.unparse(env.method("parse")).endswith("return value")
    assert 'SGLANG_PLUGINS = EnvStr("")' in src.module("sglang.srt.environ").path.read_text()
    load = ast.unparse(src.resolve("sglang.srt.plugins", "load_plugins").node)
    assert "try:\n            func()" in load and "except Exception:\n            logger.exception(" in load
    assert "except Exception:\n            logger.exception('Failed to load plugin" in ast.unparse(
        src.resolve("sglang.srt.plugins", "load_plugins_by_group").node)


def test_the_tiers_model_is_sglangs(src):
    """SGLang's default tiers and its captured decode sizes with speculation, as sglang_tiers has them."""
    from fastgrpo.speculation.sglang_tiers import (SGLANG_DEFAULT_TIERS, SLOT_DEFAULTS, plain_capture_sizes,
                                                   spec_capture_sizes)

    module = src.module("sglang.srt.speculative.adaptive_spec_params")
    assert ast.literal_eval(module.defs["DEFAULT_ADAPTIVE_CONFIG"].value) == SGLANG_DEFAULT_TIERS
    init = ast.unparse(src.class_named("sglang.srt.speculative.adaptive_spec_params.AdaptiveStepSlot").method("__init__"))
    for key, value in SLOT_DEFAULTS.items():
        assert f"cfg.get('{key}', {value!r})" in init, key
    fn = src.resolve("sglang.srt.arg_groups.cuda_graph_hook", "generate_decode_cuda_graph_batch_sizes").node
    namespace = {"resolving_view": lambda args: args}
    exec(compile(ast.Module([fn], []), "cuda_graph_hook.py", "exec"), namespace)
    args = SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm="EAGLE")
    for max_bs in (1, 7, 8, 48, 128, 200, 512):
        assert spec_capture_sizes(max_bs) == namespace["generate_decode_cuda_graph_batch_sizes"](args, max_bs), max_bs
        plain = SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm=None)
        assert plain_capture_sizes(max_bs) == namespace["generate_decode_cuda_graph_batch_sizes"](plain, max_bs)


def _real_adaptive_params(src):
    """adaptive_spec_params.py itself, run with its sglang imports stubbed (they only log and check
    server arguments): SGLang's own slot and routing code."""
    import sys
    import types

    stubs = {"sglang.srt.arg_groups.overrides": dict(resolved_view=None, resolving_view=None),
             "sglang.srt.runtime_context": dict(attn_dp_enabled_of=None),
             "sglang.srt.speculative.spec_info": dict(SpeculativeAlgorithm=None),
             "sglang.srt.utils": dict(log_info_on_rank0=lambda logger, msg: None)}
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        for name, attrs in stubs.items():
            sys.modules[name] = types.SimpleNamespace(**attrs)
        namespace: dict = {"__name__": "sglang_adaptive_spec_params"}
        path = src.module("sglang.srt.speculative.adaptive_spec_params").path
        exec(compile(path.read_text(), str(path), "exec"), namespace)
        return namespace
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_the_simulated_sglang_controller_decides_as_sglangs_own_code(src, tmp_path):
    """On random decode traces (batch sizes, accepted drafts per row), our model of SGLang's adaptive
    controller (which the simulator's `sglang_adaptive` runs) picks the same depth at every step as
    SGLang's AdaptiveSpeculativeParams, for its default tiers and for aware's."""
    import random

    from fastgrpo.speculation.sglang_tiers import SGLANG_DEFAULT_TIERS, AdaptiveSlots, spec_capture_sizes

    real = _real_adaptive_params(src)
    sizes = spec_capture_sizes(64)
    aware_like = {str(s): {"candidate_steps": sorted({0, 1, s % 5 + 1, 7}), "down_hysteresis": 0.0} for s in sizes[::3]}
    for config in (SGLANG_DEFAULT_TIERS, aware_like):
        path = tmp_path / "tiers.json"
        path.write_text(json.dumps(config))
        union = sorted({s for e in config.values() for s in e["candidate_steps"]})
        theirs = real["AdaptiveSpeculativeParams"](initial_steps=union[len(union) // 2], cfg_path=str(path))
        theirs.set_cuda_graph_bs(sizes)
        ours = AdaptiveSlots(config, sizes)
        rng = random.Random(0)
        moves = 0
        for step in range(3000):
            batch = rng.choice([1, 2, 3, 5, 9, 17, 33, 50, 64])
            assert ours.steps(batch) == theirs.get_steps_for_batch(batch), (step, batch)
            depth = ours.steps(batch)
            skill = 0.9 if (step // 500) % 2 == 0 else 0.3  # acceptance drifts, so depths move both ways
            correct = [next(a for a in range(depth + 1) if a == depth or rng.random() > skill) for _ in range(batch)]
            before = ours.steps(batch)
            ours.verified(correct, batch)
            theirs.on_verify_complete(correct, batch)
            moves += ours.steps(batch) != before
        assert moves > 10  # the trace moved the depths (a comparison of frozen slots would be vacuous)
