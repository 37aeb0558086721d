"""The scenarios of ``gpu_model.py``: the rows of the GPU suite's speed tables
(``tests/gpu/speed.py``: the unfused op on ``[T, V]`` bf16 logits; ``tests/gpu/speed_fused.py``:
the fused LM head, ``T x H`` hidden states and a ``[V padded to 128, H]`` weight), each run on
fake CUDA tensors of the same shapes inside :func:`gpu_capture.capturing`, forward then
backward. bf16, tp 1, host checks off (``validate=False``, as the speed tables' rows of ours);
the upstream gradients are those of the tables' losses (``sum(mask * -logprob)``, entropy rows
``+ 0.01 sum(mask * entropy)``; the forward-gradient mode's ``loss_weights`` is the mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import gpu_capture

BF16 = torch.bfloat16
# The speed tables' providers of ours and their kernel (tests/gpu/_suite.OUR_KERNELS).
OURS = {"ours": "torch", "ours_triton": "triton"}
UNFUSED_MODES = {"logprob": "off", "logprob+entropy": "grad"}
FUSED_MODES = ("logprob", "logprob fwd-grad", "logprob+entropy")
LIGER_MODES = {"logprob fwd-grad": None, "logprob fwd-grad fp32 dW": torch.float32}


@dataclass(frozen=True)
class Scenario:
    """One row of a speed table: ``table`` ``"unfused"`` or ``"fused"``."""

    table: str
    provider: str
    mode: str
    tokens: int
    hidden: int | None = None

    @property
    def title(self) -> str:
        shape = f"T={self.tokens}" + (f", H={self.hidden}" if self.hidden else "")
        return f"{self.table} {self.provider} {self.mode} ({shape})"


def _padded(vocab: int) -> int:
    return -(-vocab // 128) * 128


def _fused(sc: Scenario, vocab: int):
    import megatron_vocabstats as m

    kernel = OURS[sc.provider]
    with gpu_capture.capturing() as cap:
        h = torch.empty(sc.tokens, sc.hidden, dtype=BF16, device="cuda", requires_grad=True)
        w = torch.empty(_padded(vocab), sc.hidden, dtype=BF16, device="cuda", requires_grad=True)
        t = torch.zeros(sc.tokens, dtype=torch.long, device="cuda")
        mask = torch.ones(sc.tokens, device="cuda")
        fwd_grad = sc.mode == "logprob fwd-grad"
        entropy = "grad" if sc.mode == "logprob+entropy" else "off"
        out = m.linear_vocab_parallel_stats(h, w, t, vocab_size=vocab, entropy=entropy,
                                            grad_weights=mask if fwd_grad else None,
                                            kernel=kernel, validate=False)
        cap.phase = "backward"
        gpu_capture.backward(out.logprobs, -mask, 0.01 * mask if entropy == "grad" else None,
                             None)
    return cap


def _unfused(sc: Scenario, vocab: int):
    import megatron_vocabstats as m

    entropy = UNFUSED_MODES[sc.mode]
    with gpu_capture.capturing() as cap:
        x = torch.empty(sc.tokens, vocab, dtype=BF16, device="cuda", requires_grad=True)
        t = torch.zeros(sc.tokens, dtype=torch.long, device="cuda")
        st = m.vocab_parallel_stats(x, t, entropy=entropy, kernel=OURS[sc.provider],
                                    validate=False)
        cap.phase = "backward"
        ones = torch.ones(sc.tokens, device="cuda")
        gpu_capture.backward(st.logprobs, ones, ones if entropy == "grad" else None, None)
    return cap


def _liger(sc: Scenario, vocab: int, flce):
    with gpu_capture.capturing(item_value=lambda t: sc.tokens) as cap:
        h = torch.empty(sc.tokens, sc.hidden, dtype=BF16, device="cuda", requires_grad=True)
        w = torch.empty(_padded(vocab), sc.hidden, dtype=BF16, device="cuda", requires_grad=True)
        t = torch.zeros(sc.tokens, dtype=torch.long, device="cuda")
        loss = flce.apply(h, w, t, None, None, -100, 0.0, 0.0, "sum", None, False,
                          LIGER_MODES[sc.mode])
        cap.phase = "backward"
        gpu_capture.backward(loss[0] if isinstance(loss, tuple) else loss,
                             torch.ones((), device="cuda"), None, None, None)
    return cap


def scenarios(tokens: list, hidden: int, vocab: int, liger_function) -> dict:
    """``{Scenario: run}``: ``run()`` returns the capture, or None where it cannot run here.
    Fused rows at each of ``tokens`` with ``hidden``, unfused rows at each of ``tokens``.
    ``liger_function()``: Liger's autograd Function, or None."""
    out = {}
    for t in tokens:
        for provider in OURS:
            for mode in FUSED_MODES:
                sc = Scenario("fused", provider, mode, t, hidden)
                out[sc] = (lambda sc=sc: _fused(sc, vocab))
        for mode in LIGER_MODES:
            sc = Scenario("fused", "liger", mode, t, hidden)

            def run(sc=sc):
                flce = liger_function()
                return None if flce is None else _liger(sc, vocab, flce)

            out[sc] = run
        for provider in OURS:
            for mode in UNFUSED_MODES:
                sc = Scenario("unfused", provider, mode, t)
                out[sc] = (lambda sc=sc: _unfused(sc, vocab))
    return out
