"""Megatron-LM's ``pretrain_gpt.py``: the plugin's import line, the shipped per-release patches
and ``vocabstats-patch-megatron`` (docs/megatron.md). Standard library only.
"""
