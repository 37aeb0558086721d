"""The ``--vocab-parallel-stats`` flags and the config hook run before ``validate_args``, which
decides from them; where no Megatron parser runs, the import alone keeps it on (docs/megatron.md).
"""

from __future__ import annotations

import argparse
import functools
import logging
import warnings

from ..ops.kernels import resolve_kernel
from ..ops.options import BATCH_INVARIANT_NAMES, ENTROPY_MODES, KERNEL_CHOICES
from ..rollout import ROLLOUT_LEVELS, RolloutCorrection
from . import compat, settings
from .flag_types import FLAG_TYPES, OPTIONAL_FLAGS, ROLLOUT_FLAGS
from .run_args import VOCAB_SHARD_MULTIPLE, fp8_alignment, megatron_int, precision_aware_optimizer

logger = logging.getLogger("megatron_vocabstats")

GROUP_TITLE = "megatron-vocabstats"
# --vocab-stats-batch-invariant value -> the ops' batch_invariant argument: the ops' own table.
BATCH_INVARIANT_FLAG = BATCH_INVARIANT_NAMES


def check_flag_values(args) -> None:
    """Raise ``ValueError`` naming the flag for a value, set without the parser, it would refuse."""
    choices = {"vocab_stats_entropy": ENTROPY_MODES,
               "vocab_stats_batch_invariant": tuple(BATCH_INVARIANT_FLAG),
               "vocab_stats_kernel": KERNEL_CHOICES,
               "rollout_correction": settings.ROLLOUT_CORRECTION_MODES,
               "rollout_correction_level": ROLLOUT_LEVELS}
    for name in (*FLAG_TYPES, *choices):
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if value is None and name in OPTIONAL_FLAGS:
            continue
        if name in FLAG_TYPES:
            problem = FLAG_TYPES[name].problem(value)
        else:
            problem = None if value in choices[name] else \
                f"must be one of {choices[name]}, got {value!r}"
        if problem:
            raise ValueError(f"--{name.replace('_', '-')} {problem}")


