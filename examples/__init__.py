"""Examples of megatron-vocabstats (``python -m examples.gsm8k``); not part of the package."""
