"""Packed per-token values back to a padded ``[N, S_max]`` batch: :func:`unpack_sequences`."""

from __future__ import annotations

import torch

from ..ops.agreement import host_checks_enabled
from ..ops.options import check_bool
from .checks import _count, _cu_pair, _fill_value, _seq_dim


def unpack_sequences(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int,
    cu_seqlens_padded: torch.Tensor | None = None,
    dim: int = -1,
    padding_value: float | int = 0,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed per-token values to a padded ``[N, S_max]`` batch plus its mask.

    Reference semantics (``s_i = cu_seqlens_padded[i]``, ``L_i`` the real lengths)::

        out[i, :L_i] = values[s_i:s_i + L_i];  out[i, L_i:] = padding_value
        mask = arange(S_max) < L[:, None]

    Differentiable w.r.t. ``values`` (gradient 0 at padding and past ``max_seqlen``). ``values``:
    any dtype, T packed tokens along ``dim``, which becomes the dimensions ``(N, S_max)`` of
    ``out`` (same dtype); ``mask`` is bool. ``cu_seqlens``, ``cu_seqlens_padded``: as in
    :func:`shift_packed_labels`; ``max_seqlen``: S_max, an int (a static shape).

    Raises ``ValueError`` for bad shapes or dtypes, ``dim`` out of range, a negative or non-int
    ``max_seqlen``, a ``padding_value`` the values' dtype does not hold, and with ``validate`` bad
    cumulative lengths (:mod:`~megatron_vocabstats.packing`) or a sequence over ``max_seqlen``.
    """
    validate = check_bool("validate", validate)
    dim = _seq_dim(values, dim, "values")
    padding_value = _fill_value("padding_value", padding_value, values.dtype)
    max_seqlen = _count(max_seqlen, "max_seqlen", low=0)
    total = values.shape[dim]
    cu, cu_p = _cu_pair(cu_seqlens, cu_seqlens_padded, total, values.device, validate=validate)
    lengths = cu[1:] - cu[:-1]
    if host_checks_enabled(validate, values.device) and bool((lengths > max_seqlen).any()):
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence "
                         f"({int(lengths.max())} tokens)")
    num = lengths.numel()
    pos = torch.arange(max_seqlen, device=values.device)
    mask = pos < lengths.unsqueeze(1)
    src = (cu_p[:-1].unsqueeze(1) + pos).clamp_(max=max(total - 1, 0)).reshape(-1)
    if total == 0:
        shape = values.shape[:dim] + (num * max_seqlen,) + values.shape[dim + 1:]
        picked = values.new_zeros(shape)
    else:
        picked = values.index_select(dim, src)
    out = picked.unflatten(dim, (num, max_seqlen))
    keep = mask.view((1,) * dim + mask.shape + (1,) * (values.dim() - dim - 1))
    return torch.where(keep, out, out.new_full((), padding_value)), mask