def add_vocab_stats_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags to ``parser`` (once; a second call is a no-op) and return it."""
    if "--vocab-parallel-stats" in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(GROUP_TITLE)
    group.add_argument("--vocab-parallel-stats", action="store_true",
                       help="Compute the LM loss with megatron-vocabstats' exact, chunked "
                       "vocab-parallel op (needs `import megatron_vocabstats.patch`).")
    group.add_argument("--logprobs-chunk-size", type=FLAG_TYPES["logprobs_chunk_size"], default=0,
                       help="Tokens per fp32 chunk of the unfused op; 0 = auto.")
    group.add_argument("--lm-head-chunk-size", type=FLAG_TYPES["lm_head_chunk_size"], default=0,
                       help="Tokens per chunk of the fused LM head (logits never "
                       "materialised); 0 = unfused.")
    group.add_argument("--require-fused-lm-head", action="store_true",
                       help="With --lm-head-chunk-size > 0: stop with an error where the fused "
                       "head cannot reproduce a model's output layer (a bias, "
                       "disable_grad_reduce, deferred embedding wgrad), instead of logging why "
                       "once and running Megatron's output layer there."),
    group.add_argument("--vocab-stats-entropy", choices=ENTROPY_MODES, default="off",
                       help="Entropy: off, metric (reported, no grad) or grad (differentiable).")
    group.add_argument("--entropy-coef", type=FLAG_TYPES["entropy_coef"], default=0.0,
                       help="Entropy bonus: per-token loss -logprob - coef * entropy "
                       "(needs --vocab-stats-entropy grad).")
    group.add_argument("--vocab-stats-label-smoothing",
                       type=FLAG_TYPES["vocab_stats_label_smoothing"], default=0.0,
                       help="Label smoothing over the real vocabulary (numerics.md).")
    group.add_argument("--vocab-stats-batch-invariant", nargs="?", const="batch",
                       choices=tuple(BATCH_INVARIANT_FLAG), default="off",
                       help="Batch-invariant statistics: a token's logprob and entropy do not "
                       "depend on the rest of the batch, bit for bit; 'tp' also makes every "
                       "tensor-parallel size agree on the statistics of the same logits (more "
                       "communication; needs --make-vocab-size-divisible-by a multiple of 128 "
                       "under tp > 1; the fused head's logits GEMMs still depend on tp). Bare "
                       "flag = batch.")
    group.add_argument("--vocab-stats-kernel", choices=KERNEL_CHOICES, default="auto",
                       help="Backend of the loss statistics, unfused and in the fused LM head "
                       "(--lm-head-chunk-size): auto (torch until the Triton kernels have passed "
                       "the GPU suite, see docs/kernels.md; VOCABSTATS_KERNEL overrides), torch or "
                       "triton (CUDA).")
    group.add_argument("--vocab-stats-skip-checks", action="store_true",
                       help="Skip the op's host-side input checks (target range, cross-rank "
                       "agreement, finite results): no host sync in the loss.")
    group.add_argument("--precision-aware-optimizer-bf16", action="store_true",
                       help="Turn on Megatron's precision-aware optimizer with bf16 main grads "
                       "and bf16 Adam moments, after checking its prerequisites.")
    # Read by the user's forward step (settings.current().sampler_options() /
    # .rollout_correction()), with or without the switch.
    group.add_argument("--rollout-temperature", type=FLAG_TYPES["rollout_temperature"],
                       default=1.0, help="Temperature of the rollout engine's sampler (> 0), "
                       "replayed by vocab_parallel_sampling_logprobs.")
    group.add_argument("--rollout-top-k", type=FLAG_TYPES["rollout_top_k"], default=None,
                       help="Top-k of the rollout sampler (>= 1); -1 or unset = off.")
    group.add_argument("--rollout-top-p", type=FLAG_TYPES["rollout_top_p"], default=1.0,
                       help="Top-p of the rollout sampler, in (0, 1]; 1 = off.")
    group.add_argument("--rollout-min-p", type=FLAG_TYPES["rollout_min_p"], default=0.0,
                       help="Min-p of the rollout sampler, in [0, 1); 0 = off.")
    group.add_argument("--rollout-correction", choices=settings.ROLLOUT_CORRECTION_MODES,
                       default="none", help="Importance-weight correction of the trainer / "
                       "rollout-engine mismatch in policy_loss: truncated IS (tis), masked IS "
                       "(mis) or IcePop (icepop); none = off.")
    group.add_argument("--rollout-correction-level", choices=("token", "sequence"),
                       default="token", help="One weight per token or per sequence (icepop: "
                       "token only).")
    group.add_argument("--rollout-correction-threshold",
                       type=FLAG_TYPES["rollout_correction_threshold"], default=None,
                       help="tis: the weight cap C > 0 (default 2).")
    group.add_argument("--rollout-correction-low", type=FLAG_TYPES["rollout_correction_low"],
                       default=None, help="mis / icepop: lower end of the kept ratio band, in "
                       "(0, 1] (default: mis 1 / high, icepop 0.5).")
    group.add_argument("--rollout-correction-high", type=FLAG_TYPES["rollout_correction_high"],
                       default=None, help="mis / icepop: upper end of the kept ratio band, >= 1 "
                       "(default: mis 2, icepop 5).")
    return parser


def _rollout_settings(args) -> dict:
    """The settings of the rollout flags (absent: the current ones), combinations checked."""
    current = settings.current()
    fields = {field: getattr(args, flag) if hasattr(args, flag) else getattr(current, field)
              for flag, field in ROLLOUT_FLAGS.items()}
    if fields["rollout_top_k"] == -1 and not isinstance(fields["rollout_top_k"], bool):
        fields["rollout_top_k"] = None  # -1 = off, as the flag's type reads it (a YAML config)
    mode = fields["rollout_correction_mode"]
    given = [name for name in ("threshold", "low", "high")
             if fields[f"rollout_correction_{name}"] is not None]
    wants = {"none": (), "tis": ("threshold",), "mis": ("low", "high"),
             "icepop": ("low", "high")}[mode]
    for name in given:
        if name not in wants:
            needs = "tis" if name == "threshold" else "mis or icepop"
            raise ValueError(f"--rollout-correction-{name} applies to --rollout-correction "
                             f"{needs} (got --rollout-correction {mode})")
    if mode == "icepop" and fields["rollout_correction_level"] != "token":
        raise ValueError("--rollout-correction icepop is token level only (got "
                         "--rollout-correction-level sequence); use --rollout-correction mis "
                         "--rollout-correction-level sequence to drop whole sequences")
    if mode != "none":
        try:
            RolloutCorrection(mode=mode, level=fields["rollout_correction_level"],
                              **{name: fields[f"rollout_correction_{name}"] for name in wants})
        except ValueError as exc:  # what is left: a band without 1 inside, low >= high
            bounds = " ".join(f"--rollout-correction-{name} {fields[f'rollout_correction_{name}']}"
                              for name in wants)
            raise ValueError(f"--rollout-correction {mode} with {bounds}: {exc}") from None
    settings.PluginSettings(active=False, **fields)  # the sampler's fields (named as fields)
    return fields


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """An ``extra_args_provider`` for ``pretrain(...)`` / ``parse_args(...)`` adding our flags."""
    return add_vocab_stats_args(parser)


def chain_providers(*providers):
    """One ``extra_args_provider`` calling each of ``providers`` (None entries skipped) in turn."""

    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return provider


def _batch_invariant(args):
    """The ops' ``batch_invariant`` for the flag; ``tp`` without 128-column shards refused now."""
    mode = BATCH_INVARIANT_FLAG[args.vocab_stats_batch_invariant]
    if mode != "tp":
        return mode
    tp = megatron_int(args, "tensor_model_parallel_size")
    divisible = megatron_int(args, "make_vocab_size_divisible_by", VOCAB_SHARD_MULTIPLE)
    if tp > 1 and divisible % VOCAB_SHARD_MULTIPLE:
        raise ValueError(
            f"--vocab-stats-batch-invariant tp with --tensor-model-parallel-size {tp} needs "
            f"vocabulary shards of whole {VOCAB_SHARD_MULTIPLE}-column blocks: set "
            f"--make-vocab-size-divisible-by to a multiple of {VOCAB_SHARD_MULTIPLE} (got "
            f"{divisible}), or use --vocab-stats-batch-invariant batch")
    if args.lm_head_chunk_size:
        warnings.warn("--vocab-stats-batch-invariant tp with --lm-head-chunk-size > 0: the fused "
                      "LM head's logits are GEMMs whose width depends on tp, so its results are "
                      "batch-invariant but not tp-invariant (the unfused loss path is)",
                      stacklevel=3)
    return mode


