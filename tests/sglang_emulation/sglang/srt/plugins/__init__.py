"""sglang/srt/plugins/__init__.py: general plugins are the `sglang.srt.plugins` entry points of the
installed distributions, each called once per process. As SGLang 0.5.23 does it (paths relative to
the wheel's sglang/srt/):
- SGLANG_PLUGINS, when set to anything but the empty string, is an allow-list of entry-point names,
  split at commas and stripped (plugins/__init__.py:51-55, 67-70); the variable is an EnvStr, read
  as it is (environ.py:128-130, 2137), so a value of only commas or blanks is an empty allow-list:
  every plugin is skipped.
- a plugin whose entry point fails to load, or whose function raises, is logged (with its traceback)
  and skipped; the others still run and the process goes on (:79-84, 129-138).
(SGLANG_PLATFORM's exclusion of other platforms' distributions, :89-100, is not emulated: no
platform plugin is installed here.)"""

import logging
import os
from importlib.metadata import entry_points

GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"

_plugins_loaded = False
_log = logging.getLogger(__name__)


def _allow_list() -> set[str] | None:
    raw = os.environ.get("SGLANG_PLUGINS", "")
    return None if raw == "" else {name.strip() for name in raw.split(",")} - {""}


def load_plugins():
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    allowed = _allow_list()
    for ep in entry_points(group=GENERAL_PLUGINS_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            register = ep.load()
        except Exception:
            _log.exception("general plugin %s could not be loaded (skipped)", ep.name)
            continue
        try:
            register()
        except Exception:
            _log.exception("general plugin %s raised (skipped)", ep.name)
