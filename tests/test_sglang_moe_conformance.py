"""SGLang conformance for a mixture of experts (against the pinned 0.5.23 wheel's source): the tensor names a
Qwen3-MoE weight push sends are the ones SGLang's load_weights maps, and the routed-experts record the
adapter decodes rests on what SGLang's code does, cited line by line. The wheel's source fixture and the
checkers are tests/test_sglang_conformance.py's and tests/sglang_conformance's."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastgrpo.engines.sglang import requests as sglang_requests
from fastgrpo.config import load_config
from fastgrpo.types import SamplingParams
from tests import sglang_conformance as conformance
from tests.test_sglang_conformance import src  # noqa: F401 (its fixture: the wheel's source)


QWEN3_MOE = "sglang.srt.models.qwen3_moe"


def _sglang_qwen3_moe_parameters(src, layers: int) -> list[str]:
    """The parameter names SGLang's Qwen3-MoE model holds (unquantised, no pipeline split), each part
    read in its source: the modules' attribute names, every layer sparse, the fused experts' tensors."""
    def attributes(dotted: str) -> set[str]:
        return src.class_named(f"{QWEN3_MOE}.{dotted}").attributes

    assert {"model", "lm_head"} <= attributes("Qwen3MoeForCausalLM")
    assert {"embed_tokens", "norm"} <= attributes("Qwen3MoeModel")  # Qwen2MoeModel's __init__
    model_init = ast.unparse(src.class_named("sglang.srt.models.qwen2_moe.Qwen2MoeModel").method("__init__"))
    assert [b.qualname for b in src.class_named(f"{QWEN3_MOE}.Qwen3MoeModel").bases] == [
        "sglang.srt.models.qwen2_moe.Qwen2MoeModel"]
    assert "self.layers, self.start_layer, self.end_layer = make_pp_layers(" in model_init
    assert {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"} <= attributes("Qwen3MoeDecoderLayer")
    assert {"qkv_proj", "o_proj", "q_norm", "k_norm"} <= attributes("Qwen3MoeAttention")
    assert {"experts", "gate"} <= attributes("Qwen3MoeSparseMoeBlock")
    # every layer is a sparse block, whatever mlp_only_layers or decoder_sparse_step say
    facts = ast.unparse(src.class_named(f"{QWEN3_MOE}.Qwen3MoeDecoderLayer").method("stage_facts"))
    assert "is_layer_sparse = True" in facts
    unquantised = ast.unparse(src.class_named(
        "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod").method("create_weights"))
    assert "layer.register_parameter('w13_weight', w13_weight)" in unquantised
    assert "layer.register_parameter('w2_weight', w2_weight)" in unquantised
    per_layer = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                 "mlp.gate.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight"]
    return ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{p}" for i in range(layers) for p in per_layer]


def _pushed(named_tensors) -> list[tuple[str, object]]:
    """What the SGLang adapter hands SGLang's update_weights_from_tensor for a push of `named_tensors`
    through the weight bridge: the adapter's own code, its SGLang engine a stand-in that accepts."""
    from types import SimpleNamespace

    from fastgrpo.bridge import WeightBridge
    from fastgrpo.engines.sglang.adapter import SGLangEngine
    from tests.conftest import tiny_config
    from tests.sglang_emulated import emulated_sglang

    sent: list[tuple[str, object]] = []
    accept = lambda *args, **kwargs: (True, "")  # noqa: E731
    stand_in = SimpleNamespace(begin_weight_update=accept, end_weight_update=accept, flush_cache=accept)
    with emulated_sglang():
        engine = SGLangEngine(stand_in, tiny_config(Path("unused")), None, "off", {})
        engine._push = lambda bucket, selector, version: sent.extend(bucket)
        WeightBridge([engine], bucket_bytes=1 << 16).push(named_tensors, version=0)
        assert engine.weights_version == 0
    return sent


