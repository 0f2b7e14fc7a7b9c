"""The compiled part of fastgrpo (the metadata is pyproject.toml's): the suffix trie of the draft index in C.

Optional: where no C compiler is found the install goes on and fastgrpo uses the same trie in Python
(fastgrpo/speculation/suffix_index.py), slower on the host but with identical drafts."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("fastgrpo.speculation._suffix_trie", ["fastgrpo/speculation/_suffix_trie.c"],
                             optional=True)])
