"""sglang/srt/managers/io_struct.py: the requests and replies the emulation models (their fields a
subset of SGLang's, with the same defaults). SGLang's *ReqInput / *ReqOutput (but GenerateReqInput,
a dataclass) are keyword-only msgspec Structs; these are keyword-only dataclasses."""

import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union


@dataclass
class GenerateReqInput:
    rid: Optional[Union[str, List[str]]] = field(default=None, kw_only=True)
    text: Optional[Union[List[str], str]] = None
    input_ids: Optional[Union[List[List[int]], List[int]]] = None
    sampling_params: Optional[Union[List[Dict[str, Any]], Dict[str, Any]]] = None
    return_logprob: Optional[Union[List[bool], bool]] = None
    logprob_start_len: Optional[Union[List[int], int]] = None
    return_sampling_mask: Optional[Union[List[bool], bool]] = None
    stream: bool = False
    return_hidden_states: Union[List[bool], bool] = False
    return_routed_experts: bool = False  # one value for every request of a batch (io_struct.py:1001)

    def normalize_batch_and_arguments(self):
        if self.text is not None:
            raise ValueError("the emulation runs token ids only (skip_tokenizer_init)")
        if self.input_ids is None or len(self.input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        self.is_single = not isinstance(self.input_ids[0], list)
        n = 1 if self.is_single else len(self.input_ids)

        def per_request(value, default):
            value = default if value is None else value
            return [value] * n if not isinstance(value, list) else value

        self.sampling_params = per_request(self.sampling_params, {})
        self.return_logprob = per_request(self.return_logprob, False)
        self.return_sampling_mask = per_request(self.return_sampling_mask, False)
        self.return_hidden_states = per_request(self.return_hidden_states, False)
        if self.rid is None:
            self.rid = uuid.uuid4().hex if self.is_single else [uuid.uuid4().hex for _ in range(n)]
        if self.stream:
            raise ValueError("the emulation does not stream")


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    rid: Optional[str] = None
    serialized_named_tensors: List[bytes]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    selector: Literal["target", "draft", "all"] = "all"


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqOutput:
    rid: Optional[str] = None
    success: bool
    message: str


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    rid: Optional[str] = None
    selector: Literal["target", "draft", "all"] = "all"


@dataclass(kw_only=True)
class BeginWeightUpdateReqOutput:
    rid: Optional[str] = None
    success: bool
    message: str


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    rid: Optional[str] = None


@dataclass(kw_only=True)
class EndWeightUpdateReqOutput:
    rid: Optional[str] = None
    success: bool
    message: str


@dataclass(kw_only=True)
class FlushCacheReqInput:
    rid: Optional[str] = None
    timeout_s: Optional[float] = None


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    rid: Optional[str] = None
    success: bool
    message: str = ""


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput:
    rid: Optional[str] = None
    tags: Optional[List[str]] = None


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqOutput:
    rid: Optional[str] = None


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput:
    rid: Optional[str] = None
    tags: Optional[List[str]] = None


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqOutput:
    rid: Optional[str] = None
