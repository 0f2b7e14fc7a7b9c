"""`python -m fastgrpo.conversion SUBCOMMAND ...`: the same command as tools/convert_checkpoint.py."""

from fastgrpo.conversion.cli import main
from fastgrpo.process_exit import end_process

end_process(main())  # no abort at exit from a group something still holds
