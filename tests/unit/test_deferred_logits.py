"""The fused LM head's stand-in for the logits (``megatron/head.py``): a logit scale by
multiplication or division (Python, numpy, 0-dim tensor factors) reaches the op as its temperature
and gives the float64 reference's numbers; every other tensor use raises one clear error; the
output layer's forward pre-hooks and hooks run as on Megatron's own call. In-process, no
Megatron model (a bias-free ``nn.Linear`` stands in for the output layer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_vocabstats.megatron import settings
from megatron_vocabstats.megatron.head import DeferredLogits, deferred_call
from megatron_vocabstats.megatron.model import fused_output_processor, fused_stats

S, B, H, V = 5, 2, 4, 11


def _logits():
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(V, H, generator=gen))
    return DeferredLogits(torch.randn(S, B, H, generator=gen), layer.weight, layer), layer


def _reference_logprobs(hidden, weight, labels, scale):
    """float64 ``log_softmax(scale * h W^T)`` at ``labels [b, s]``, ``[s, b]``."""
    logits = scale * (hidden.double() @ weight.double().T)
    return logits.log_softmax(-1).gather(-1, labels.T.unsqueeze(-1)).squeeze(-1)


@pytest.fixture
def fused_settings():
    settings.update(active=True, lm_head_chunk_size=4)
    yield settings.current()
    settings.reset()


TENSOR_USES = {
    "add": lambda x: x + 1.0, "radd": lambda x: 1.0 + x, "sub": lambda x: x - 1.0,
    "rtruediv": lambda x: 2.0 / x, "pow": lambda x: x ** 2, "neg": lambda x: -x,
    "matmul": lambda x: x @ torch.ones(V), "index": lambda x: x[0], "len": len,
    "iter": list, "bool": bool, "eq": lambda x: x == x, "lt": lambda x: x < 0,
    "float()": float, ".float()": lambda x: x.float(), ".shape": lambda x: x.shape,
    ".transpose": lambda x: x.transpose(0, 1), "softmax": lambda x: torch.softmax(x, -1),
    "F.cross_entropy": lambda x: torch.nn.functional.cross_entropy(x, torch.zeros(S).long()),
    "cat": lambda x: torch.cat([x, x]), "tensor + x": lambda x: torch.ones(()) + x,
    "np.asarray": np.asarray, "mul by a vector": lambda x: x * torch.ones(V),
    "mul by a tensor requiring grad": lambda x: x * torch.tensor(2.0, requires_grad=True),
    "mul by a string": lambda x: x * "2", "mul by a bool": lambda x: x * True,
    "torch.div with rounding": lambda x: torch.div(x, 2.0, rounding_mode="floor"),
}


@pytest.mark.parametrize("use", TENSOR_USES.values(), ids=TENSOR_USES.keys())
def test_every_tensor_use_raises_one_clear_error(use):
    logits, _ = _logits()
    with pytest.raises(TypeError, match=r"megatron-vocabstats.*--lm-head-chunk-size 0"):
        use(logits)


SCALES = {"float": 2.0, "int": 2, "np.float32": np.float32(2.0), "np.int64": np.int64(2),
          "0-dim tensor": torch.tensor(2.0), "0-dim int tensor": torch.tensor(2)}
APPLY = {"x * s": lambda x, s: x * s, "s * x": lambda x, s: s * x,
         "torch.mul": lambda x, s: torch.mul(x, s), "x / (1/s)": lambda x, s: x / (1 / s),
         "torch.div": lambda x, s: torch.div(x, 1 / s)}


@pytest.mark.parametrize("apply", APPLY.values(), ids=APPLY.keys())
@pytest.mark.parametrize("factor", SCALES.values(), ids=SCALES.keys())
def test_scale_by_any_real_factor_times_or_divided(apply, factor, fused_settings):
    logits, _ = _logits()
    scaled = apply(logits, factor)
    assert isinstance(scaled, DeferredLogits) and scaled.op_kwargs()["temperature"] == 0.5
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    stats = fused_stats(scaled, labels, fused_settings)
    want = _reference_logprobs(logits.hidden, logits.weight, labels, 2.0)
    torch.testing.assert_close(stats.logprobs.double(), want, rtol=0, atol=1e-5)


def test_a_temperature_divides_like_megatron_logits(fused_settings):
    """``logits / T`` then MuP's ``* m``: scale ``m / T``, the numbers of those logits."""
    logits, _ = _logits()
    scaled = (logits / np.float32(0.7)) * 0.5
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    stats = fused_stats(scaled, labels, fused_settings)
    want = _reference_logprobs(logits.hidden, logits.weight, labels, 0.5 / float(np.float32(0.7)))
    torch.testing.assert_close(stats.logprobs.double(), want, rtol=0, atol=1e-5)


def test_bad_scales_raise_at_use():
    logits, _ = _logits()
    with pytest.raises(ValueError, match="divided by 0"):
        logits / 0.0
    for scale in (-1.0, 0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite, positive"):
            (logits * scale).op_kwargs()
    assert logits.op_kwargs() == dict(tp_group=None, sequence_parallel=False,
                                      accumulate_into_main_grad=False, temperature=1.0)


class _Model:
    """Where the fused head finds the model (``compute_language_model_loss.__self__``)."""

    def compute_language_model_loss(self, labels, logits):
        raise AssertionError("the fused head took Megatron's loss path")


def test_fused_head_runs_the_output_layer_pre_hooks_and_hooks(fused_settings):
    """A forward pre-hook that gathers the weight (here: copies it in, as the distributed
    optimizer's overlapped param gather does) must run before the fused head reads the weight,
    and a forward hook after; the loss is the float64 reference's with the gathered weight."""
    logits, layer = _logits()
    gathered = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.zero_()
    calls = []

    def gather(module, args, kwargs):
        calls.append("pre")
        with torch.no_grad():
            module.weight.copy_(gathered)

    layer.register_forward_pre_hook(gather, with_kwargs=True)
    layer.register_forward_hook(lambda module, args, out: calls.append("post"))
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    model = _Model()
    loss = fused_output_processor(hidden_states=logits.hidden, output_layer=layer,
                                  output_weight=None, labels=labels,
                                  compute_language_model_loss=model.compute_language_model_loss)
    assert calls == ["pre", "post"] and model.last_vocab_stats.logprobs.shape == (B, S)
    want = -_reference_logprobs(logits.hidden, gathered, labels, 1.0).T
    torch.testing.assert_close(loss.double(), want, rtol=0, atol=1e-5)


def test_a_hook_replacing_the_deferred_logits_is_refused():
    logits, layer = _logits()
    layer.register_forward_hook(lambda module, args, out: (torch.zeros(1), None))
    with pytest.raises(TypeError, match="forward hook of the output layer replaced"):
        deferred_call(layer, logits.hidden)
    assert "forward" not in vars(layer), "the layer's own forward is back"


def test_not_fused_message_reads_for_a_plural_head():
    from megatron_vocabstats.megatron.head import fused_or_report

    cfg = settings.PluginSettings(active=True, lm_head_chunk_size=4, require_fused_lm_head=True)
    with pytest.raises(ValueError) as error:
        fused_or_report("the MTP heads", ("a bias",), cfg)
    assert ("--lm-head-chunk-size 4 but Megatron's output layer and logits stay in use for the "
            "MTP heads: a bias") in str(error.value)
    assert "keeps" not in str(error.value)
