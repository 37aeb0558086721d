"""CPU shims for Megatron-LM's own training loop, ``megatron.training.pretrain``: tests only.

:func:`megatron_vocabstats.testing.megatron_cpu.install_cpu_shims` lets ``GPTModel`` run without
CUDA (memory buffer, causal mask, RNG tracker); the training loop around it also calls CUDA
directly. :func:`cpu_training` adds the stubs below (one line of why each) and builds tensors asked
for on ``cuda`` on the CPU, for as long as it is entered. It changes ``torch.cuda`` and Megatron's
modules for the whole process and never undoes that: use it only in a process of its own (the
torchrun script ``tests/unit/dist/megatron_training_run.py``), never in the pytest process. It is a
no-op where CUDA is available. It is not part of the plugin. The flags a CPU run needs as well are
listed in docs/megatron.md, "Running Megatron's training loop on CPU". :data:`HYBRID_CPU_SPEC`: a
``HybridModel`` stack of attention layers that runs on the CPU (``--spec megatron_cpu_training
HYBRID_CPU_SPEC``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

_INSTALLED = False


class _NoStream:
    """Stands in for ``torch.cuda.Stream``: waiting on or for a stream is a no-op on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _building_model_parallel_groups(initialize_distributed):
    """``_initialize_distributed`` that builds the model-parallel groups on a CPU-only machine."""

    @functools.wraps(initialize_distributed)
    def wrapper(*args, **kwargs):
        from megatron_vocabstats.testing.megatron_cpu import install_cpu_shims

        saved = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
        try:
            initialize_distributed(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = saved
        install_cpu_shims()  # after the groups exist (it replaces their memory buffer)

    return wrapper


def install() -> bool:
    """Apply the stubs if CUDA is absent; returns True if they are (now) in place. Idempotent."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import arguments, initialize, training

    from megatron_vocabstats.testing.megatron_cpu import tag_torch_norm_for_sequence_parallel

    # pretrain() calls initialize_megatron() without allow_no_cuda, which asserts CUDA.
    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
    # validate_args reads the GPU's compute capability under tp > 1; 0 = before Blackwell (which
    # then requires CUDA_DEVICE_MAX_CONNECTIONS=1, set by the run script).
    arguments.get_device_arch_version = lambda: 0
    # It creates the tp/pp/dp groups only if torch.cuda.device_count() > 0 (and calls set_device):
    # one device is reported during the call only, so _set_random_seed, after it, still sees none
    # and seeds the CPU generator alone; then megatron_cpu.py's GPTModel shims are installed.
    initialize._initialize_distributed = _building_model_parallel_groups(
        initialize._initialize_distributed)
    # _compile_dependencies runs `make` on the dataset helpers: the wheel ships them prebuilt
    # (helpers_cpp) and without the Makefile, so make fails and rank 0 exits.
    dataset_utils.compile_helpers = lambda: None
    # Its warm-up runs the fused bias-GeLU and bias-dropout-add kernels (torch.compile) on 'cuda'
    # tensors; the CPU run takes the unfused paths (--no-bias-gelu-fusion,
    # --no-bias-dropout-fusion).
    training.set_jit_fusion_options = lambda tp_size=None: None
    # Megatron's timers (start(barrier=True)) and the training loop synchronise the GPU.
    torch.cuda.synchronize = lambda device=None: None
    # Receive buffers and reductions are built on device=torch.cuda.current_device(), i.e. 0,
    # which the factory mode of cpu_training() maps to the CPU.
    torch.cuda.current_device = lambda: 0
    # Megatron's torch LayerNorm refuses --sequence-parallel for want of the parameter tag by
    # which finalize_model_grads all-reduces its gradients: the test-support shim sets it.
    tag_torch_norm_for_sequence_parallel()
    _no_inference_layers_without_te()
    # pretrain_gpt.py's get_batch moves the batch with .cuda(non_blocking=True).
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # The model is wrapped in DDP on a side stream (models/dist_utils.py, _ddp_wrap).
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    _INSTALLED = True
    return True


def _no_inference_layers_without_te() -> None:
    """Megatron-LM main (0.20) builds an MTP layer only after asking
    ``is_inference_column_parallel_linear(eh_proj)``, an ``isinstance`` against inference layers
    derived from transformer-engine's; without transformer-engine those are mocks, not classes,
    and the ``isinstance`` raises. No such layer can exist then: the answer is False."""
    try:
        from megatron.core.tensor_parallel import inference_layers
        from megatron.core.transformer import multi_token_prediction as mtp
    except ImportError:  # a release without them
        return
    if (hasattr(mtp, "is_inference_column_parallel_linear")
            and not isinstance(inference_layers.InferenceColumnParallelLinear, type)):
        mtp.is_inference_column_parallel_linear = lambda module: False


@contextlib.contextmanager
def cpu_training():
    """:func:`install`, then, inside the context, tensor factories asked for ``device="cuda"``
    (training.py's loss and timing reductions, the schedules' token counter) build on the CPU
    (:func:`megatron_vocabstats.testing.megatron_cpu.cuda_factories_on_cpu`). Yields whether the
    stubs are in place (False where CUDA is available: nothing is changed then)."""
    from megatron_vocabstats.testing.megatron_cpu import cuda_factories_on_cpu

    installed = install()
    with cuda_factories_on_cpu():
        yield installed


def _hybrid_cpu_spec():
    """A ``HybridStack`` spec of attention layers (Megatron's local GPT layer: Mamba's kernels need
    CUDA) without the final norm (HybridStack builds it with transformer-engine)."""
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec
    except ImportError:  # no HybridModel in this release (< 0.18)
        return None
    return ModuleSpec(module=HybridStack, params={"post_layer_norm": False},
                      submodules=HybridStackSubmodules(attention_layer=get_gpt_layer_local_spec()))


# For --spec megatron_cpu_training HYBRID_CPU_SPEC (with --hybrid-layer-pattern of '*' layers).
HYBRID_CPU_SPEC = _hybrid_cpu_spec()
