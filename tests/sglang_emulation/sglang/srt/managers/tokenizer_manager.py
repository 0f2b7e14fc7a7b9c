"""sglang/srt/managers/tokenizer_manager.py: the TokenizerManager methods the emulation models
(SGLang's come from TokenizerManager and its TokenizerControlMixin). Requests go to the emulated
scheduler in-process instead of over ZMQ."""

from typing import Optional

from _sglang_emulator import Scheduler, _Request
from sglang.srt.managers.io_struct import (
    BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.sampling.sampling_params import SamplingParams


class TokenizerManager:
    def __init__(self, server_args, port_args):
        self.server_args = server_args
        self._scheduler = Scheduler(server_args)

    async def generate_request(self, obj: GenerateReqInput, request=None):
        obj.normalize_batch_and_arguments()
        ids = [obj.input_ids] if obj.is_single else obj.input_ids
        rids = [obj.rid] if obj.is_single else obj.rid
        requests = []
        for i, prompt in enumerate(ids):
            params = SamplingParams(**obj.sampling_params[i])
            params.verify(self._scheduler.vocab)
            if obj.return_hidden_states[i] and not self.server_args.enable_return_hidden_states:
                raise ValueError("The server is not configured to return the hidden states. Please set "
                                 "`--enable-return-hidden-states` to enable this feature.")
            self._scheduler.validate(prompt, params)
            # return_routed_experts: no check here; without the server flag SGLang has no capturer and the
            # output no key (scheduler_components/batch_result_processor.py:151-153)
            requests.append(_Request(rids[i], list(prompt), params, bool(obj.return_hidden_states[i]),
                                     bool(obj.return_sampling_mask[i]), bool(obj.return_routed_experts)))
        self._scheduler.last_params = [dict(p) for p in obj.sampling_params]  # what SGLang received, for tests
        self._scheduler.run(requests)
        outputs = [self._scheduler.output(r) for r in requests]
        self._scheduler.last_outputs = outputs
        yield outputs[0] if obj.is_single else outputs

    async def flush_cache(self, timeout_s: Optional[float] = None) -> FlushCacheReqOutput:
        return FlushCacheReqOutput(success=self._scheduler.flush())

    async def begin_weight_update(self, obj: BeginWeightUpdateReqInput, request=None):
        return self._scheduler.begin(obj.selector)

    async def end_weight_update(self, obj: EndWeightUpdateReqInput, request=None):
        return self._scheduler.end()

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput, request=None):
        return self._scheduler.update_from_tensor(obj)

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request=None):
        self._scheduler.release(obj.tags)
        return ReleaseMemoryOccupationReqOutput()

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request=None):
        self._scheduler.resume(obj.tags)
        return ResumeMemoryOccupationReqOutput()
