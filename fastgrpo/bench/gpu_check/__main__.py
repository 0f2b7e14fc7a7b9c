"""`python -m fastgrpo.bench.gpu_check ...` (tools/gpu_check.sh runs it so)."""

import sys

from fastgrpo.bench.gpu_check.driver import main

sys.exit(main())
