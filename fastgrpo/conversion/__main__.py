"""`python -m fastgrpo.conversion SUBCOMMAND ...`: the same command as tools/convert_checkpoint.py."""

import sys

from fastgrpo.conversion.cli import main

sys.exit(main())
