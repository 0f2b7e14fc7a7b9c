"""The compiled parts of fastgrpo (the metadata is pyproject.toml's), both host work of a hybrid speculative
step: the draft index's suffix trie and the merge of its candidates with the learned draft's tree, in C.

Optional: where no C compiler is found the install goes on and fastgrpo runs the same algorithms in Python
and torch (fastgrpo/speculation/suffix_index.py, fastgrpo/engines/embedded/tree.py), slower on the host but
with identical trees."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("fastgrpo.speculation._suffix_trie", ["fastgrpo/speculation/_suffix_trie.c"],
                             optional=True),
                   Extension("fastgrpo.engines.embedded._tree_merge", ["fastgrpo/engines/embedded/_tree_merge.c"],
                             optional=True)])
