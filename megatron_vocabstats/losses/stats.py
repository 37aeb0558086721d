"""Per-token statistics of a model output (:func:`token_stats`, :class:`StatsOptions`) and the
losses composed with them."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from ..ops import VocabStats, vocab_parallel_stats
from ..ops.agreement import Field, checked_on_every_rank, tensor_checksum
from ..ops.options import IGNORE_INDEX, check_bool, check_number, check_option
from .inputs import _EVERY_RANK_HINT, LossOutput, _token_mask
from .token import nll_loss, score_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsOptions:
    """The keywords of :func:`~megatron_vocabstats.vocab_parallel_stats` that the losses pass on.

    Checked on construction by the op's checks (``TypeError`` / ``ValueError`` naming the field);
    ``validate`` defaults to False here (it reads the host once per call). More:
    ``docs/ops.md``, "Losses for forward_step".
    """

    vocab_size: int | None = None
    chunk_size: int | None = None
    temperature: float = 1.0
    entropy: str = "off"
    label_smoothing: float = 0.0
    validate: bool = False
    batch_invariant: bool | str = False
    kernel: str = "auto"

    def __post_init__(self):
        # (vocab_size's range depends on the shards: the op checks it)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "vocab_size":
                value = check_number(f.name, value, integer=True, low=1, high=2**63 - 1,
                                     none_ok=True)
            object.__setattr__(self, f.name, check_option(f.name, value))

    def op_kwargs(self, **extra) -> dict[str, Any]:
        """These fields as the ops' keywords, plus ``extra`` (``tp_group``, ``ignore_index``, ...):
        ``vocab_parallel_stats(logits, target, **options.op_kwargs(tp_group=g))``. Raises
        ``TypeError`` if ``extra`` names a field."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        clash = sorted(extra.keys() & {f.name for f in fields(self)})
        if clash:
            raise TypeError(f"op_kwargs: {clash} are fields of StatsOptions, not extra keywords")
        return {**extra, **kwargs}


StatsFn = Callable[..., VocabStats]


def selected_tokens(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool mask of the tokens that count: ``(loss_mask != 0) & (labels != -100)``. Raises
    ``ValueError`` for non-integer ``labels`` or a missing or misshapen ``loss_mask``."""
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be an int64 tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids (int64), got {labels.dtype}")
    return _token_mask(loss_mask, labels, like_name="labels") & (labels != IGNORE_INDEX)


def token_stats(
    output: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    selected: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    options: StatsOptions | None = None,
) -> VocabStats:
    """Per-token statistics of ``labels`` from a model output, whatever its form.

    ``output``: this rank's logits shard ``[..., V/tp]`` (through
    :func:`~megatron_vocabstats.vocab_parallel_stats`); a ``VocabStats`` already computed (a fused
    LM head; only shape-checked); or ``fn(target, **kwargs) -> VocabStats`` taking the op's
    keywords (e.g. a partial of ``linear_vocab_parallel_stats``; over ``[s, b, H]`` hidden states,
    transpose the target to ``[s, b]`` and the results back). ``labels``: int64 ids, the leading
    shape of the logits. ``selected``: bool, shaped like ``labels`` (:func:`selected_tokens`); the
    other tokens go to the op as ``ignore_index=-100`` (logprob, entropy and gradient exactly 0).
    ``tp_group``: the vocabulary's tensor-parallel group, None = none.

    Returns ``VocabStats``: ``logprobs`` fp32 shaped like ``labels``; ``entropy`` None when
    ``options.entropy == "off"``. Raises ``ValueError``: an ``output`` of another type, statistics
    not shaped like ``labels``, a missing ``entropy`` that ``options`` asks for, and what
    ``vocab_parallel_stats`` raises.
    """
    options = options or StatsOptions()
    if isinstance(output, VocabStats):
        stats = output
    elif isinstance(output, torch.Tensor) or callable(output):
        target = torch.where(selected, labels, IGNORE_INDEX)
        kwargs = options.op_kwargs(tp_group=tp_group, ignore_index=IGNORE_INDEX)
        if isinstance(output, torch.Tensor):
            stats = vocab_parallel_stats(output, target, **kwargs)
        else:
            stats = output(target, **kwargs)
        if not isinstance(stats, VocabStats):
            raise ValueError(f"output: the statistics callable returned "
                             f"{type(stats).__name__}, not VocabStats")
    else:
        raise ValueError(f"output must be logits, VocabStats or a callable returning VocabStats, "
                         f"got {type(output).__name__}")
    if stats.logprobs is None or stats.logprobs.shape != labels.shape:
        got = None if stats.logprobs is None else tuple(stats.logprobs.shape)
        raise ValueError(f"output: statistics need logprobs shaped like labels "
                         f"{tuple(labels.shape)}, got {got}")
    if options.entropy != "off" and stats.entropy is None:
        raise ValueError(f"output: options.entropy={options.entropy!r} but the statistics "
                         "carry no entropy")
    return stats


PerTokenLoss = Callable[..., Any]


def token_loss(
    output: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_fn: PerTokenLoss,
    loss_inputs: Mapping[str, Any] | None = None,
    tp_group: dist.ProcessGroup | None = None,
    options: StatsOptions | None = None,
    non_loss_data: bool = False,
):
    """``loss_fn`` applied to the per-token statistics of a model output.

    Equals ``loss_fn(stats.logprobs, loss_mask=sel, entropy=stats.entropy, **loss_inputs)`` with
    ``sel = selected_tokens(labels, loss_mask)`` and ``stats = token_stats(output, labels, sel,
    tp_group=tp_group, options=options)``; a partial fixing all but ``output`` is a Megatron loss
    function. ``loss_fn``: :func:`nll_loss`, a partial of :func:`policy_loss`,
    :func:`score_tokens` or a callable with their signature; ``loss_inputs``: its further keywords
    (tensors shaped like ``labels``); ``non_loss_data`` is passed on only when True.

    Raises ``ValueError``: ``loss_inputs`` naming ``loss_mask``, ``entropy`` or ``non_loss_data``,
    ``non_loss_data`` not a bool (also a ``TypeError``), and what :func:`selected_tokens`,
    :func:`token_stats` and ``loss_fn`` raise. With ``options.validate`` under tensor parallelism
    these raise on every rank, as do ``loss_inputs`` that differ across ranks at counted tokens
    (two small all-gathers); without it, on the failing rank only.
    """
    non_loss_data = check_bool("non_loss_data", non_loss_data)
    loss_inputs = dict(loss_inputs or {})
    clash = sorted({"loss_mask", "entropy", "non_loss_data"} & loss_inputs.keys())
    if clash:
        raise ValueError(f"loss_inputs must not set {clash}: token_loss passes them")
    options = options or StatsOptions()

    device = labels.device if isinstance(labels, torch.Tensor) else None
    every_rank = dict(validate=options.validate, device=device, hint=_EVERY_RANK_HINT)
    # Before the op's collectives, and again around loss_fn (its own checks and the per-token
    # inputs, which must agree across the ranks): with validate no rank raises alone.
    selected = checked_on_every_rank(lambda: selected_tokens(labels, loss_mask), tp_group,
                                     **every_rank)
    stats = token_stats(output, labels, selected, tp_group=tp_group, options=options)
    if non_loss_data:
        loss_inputs["non_loss_data"] = True
    return checked_on_every_rank(
        lambda: loss_fn(stats.logprobs, loss_mask=selected, entropy=stats.entropy, **loss_inputs),
        tp_group, agree=((Field("loss_inputs", checksum=True),
                          lambda _: _inputs_checksum(loss_inputs, selected)),), **every_rank)


def _inputs_checksum(inputs: Mapping[str, Any], selected: torch.Tensor) -> int:
    """Checksum of the names and values (at selected tokens) of ``inputs``' tensors (host read)."""
    total = 0
    for name in sorted(inputs):
        if isinstance(inputs[name], torch.Tensor):
            part = zlib.crc32(name.encode()) + tensor_checksum(inputs[name], selected)
            total = (total * 1_000_003 + part) % (2**61 - 1)
    return total


