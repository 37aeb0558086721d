"""Megatron-LM training scripts: the plugin's import line, the shipped per-release patches of
``pretrain_gpt.py`` and the command that applies them (``vocabstats-patch-megatron``).

:mod:`.inserter` (the line and where it goes), :mod:`.releases` (the patches, which release each
fits, applying one; the maintainers' check against a clone), :mod:`.cli` (the command). Nothing
here imports torch or Megatron.
"""