def _check_kernel(kernel) -> None:
    """Refuse an unusable ``triton`` now, naming the flag, not at the first loss."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolve_kernel(kernel, device)
    except ValueError as exc:
        raise ValueError(f"--vocab-stats-kernel {kernel}: {exc}") from None


def config_hook(args) -> settings.PluginSettings:
    """Set the plugin up from Megatron's parsed ``args``; must run before ``validate_args``.
    Without ``--vocab-parallel-stats`` the plugin is off (our other flags draw a warning) and
    only the ``--rollout-*`` flags are stored; with it, it also applies
    ``--precision-aware-optimizer-bf16`` and the FP8 alignment (stored as
    ``args.vocab_stats_token_alignment``). Raises ``ValueError`` naming the flags for a value or
    combination it refuses (docs/megatron.md), or a ``triton`` kernel that cannot run here."""
    check_flag_values(args)
    rollout = _rollout_settings(args)
    if not getattr(args, "vocab_parallel_stats", False):
        defaults = vars(add_vocab_stats_args(argparse.ArgumentParser()).parse_args([]))
        given = [k for k, v in defaults.items()
                 if k not in ROLLOUT_FLAGS and getattr(args, k, v) != v]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            warnings.warn(f"{flags} ignored: megatron-vocabstats is off without "
                          "--vocab-parallel-stats", stacklevel=2)
        return settings.update(active=False, **rollout)

    if getattr(args, "cross_entropy_loss_fusion", False):
        impl = getattr(args, "cross_entropy_fusion_impl", "native")
        raise ValueError(
            f"--vocab-parallel-stats replaces Megatron's loss, but --cross-entropy-loss-fusion "
            f"(--cross-entropy-fusion-impl {impl}) asks for Megatron's fused one: drop one of them")
    if getattr(args, "require_fused_lm_head", False) and not args.lm_head_chunk_size:
        raise ValueError("--require-fused-lm-head needs the fused LM head: set "
                         "--lm-head-chunk-size > 0")
    if args.entropy_coef and args.vocab_stats_entropy != "grad":
        raise ValueError(f"--entropy-coef {args.entropy_coef} needs --vocab-stats-entropy grad "
                         f"(got {args.vocab_stats_entropy})")
    if args.precision_aware_optimizer_bf16:
        precision_aware_optimizer(args)
    alignment = fp8_alignment(args) if getattr(args, "fp8", None) else 1
    args.vocab_stats_token_alignment = alignment
    batch_invariant = _batch_invariant(args)
    kernel = getattr(args, "vocab_stats_kernel", "auto")
    _check_kernel(kernel)
    return settings.update(
        active=True, logprobs_chunk_size=args.logprobs_chunk_size or None,
        lm_head_chunk_size=args.lm_head_chunk_size,
        require_fused_lm_head=getattr(args, "require_fused_lm_head", False),
        entropy=args.vocab_stats_entropy, entropy_coef=args.entropy_coef,
        label_smoothing=args.vocab_stats_label_smoothing,
        validate=not args.vocab_stats_skip_checks, token_alignment=alignment,
        batch_invariant=batch_invariant, kernel=kernel, **rollout)


def _before_validate(original):
    @functools.wraps(original)
    def validate(args, *rest, **kwargs):
        config_hook(args)
        return original(args, *rest, **kwargs)

    return validate


def _with_our_flags(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser, *rest, **kwargs):
        return add_vocab_stats_args(original(parser, *rest, **kwargs))

    return add_megatron_arguments


def install(patcher) -> list[str]:
    """Add our flags to ``add_megatron_arguments`` and run :func:`config_hook` before
    ``validate_args`` (and 0.14-0.17 ``initialize``'s copy) and ``validate_yaml``; returns what
    was wrapped."""
    targets = [("arguments", "add_megatron_arguments", _with_our_flags),
               ("arguments", "validate_args", _before_validate),
               ("initialize", "validate_args", _before_validate),
               ("yaml_arguments", "validate_yaml", _before_validate)]
    wrapped = []
    for module_name, attr, factory in targets:
        module = compat.training_module(module_name)
        if module is not None and hasattr(module, attr) and patcher.replace(module, attr, factory):
            wrapped.append(f"megatron.training.{module_name}.{attr}")
    return wrapped