def sft_loss(
    logits: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> LossOutput:
    """Masked token cross-entropy from vocab-parallel logits, in Megatron's loss contract.

    Reference (one process, full vocabulary, ``m = (loss_mask != 0) & (labels != -100)``)::

        nll = F.cross_entropy(logits.float().flatten(0, -2) / temperature, labels.flatten(),
                              reduction="none", label_smoothing=label_smoothing)
        loss_sum = (nll * m.flatten()).sum();  num_tokens = m.sum()

    computed without gathering the vocabulary (label smoothing over the ``vocab_size`` real
    columns): :func:`token_loss` with :func:`nll_loss`. ``logits``: an ``output`` of
    :func:`token_stats`; ``**options``: fields of :class:`StatsOptions` (an ``entropy`` other than
    ``"off"`` is reported as ``"entropy"``). Raises ``ValueError`` as :func:`token_stats` and
    :func:`nll_loss`, ``TypeError`` for a keyword that is not a field of :class:`StatsOptions`.
    """
    return token_loss(logits, labels, loss_mask, loss_fn=nll_loss, tp_group=tp_group,
                      options=StatsOptions(**options))


def logprobs_step(
    logits: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    entropy: bool = True,
    non_loss_data: bool = False,
    **options: Any,
):
    """Forward-only per-token log-probs (and entropy) of ``labels``, for scoring rollouts.

    :func:`token_loss` with :func:`score_tokens` and ``StatsOptions(entropy="metric")`` (``"off"``
    with ``entropy=False``); returns what :func:`score_tokens` returns. Call it under
    ``torch.no_grad()``. Arguments as :func:`sft_loss` (``temperature``: the sampling one); with
    ``non_loss_data``, only the dict. Raises ``ValueError`` as :func:`token_stats` and
    :func:`score_tokens`, and for ``entropy`` or ``non_loss_data`` not a bool (also a
    ``TypeError``).
    """
    entropy = check_bool("entropy", entropy)
    return token_loss(logits, labels, loss_mask, loss_fn=score_tokens, tp_group=tp_group,
                      options=StatsOptions(entropy="metric" if entropy else "off", **options),
                      non_loss_data=non_loss_data)
