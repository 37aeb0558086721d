"""GSM8K with a Megatron-Core GPT and megatron-vocabstats: SFT, a GRPO-style policy step, scoring.

Run from the repository root, e.g. ``torchrun --standalone --nproc-per-node 2 -m examples.gsm8k
sft --vocab-parallel-stats --lm-head-chunk-size 128`` (see ``examples/README.md``). Modules:
``data`` (JSONL, Tekken tokenisation, packing), ``model`` (process groups, GPTModel, optimizer,
checkpoints), ``steps`` (forward steps, evaluation, plugin-versus-native comparison), ``sft``,
``grpo``, ``score`` (the modes), ``report`` (tables, atomic JSON/PNG/JSONL), ``cli``.
"""
