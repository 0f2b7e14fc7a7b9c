"""sglang/srt/entrypoints/engine.py: the offline Engine, with the methods the emulation models.
Each takes the parameters SGLang's takes (a subset: one it lacks fails as an unknown keyword)."""

import asyncio
from typing import Dict, List, Optional, Union

from sglang.srt.managers.io_struct import (
    BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput,
    GenerateReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import MultiprocessingSerializer


class Engine:
    def __init__(self, **kwargs):
        if "log_level" not in kwargs:
            kwargs["log_level"] = "error"
        self.server_args = ServerArgs(**kwargs)
        self.tokenizer_manager = TokenizerManager(self.server_args, None)
        self.loop = asyncio.new_event_loop()

    def generate(
        self,
        prompt: Optional[Union[List[str], str]] = None,
        sampling_params: Optional[Union[List[Dict], Dict]] = None,
        input_ids: Optional[Union[List[List[int]], List[int]]] = None,
        *,
        return_logprob: Optional[Union[List[bool], bool]] = False,
        logprob_start_len: Optional[Union[List[int], int]] = None,
        return_hidden_states=False,
        stream: bool = False,
        rid: Optional[Union[List[str], str]] = None,
    ):
        obj = GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params,
                               return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                               return_hidden_states=return_hidden_states, stream=stream, rid=rid)
        return self.loop.run_until_complete(self.tokenizer_manager.generate_request(obj, None).__anext__())

    def flush_cache(self):
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def begin_weight_update(self, selector: str = "all"):
        obj = BeginWeightUpdateReqInput(selector=selector)
        return self.loop.run_until_complete(self.tokenizer_manager.begin_weight_update(obj, None))

    def end_weight_update(self):
        obj = EndWeightUpdateReqInput()
        return self.loop.run_until_complete(self.tokenizer_manager.end_weight_update(obj, None))

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None, flush_cache: bool = True):
        payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.server_args.tp_size)]
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=load_format,
                                              flush_cache=flush_cache)
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_tensor(obj, None))

    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        obj = ReleaseMemoryOccupationReqInput(tags=tags)
        return self.loop.run_until_complete(self.tokenizer_manager.release_memory_occupation(obj, None))

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        obj = ResumeMemoryOccupationReqInput(tags=tags)
        return self.loop.run_until_complete(self.tokenizer_manager.resume_memory_occupation(obj, None))

    def collective_rpc(self, method: str, **kwargs):
        # managers/io_struct.py RpcReqInput: flat scalar parameters; scheduler.py handle_rpc_request:
        # getattr(scheduler, method)(**parameters), a failure returned as success=False and asserted here
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in kwargs.values()):
            raise TypeError("RpcReqInput.parameters: flat scalars only")
        scheduler = self.tokenizer_manager._scheduler
        try:
            getattr(scheduler, method)(**kwargs)
        except Exception as e:
            raise AssertionError(str(e)) from None

    def shutdown(self):
        if not self.loop.is_closed():
            self.loop.close()
