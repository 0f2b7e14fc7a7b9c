"""`python -m fastgrpo.bench.gpu_check ...` (tools/gpu_check.sh runs it so)."""

from fastgrpo.bench.gpu_check.driver import main
from fastgrpo.process_exit import end_process

end_process(main())  # no abort at exit from a group something still holds
