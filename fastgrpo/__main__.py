"""`python -m fastgrpo ...` (what `torchrun -m fastgrpo` runs): the same command line as `fastgrpo`."""

import sys

from fastgrpo.cli import main

sys.exit(main())
