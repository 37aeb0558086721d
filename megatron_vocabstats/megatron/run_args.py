"""Megatron's own arguments that the config hook reads (each number through
:func:`megatron_int`), and what it sets from them: the precision-aware optimizer, the FP8 alignment.
"""

from __future__ import annotations

import math

from ..ops._argtypes import check_number
from . import compat

FP8_RECIPE_MULTIPLE = {"tensorwise": 16, "delayed": 16, "mxfp8": 32, "blockwise": 128}
VOCAB_SHARD_MULTIPLE = 128


def megatron_int(args, name: str, default: int = 1) -> int:
    """``args.<name>`` (``default`` if absent), an int >= 1, else ``ValueError`` (``InputTypeError``
    for a wrong type) naming the flag, so that a value set without the parser is refused."""
    value = getattr(args, name, default)
    return check_number(f"--{name.replace('_', '-')}", value, integer=True, low=1)


def precision_aware_optimizer(args) -> None:
    """``--precision-aware-optimizer-bf16``: check every prerequisite (``ValueError`` listing all
    that are missing), then set it up with bf16 main grads and Adam moments."""
    missing = []
    if getattr(args, "optimizer", "adam") != "adam":
        missing.append(f"--optimizer adam (got {args.optimizer!r})")
    if not getattr(args, "use_distributed_optimizer", False):
        missing.append("--use-distributed-optimizer")
    if not getattr(args, "bf16", False):
        missing.append("--bf16")
    if getattr(args, "accumulate_allreduce_grads_in_fp32", False):
        missing.append("no --accumulate-allreduce-grads-in-fp32 (bf16 main grads)")
    if not compat.transformer_engine_fused_adam_available():
        missing.append("transformer-engine with FusedAdam importable (GPU extra)")
    if missing:
        raise ValueError("--precision-aware-optimizer-bf16 needs: " + "; ".join(missing))
    args.use_precision_aware_optimizer = True
    args.main_grads_dtype = "bf16"
    args.exp_avg_dtype = "bf16"
    args.exp_avg_sq_dtype = "bf16"


def fp8_token_alignment(args) -> int:
    """Per-sequence token padding multiple under FP8 (``packing.sequence_alignment`` of the
    recipe's multiple); ``ValueError`` naming the flag for an unknown recipe or a bad size."""
    from ..packing import sequence_alignment

    recipe = getattr(args, "fp8_recipe", None) or "delayed"
    if not isinstance(recipe, str) or recipe not in FP8_RECIPE_MULTIPLE:
        raise ValueError(f"--fp8-recipe {recipe!r}: unknown to megatron-vocabstats "
                         f"(known: {sorted(FP8_RECIPE_MULTIPLE)})")
    return sequence_alignment(
        cp_size=megatron_int(args, "context_parallel_size"),
        tp_size=megatron_int(args, "tensor_model_parallel_size"),
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        fp8_multiple=FP8_RECIPE_MULTIPLE[recipe])


def fp8_alignment(args) -> int:
    """FP8 on: needs bf16; makes the vocabulary divisible by 128; :func:`fp8_token_alignment`."""
    if not getattr(args, "bf16", False):
        raise ValueError("--fp8-format needs --bf16 (the LM head and the statistics stay bf16); "
                         "add --bf16 or drop --fp8-format")
    divisible = megatron_int(args, "make_vocab_size_divisible_by", VOCAB_SHARD_MULTIPLE)
    args.make_vocab_size_divisible_by = math.lcm(divisible, VOCAB_SHARD_MULTIPLE)
    return fp8_token_alignment(args)
