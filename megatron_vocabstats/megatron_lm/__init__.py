"""Megatron-LM training scripts: the plugin's import line, the shipped per-release patches of
``pretrain_gpt.py`` and the command that applies them, ``vocabstats-patch-megatron``
(docs/megatron.md). Standard library only: no torch, no Megatron.
"""
