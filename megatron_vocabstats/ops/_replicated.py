"""The verdict on identical shards: every rank of ``tp_group`` holds the same logits.

``checked_config`` (``ops/_checks.py``) detects them (the ranks' first rows, or the fused head's
first weight rows, agree and are not constant). Equal shards are legitimate input (tests seed
every rank alike; a zero-initialised output layer gives them at step 0), so they are refused only
where the logits are known to hold the whole vocabulary (:func:`identical_shards`).
"""

from __future__ import annotations

import warnings

from ..mcore import megatron_padded_vocab_size


class IdenticalShardsWarning(UserWarning):
    """Every rank of ``tp_group`` held the same logits, computed as ``tp`` vocabulary shards."""


_warned = False


def identical_shards(width: int, tp: int, vocab_size: int | None) -> None:
    """Every rank of a ``tp``-rank group holds the same ``[..., width]`` logits: ``ValueError``
    naming ``tp_group`` if ``width >= vocab_size`` (given, else Megatron-LM's padded size: a true
    shard is narrower unless padding fills the other shards), else the call goes on as ``tp``
    shards with an :class:`IdenticalShardsWarning`, once per process."""
    known, name = vocab_size, "vocab_size"
    if known is None:
        known, name = megatron_padded_vocab_size(), "Megatron's args.padded_vocab_size"
    if known is not None and width >= known:
        raise ValueError(
            f"logits: every rank of the tp={tp} tp_group holds the same [..., {width}] logits, "
            f"as wide as the whole vocabulary ({name}={known}; the fused head: the same weight "
            "rows): the full logits (or weight) replicated on every rank. Pass those with "
            "tp_group=None, or each rank its own vocabulary shard [..., V/tp] (weight [V/tp, H]) "
            "with the tp_group it was split over")
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"every rank of the tp={tp} tp_group holds the same [..., {width}] logits (the fused "
            f"head: the same weight rows): computed as {tp} vocabulary shards of a {tp * width}-"
            f"column vocabulary. If these are the full logits replicated on every rank, pass "
            "tp_group=None (as shards they are off by log(tp)); pass vocab_size to have that "
            "refused. Warned once per process", IdenticalShardsWarning, stacklevel=2)
