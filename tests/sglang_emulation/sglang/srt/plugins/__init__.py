"""sglang/srt/plugins/__init__.py: general plugins are the `sglang.srt.plugins` entry points of the
installed distributions, each called once per process (SGLANG_PLUGINS, if set, names those allowed)."""

import os
from importlib.metadata import entry_points

GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"

_plugins_loaded = False


def load_plugins():
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    allowed = {x.strip() for x in os.environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()} or None
    for ep in entry_points(group=GENERAL_PLUGINS_GROUP):
        if allowed is None or ep.name in allowed:
            ep.load()()