def test_a_qwen3_moe_push_names_what_sglangs_load_weights_maps(src):
    """A weight push of the torch trainer's tiny Qwen3-MoE (experts stacked, as transformers 5 holds them)
    reaches SGLang as tensors its Qwen3-MoE `load_weights` loads, each once, into the parameter and
    shard it belongs to: experts one tensor each, into the fused w13 (gate as shard w1, up as w3) and
    w2 of their expert id. Run on SGLang's own load_weights (sglang_conformance.load_weights_calls),
    which is what update_weights_from_tensor calls without a load_format (the adapter sends none).
    The control: the stacked expert tensors themselves, sent as they are, load nowhere (SGLang skips
    them without a word)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.types import SamplingParams

    updater = src.class_named("sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater")
    update = ast.unparse(updater.method("update_weights_from_tensor"))
    assert "elif load_format is None:\n        self.get_model().load_weights(named_tensors)" in update
    request = src.class_named("sglang.srt.managers.io_struct.UpdateWeightsFromTensorReqInput")
    assert ast.unparse(request.fields["load_format"]) == "None"

    experts, layers = 8, 2
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
                         num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    trainer = TorchPolicyTrainer(policy, GRPOConfig(), OptimConfig(), SamplingParams())
    sent = _pushed(trainer.export_weights())
    parameters = _sglang_qwen3_moe_parameters(src, layers)
    calls = conformance.load_weights_calls(src, f"{QWEN3_MOE}.Qwen3MoeForCausalLM", cfg, parameters, sent)
    unloaded = [n for n, c in calls.items() if len(c) != 1]
    assert unloaded == [], [(n, calls[n]) for n in unloaded]
    assert len(sent) == len(calls)  # no name sent twice
    into = {n: c[0] for n, c in calls.items()}
    for j in (0, experts - 1):
        gate, up, down = (into[f"model.layers.1.mlp.experts.{j}.{w}.weight"] for w in ("gate_proj", "up_proj", "down_proj"))
        assert (gate.parameter, gate.kwargs) == ("model.layers.1.mlp.experts.w13_weight", {"shard_id": "w1", "expert_id": j})
        assert (up.parameter, up.kwargs) == ("model.layers.1.mlp.experts.w13_weight", {"shard_id": "w3", "expert_id": j})
        assert (down.parameter, down.kwargs) == ("model.layers.1.mlp.experts.w2_weight", {"shard_id": "w2", "expert_id": j})
    assert (into["model.layers.0.self_attn.k_proj.weight"].parameter,
            into["model.layers.0.self_attn.k_proj.weight"].args) == ("model.layers.0.self_attn.qkv_proj.weight", ("k",))
    assert {c.parameter for c in into.values()} == set(parameters)  # every parameter SGLang holds gets its tensors
    stacked = [(n, t) for n, t in trainer.export_weights() if ".mlp.experts." in n]
    assert len(stacked) == 2 * layers
    assert all(c == [] for c in conformance.load_weights_calls(
        src, f"{QWEN3_MOE}.Qwen3MoeForCausalLM", cfg, parameters, stacked).values())


# -- routed experts (routing replay) -------------------------------------------------------------------------

# each place in SGLang's source the adapter's routing rests on, as it cites it (path under sglang/srt/,
# first and last line), with text those lines hold: a newer wheel that moved or changed them fails here
ROUTED_CITATIONS = [
    ("state_capturer/routed_experts.py", 72, 93, "topk_size = model_config.hf_text_config.num_experts_per_tok"),
    ("state_capturer/routed_experts.py", 72, 93, "num_layers = model_config.hf_text_config.num_hidden_layers"),
    ("state_capturer/routed_experts.py", 79, 83, "# FIXME: spec decoding's num_verify_tokens is still not accounted"),
    ("state_capturer/routed_experts.py", 79, 83, "max_running_requests * get_parallel().num_dp_ranks"),
    ("state_capturer/routed_experts.py", 177, 190, "module.topk_config.allow_routed_experts_capture = False"),
    ("state_capturer/base.py", 38, 42, "self.buffer = torch.zeros("),
    ("state_capturer/base.py", 63, 75, "dtype=torch.int32"),
    ("state_capturer/base.py", 63, 75, "self.buffer.zero_()"),
    ("state_capturer/base.py", 117, 118, "self.host_cache.buffer[self.out_cache_loc] = self.topk"),
    ("state_capturer/base.py", 173, 188, "req_to_token_pool.req_to_token[req_pool_idx][start_len : seqlen - 1]"),
    ("state_capturer/base.py", 190, 221, "self.host_cache.buffer[out_cache_loc_cpu] = slice_gpu.cpu()"),
    ("layers/moe/topk.py", 2574, 2574, "capture_routed_experts_if_allowed(topk_config, layer_id, routed_topk_ids)"),
    ("model_executor/model_runner.py", 721, 723, "disable_routed_experts_capture_for_draft(self.model)"),
    ("model_executor/model_runner.py", 1222, 1227, "if self.is_draft_worker:"),
    ("managers/scheduler_components/batch_result_processor.py", 136, 161,
     "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)"),
    ("managers/scheduler_components/batch_result_processor.py", 151, 153, "if capturer is None:\n            return"),
    ("managers/detokenizer_manager.py", 432, 448, 'pybase64.b64encode(item.numpy().tobytes()).decode("utf-8")'),
    ("managers/tokenizer_manager.py", 2602, 2609, 'val = pybase64.b64encode(val.numpy().tobytes()).decode("utf-8")'),
    ("managers/tokenizer_manager.py", 2602, 2609, 'meta_info["routed_experts"] = val'),
    ("speculative/eagle_worker_common.py", 772, 784, "if finalize_tree_path and not batch.forward_mode.is_idle() and topk > 1:"),
    ("speculative/eagle_worker_common.py", 772, 784, "predict = _finalize_accept_tree_path("),
    ("speculative/spec_utils.py", 859, 910, "token_to_kv_pool_allocator.get_kvcache().move_kv_cache("),
]


def _lines(src, path: str, first: int, last: int) -> str:
    return "\n".join((src.root / "sglang" / "srt" / path).read_text().splitlines()[first - 1: last])


def test_what_the_routing_record_rests_on_is_where_the_adapter_cites_it(src):
    """Every file:line the adapter's refusal of routing under speculation cites (ROUTING_SPECULATION, and
    the config's refusal) is checked below, and each checked range holds what the adapter says it does:
    the per-slot int32 host rows of every layer's top-k, zeroed; positions 0..seqlen-2 through the stop;
    base64 of the bytes; the draft never captured; a tree's accepted path moved in the KV cache but not
    in the record (finalize writes at the verify's own slots); the FIXME on the buffer's size."""
    import re

    from fastgrpo.config import ConfigError

    for path, first, last, text in ROUTED_CITATIONS:
        assert text in _lines(src, path, first, last), (path, first, last, text)
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["engine.backend=sglang", "trainer.routing_replay=rollout", "speculation.policy=static"])
    checked = {(p, f, la) for p, f, la, _ in ROUTED_CITATIONS}
    for text in (sglang_requests.ROUTING_SPECULATION, str(refused.value)):
        cited = re.findall(r"([\w/]+\.py):(\d+)(?:-(\d+))?", text)
        assert len(cited) >= 2
        for path, first, last in cited:
            assert (path, int(first), int(last or first)) in checked, (path, first, last)


def test_the_routing_record_leaves_sglang_as_the_emulation_encodes_it_and_the_adapter_decodes_it(src):
    """SGLang's own code, compiled from the wheel, gathers a request's rows from a per-slot host buffer
    (`BaseTopkCapturer.get_topk`: a prompt whose first 3 positions a cache hit shares with another
    request's slots), encodes them (`DetokenizerManager._b64_encode_per_request`, pybase64 standing in
    as the standard library's base64, which writes the same text) and decodes them as it tells users to
    (`extract_routed_experts_from_meta_info`). The emulation's capturer gathers and encodes the same
    rows to the same string, and the adapter's `decode_routing` reads that string as the embedded engine
    records: int16 [T, layers, k], the last position -1. A record of the wrong size or with ids outside
    the model's experts is refused."""
    from types import SimpleNamespace as NS
    from typing import List, Optional

    import base64
    import numpy as np
    import torch

    from fastgrpo.engines.sglang.requests import decode_routing
    from tests.sglang_emulated import emulated_sglang

    pybase64 = NS(b64encode=base64.b64encode, b64decode=base64.b64decode)
    get_topk = conformance.sglang_function(src, "sglang.srt.state_capturer.base", "get_topk", "BaseTopkCapturer")
    encode = conformance.sglang_function(src, "sglang.srt.managers.detokenizer_manager", "_b64_encode_per_request",
                                         "DetokenizerManager", {"pybase64": pybase64, "Optional": Optional,
                                                                "List": List, "torch": torch})
    extract = conformance.sglang_function(src, "sglang.srt.state_capturer.routed_experts",
                                          "extract_routed_experts_from_meta_info", namespace={"np": np,
                                                                                              "pybase64": pybase64})
    layers, k, experts, slots = 3, 2, 8, 40
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, experts, (slots, layers, k), generator=g, dtype=torch.int32)
    prompt, response = [5, 6, 7, 8, 9], [10, 11, 12]
    T = len(prompt) + len(response)
    req_slots = [21, 22, 23, 3, 30, 31, 32, 33]  # 21-23 a cache hit's slots; 33, the last token's, is never read
    pool = NS(req_to_token=torch.tensor([req_slots]))
    rows = get_topk(NS(host_cache=NS(buffer=host)), 0, T, pool)
    assert torch.equal(rows, host[req_slots[: T - 1]])  # positions 0..T-2
    [sent] = encode([rows])
    with emulated_sglang():
        from _sglang_emulator.routed import RoutedExperts, encode as emulated_encode

        capturer = RoutedExperts({}, layers, k)
        capturer.host = {s: host[s] for s in range(slots)}
        assert torch.equal(capturer.get_topk(req_slots, T), rows)
        assert emulated_encode(capturer.get_topk(req_slots, T)) == sent
    meta = {"routed_experts": sent}
    assert extract({"meta_info": meta}).tolist() == rows.flatten().tolist()
    record = decode_routing(meta, len(prompt), len(response), layers, k, experts)
    assert record.dtype == torch.int16 and record.shape == (T, layers, k)
    assert torch.equal(record[:-1], rows.to(torch.int16)) and (record[-1] == -1).all()
    with pytest.raises(RuntimeError, match="positions 0..6 of 3 layers x top-2 are 42"):
        decode_routing({"routed_experts": encode([rows[:-1]])[0]}, len(prompt), len(response), layers, k, experts)
    with pytest.raises(RuntimeError, match="the model has 4"):
        decode_routing(meta, len(prompt), len(response), layers, k, 4)
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        decode_routing({}, len(prompt), len(response), layers, k, experts)
