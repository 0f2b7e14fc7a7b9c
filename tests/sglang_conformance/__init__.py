"""SGLang's own source as the reference the SGLang adapter and its emulation are checked against.

`source()` fetches the sglang wheel fastgrpo pins (`pip download --no-deps`, cached outside the
checkout under ~/.cache/fastgrpo, its sha256 checked) and unpacks its Python files. Nothing of it
is imported: CUDA builds, kernels and torch 2.14 stay out of this process. `Source` reads modules
with `ast` and answers what the adapter needs to know: does this module define that name (through
its imports, star imports and lazy re-exports), what are a function's parameters, a class's
methods (through its bases), dataclass / msgspec fields and instance attributes, which ServerArgs
fields exist, which keys SGLang writes into a generate output.

Three checks use it (tests/test_sglang_conformance.py runs them):
- `check_adapter(source, code)`: every SGLang import of the adapter, every attribute it reads and
  call it makes on an SGLang module, class or object (arguments bound against the real signature,
  constructor keywords against the real fields, coroutines and async generators consumed as such),
  and every string key it reads from a dict.
- `check_emulation(source, root)`: the emulated `sglang` package the tests run the adapter against
  (tests/sglang_emulation) declares only what SGLang has: the same modules and names, signatures
  whose parameters, kinds, defaults and async-ness match, fields with the same defaults, constants
  with the same values.
- `check_keys(source, kind, keys)`: ServerArgs fields, SamplingParams fields, generate output keys.

The modules: `wheel` (fetching and unpacking the pinned wheel, `source()`), `reading` (`Source`,
`ClassInfo`, signatures), `adapter` (`check_adapter`, `check_keys`), `emulation`
(`check_emulation`) and `loading` (`sglang_function`: one of SGLang's functions compiled from the
source; `load_weights_calls`).
"""

from tests.sglang_conformance.adapter import ATTRIBUTE_TYPES, AdapterScan, check_adapter, check_keys
from tests.sglang_conformance.emulation import EMULATION, check_emulation, compare_signature, emulated_modules
from tests.sglang_conformance.loading import LoaderCall, load_weights_calls, sglang_function
from tests.sglang_conformance.reading import (NOT_LITERAL, ClassInfo, Module, Param, Source, Symbol, bind_problems,
                                              call_kind, literal, parameters)
from tests.sglang_conformance.wheel import (WHEEL, WHEEL_SHA256, SourceUnavailable, cache_dir, fetch_wheel,
                                            metadata_requirements, source, source_root, wheel_text)

__all__ = ["ATTRIBUTE_TYPES", "AdapterScan", "ClassInfo", "EMULATION", "LoaderCall", "Module", "NOT_LITERAL", "Param",
           "Source", "SourceUnavailable", "Symbol", "WHEEL", "WHEEL_SHA256", "bind_problems", "cache_dir", "call_kind",
           "check_adapter", "check_emulation", "check_keys", "compare_signature", "emulated_modules", "fetch_wheel",
           "literal", "load_weights_calls", "metadata_requirements", "parameters", "sglang_function", "source",
           "source_root", "wheel_text"]
