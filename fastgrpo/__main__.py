"""`python -m fastgrpo ...` (what `torchrun -m fastgrpo` runs): the same command line as `fastgrpo`."""

from fastgrpo.cli import run

run()
