"""The scenarios of ``gpu_model.py``: each runs a real op (ours or Liger's) on fake CUDA tensors
of the issue's shapes inside :func:`gpu_capture.capturing` and returns the capture. bf16, tp 1,
host checks off (``validate=False``: no host syncs, as under CUDA graph capture); the upstream
gradients are those of ``sum(logprobs)`` (and ``+ sum(entropy)`` where differentiated).
"""

from __future__ import annotations

import torch

import gpu_capture

BF16 = torch.bfloat16


def _hidden(args, grad=True):
    return (torch.empty(args.tokens, args.hidden, dtype=BF16, device="cuda", requires_grad=grad),
            torch.empty(args.vocab, args.hidden, dtype=BF16, device="cuda", requires_grad=grad),
            torch.zeros(args.tokens, dtype=torch.long, device="cuda"))


def fused(args, kernel="triton", entropy="off"):
    import megatron_vocabstats as m

    with gpu_capture.capturing() as cap:
        h, w, t = _hidden(args)
        out = m.linear_vocab_parallel_stats(h, w, t, kernel=kernel, entropy=entropy,
                                            validate=False)
        cap.phase = "backward"
        ones = torch.ones_like(out.logprobs)
        gpu_capture.backward(out.logprobs, ones, ones if entropy == "grad" else None, None)
    return cap


def forward_grad(args, kernel="triton"):
    import megatron_vocabstats as m

    with gpu_capture.capturing() as cap:
        h, w, t = _hidden(args)
        mask = torch.ones(args.tokens, device="cuda")
        out = m.linear_vocab_parallel_stats(h, w, t, entropy="off", grad_weights=mask,
                                            kernel=kernel, validate=False)
        cap.phase = "backward"
        gpu_capture.backward(out.logprobs, mask, None, None)
    return cap


def unfused(args, kernel="triton"):
    import megatron_vocabstats as m

    with gpu_capture.capturing() as cap:
        x = torch.empty(args.tokens, args.vocab, dtype=BF16, device="cuda", requires_grad=True)
        t = torch.zeros(args.tokens, dtype=torch.long, device="cuda")
        st = m.vocab_parallel_stats(x, t, kernel=kernel, entropy="grad", validate=False)
        cap.phase = "backward"
        ones = torch.ones_like(st.logprobs)
        gpu_capture.backward(st.logprobs, ones, ones, None)
    return cap


def liger(args, flce, accum_dtype=None):
    with gpu_capture.capturing(item_value=lambda t: args.tokens) as cap:
        h, w, t = _hidden(args)
        loss = flce.apply(h, w, t, None, None, -100, 0.0, 0.0, "sum", None, False, accum_dtype)
        cap.phase = "backward"
        gpu_capture.backward(loss[0] if isinstance(loss, tuple) else loss,
                             torch.ones((), device="cuda"), None, None, None)
    return cap


def scenarios(args, liger_function) -> dict:
    """name -> a function returning the capture (None: not available here).
    ``liger_function()``: Liger's autograd Function, or None."""
    def lig(dtype):
        def run():
            flce = liger_function()
            return None if flce is None else liger(args, flce, dtype)
        return run

    return {
        "fused fwd+bwd, logprob (ours, Triton)": lambda: fused(args),
        "fused fwd+bwd, logprob (ours, torch)": lambda: fused(args, "torch"),
        "forward-gradient mode (ours, Triton)": lambda: forward_grad(args),
        "fused fwd+bwd (Liger 0.8.5, dW fp32)": lig(torch.float32),
        "fused fwd+bwd (Liger 0.8.5, dW bf16)": lig(None),
        "unfused stats + grad, logprob + entropy (ours, Triton)": lambda: unfused(args),
    }
