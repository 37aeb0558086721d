"""Megatron-Bridge and ``import megatron_vocabstats.patch``, in one process: Bridge's real SFT
``forward_step`` (the megatron-bridge 0.3.1 wheel, ``requirements/py311-nodeps.txt``; it needs
megatron-core < 0.17, so it runs on the oldest leg and skips where the wheel is absent) hands the
labels to the model, whose ``compute_language_model_loss`` the patch replaces; the one log line
names Bridge's default ``cross_entropy_loss_fusion=True``, which the patch supersedes; ModelOpt
distillation's capture hook on the output layer turns the fused head off, naming it. The real
model runs in ``dist/megatron_bridge_cases.py`` (``test_megatron_bridge_dist.py``)."""

from __future__ import annotations

import types

import pytest
import torch

import _framework_stubs

pytestmark = pytest.mark.megatron
BRIDGE = "megatron.bridge"


@pytest.fixture(scope="module")
def gpt_step():
    if _framework_stubs.root(BRIDGE) is None:
        pytest.skip(f"megatron-bridge is not installed ({_framework_stubs.INSTALL[BRIDGE]})")
    return _framework_stubs.load(BRIDGE)["megatron.bridge.training.gpt_step"]


class _RecordingModel(torch.nn.Module):
    """Stands in for GPTModel: records the keywords of its call, returns a [b, s] loss."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(mtp_num_layers=None)
        one = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # a group of one rank
        self.pg_collection = types.SimpleNamespace(pp=one, cp=one)
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return torch.zeros_like(kwargs["labels"], dtype=torch.float32)


def test_loaded_from_the_wheel_beside_real_megatron_core(gpt_step):
    """Bridge's module runs from the wheel; megatron.core beside it (the shared ``megatron``
    namespace) is the real package, not a stub."""
    import megatron.core
    from megatron.core.models.common.language_module import language_module

    assert gpt_step.__file__.endswith("megatron/bridge/training/gpt_step.py")
    assert not isinstance(megatron.core, _framework_stubs.StubModule)
    assert gpt_step.GPTModel.__module__.startswith("megatron.core.models.gpt")
    assert hasattr(language_module.LanguageModule, "compute_language_model_loss")


def test_forward_step_passes_the_labels_to_the_model(gpt_step, monkeypatch):
    """Bridge's SFT forward_step calls ``model(input_ids=, position_ids=, attention_mask=,
    labels=)``: the loss is the model's (``compute_language_model_loss``), and its loss
    function only masks and sums the per-token losses."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    labels = torch.tensor([[3, 4, 5]])
    batch = {"tokens": torch.tensor([[1, 2, 3]]), "labels": labels,
             "loss_mask": torch.tensor([[0.0, 1.0, 1.0]]),
             "position_ids": torch.arange(3).unsqueeze(0), "attention_mask": None}
    state = types.SimpleNamespace(
        timers=lambda *a, **k: types.SimpleNamespace(start=lambda: None, stop=lambda: None),
        straggler_timer=_NullTimer(),
        cfg=types.SimpleNamespace(
            dataset=types.SimpleNamespace(skip_getting_attention_mask_from_dataset=True),
            rerun_state_machine=types.SimpleNamespace(check_for_nan_in_loss=False,
                                                      check_for_spiky_loss=False)))
    model = _RecordingModel()
    output, loss_func = gpt_step.forward_step(state, iter([batch]), model)
    (call,) = model.calls
    assert set(call) == {"input_ids", "position_ids", "attention_mask", "labels"}
    assert call["labels"] is labels
    loss, num_tokens, _ = loss_func(output + torch.tensor([[7.0, 1.0, 2.0]]))
    assert float(loss) == 3.0 and int(num_tokens) == 2


class _NullTimer:
    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_modelopt_capture_hook_is_a_reason_not_to_fuse():
    """ModelOpt's ``DistillationModel`` hooks the logit layers it distils (a forward hook from
    ``modelopt.torch.distill`` that keeps the output as ``_intermediate_output``): either sign
    names ModelOpt distillation among the reasons; a plain layer, or another hook, none."""
    from megatron_vocabstats.megatron.head import not_fused_reasons

    config = types.SimpleNamespace(params_dtype=torch.float32)
    plain = torch.nn.Linear(4, 8, bias=False)
    assert not_fused_reasons(plain, config) == ()
    plain.register_forward_hook(lambda module, inputs, output: None)
    assert not_fused_reasons(plain, config) == ()

    hooked = torch.nn.Linear(4, 8, bias=False)

    def student_output_capture_fwd_hook(module, inputs, output):
        module._intermediate_output = output

    student_output_capture_fwd_hook.__module__ = "modelopt.torch.distill.distillation_model"
    hooked.register_forward_hook(student_output_capture_fwd_hook)
    captured = torch.nn.Linear(4, 8, bias=False)
    captured._intermediate_output = None  # what DistillationModel sets up before hooking
    for layer in (hooked, captured):
        (reason,) = not_fused_reasons(layer, config)
        assert "ModelOpt distillation" in reason and "output_layer" in reason


@pytest.mark.parametrize("fusion, impl", [(True, "native"), (True, "te"), (False, "native")])
def test_the_log_line_names_a_superseded_cross_entropy_fusion(fusion, impl):
    """Bridge's ``GPTModelProvider`` sets ``cross_entropy_loss_fusion=True``: with no Megatron
    parser to refuse the pair, the one log line says that the plugin's loss supersedes it."""
    from megatron_vocabstats.megatron.announce import superseded

    module = types.SimpleNamespace(config=types.SimpleNamespace(
        cross_entropy_loss_fusion=fusion, cross_entropy_fusion_impl=impl))
    words = superseded(module)
    if fusion:
        assert words == (f"; supersedes cross_entropy_loss_fusion=True "
                         f"(cross_entropy_fusion_impl '{impl}': Megatron's fused cross-entropy "
                         f"does not run)")
    else:
        assert words == ""
    assert superseded(types.SimpleNamespace()) == ""
