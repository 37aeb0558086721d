"""Feature detection across megatron-core releases, in one place.

Every lookup is lazy: importing this module never imports Megatron, transformer-engine or apex.
Names are detected with ``hasattr`` / ``inspect.signature``; the version string only appears in
messages. ``tp_group_of``, ``default_tp_group`` and ``packed_seq_params_class`` live in
:mod:`megatron_vocabstats.mcore` (below this subpackage, for the losses, packing and ops).
"""

from __future__ import annotations

import importlib
import inspect
import os

from ..version_check import package_info_release
from ..versions import supported_range

# "megatron-core >=0.16,<0.21 (tested: 0.16.1, 0.19.2)", from the supported-versions table.
SUPPORTED = supported_range("megatron-core")


class UnsupportedMegatronError(ImportError):
    """The installed megatron-core lacks a name the plugin needs."""


def megatron_core_release() -> str | None:
    """The release number of the megatron-core that Python imports (``"0.19.2"``), None when it
    cannot be imported.

    Read from the imported ``megatron.core.package_info`` (its ``MAJOR.MINOR.PATCH`` and
    pre-release tag), else ``megatron.core.__version__`` without its ``+local`` part: Megatron
    appends ``+<git commit>`` to ``__version__`` from whatever git repository holds the installed
    package, which for a virtual environment inside a clone of another project is that project's
    commit.
    """
    try:
        import megatron.core
    except ImportError:
        return None
    try:
        from megatron.core import package_info
    except ImportError:
        package_info = None
    release = package_info_release(package_info)
    if release is not None:
        return release
    return str(getattr(megatron.core, "__version__", "unknown")).split("+", 1)[0]


def _in_site_packages(path: str) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))


def megatron_core_version() -> str:
    """The version of the megatron-core that Python imports, with where it comes from.

    ``"0.19.2 (/path/to/megatron/core)"``: the release of :func:`megatron_core_release`, plus
    Megatron's ``+<commit>`` only for a source checkout (a ``megatron/core`` outside
    site-packages, e.g. a Megatron-LM clone first on ``sys.path``, whose commit it is).
    ``"not installed"`` when it cannot be imported.
    """
    release = megatron_core_release()
    if release is None:
        return "not installed"
    import megatron.core

    where = os.path.dirname(megatron.core.__file__)
    version = str(getattr(megatron.core, "__version__", release))
    if "+" in version and not _in_site_packages(where):
        release += "+" + version.split("+", 1)[1]
    return f"{release} ({where})"


def language_module_class():
    """``LanguageModule``; raises :class:`UnsupportedMegatronError` if absent or unusable."""
    try:
        from megatron.core.models.common.language_module.language_module import LanguageModule
    except ImportError as exc:
        raise UnsupportedMegatronError(
            f"megatron_vocabstats.patch needs {SUPPORTED}; importing "
            f"megatron.core.models.common.language_module failed ({exc}); installed: "
            f"{megatron_core_version()}"
        ) from exc
    method = getattr(LanguageModule, "compute_language_model_loss", None)
    params = list(inspect.signature(method).parameters) if method is not None else []
    if params[:3] != ["self", "labels", "logits"]:
        raise UnsupportedMegatronError(
            f"megatron-core {megatron_core_version()} has no "
            "LanguageModule.compute_language_model_loss(self, labels, logits); the plugin "
            f"supports {SUPPORTED}"
        )
    return LanguageModule


def gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel


def hybrid_model_class():
    """The hybrid (Mamba / attention) model class: ``HybridModel``
    (``megatron/core/models/hybrid/``, megatron-core 0.18+; its ``MambaModel`` subclass keeps its
    ``forward``), else the ``MambaModel`` of 0.16-0.17 (``megatron/core/models/mamba/``, the same
    output layer then ``compute_language_model_loss`` at the end of ``forward``), or None where
    neither imports (then its fused head is skipped, with that reason in the patch log)."""
    for module_name, name in (("megatron.core.models.hybrid.hybrid_model", "HybridModel"),
                              ("megatron.core.models.mamba.mamba_model", "MambaModel")):
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    return None


def mtp_loss_bindings() -> list:
    """The modules that bind Megatron's ``process_mtp_loss`` (0.17+): its defining module and
    the model modules that import it by name (``gpt_model``, ``hybrid_model``, ``mamba_model``
    of 0.17). Empty before
    0.17 (0.16 computes the MTP loss inline in ``GPTModel._postprocess``)."""
    bindings = []
    for name in ("megatron.core.transformer.multi_token_prediction",
                 "megatron.core.models.gpt.gpt_model",
                 "megatron.core.models.hybrid.hybrid_model",
                 "megatron.core.models.mamba.mamba_model"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, "process_mtp_loss", None)):
            bindings.append(module)
    return bindings


def has_output_processor(model_cls, method: str = "forward") -> bool:
    """True where ``method`` (``forward``, ``build_schedule_plan``) takes ``output_processor``
    (megatron-core 0.18+)."""
    return "output_processor" in inspect.signature(getattr(model_cls, method)).parameters


def training_module(name: str):
    """``megatron.training.<name>``, or None where the wheel has no ``megatron.training`` (< 0.17).

    Raises :class:`UnsupportedMegatronError` when ``megatron.training`` is there but fails to
    import (a missing dependency such as pydantic): the patch then applies nothing instead of
    leaving Megatron's parser without our flags.
    """
    module_name = f"megatron.training.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name in ("megatron.training", module_name):
            return None
        raise UnsupportedMegatronError(
            f"importing {module_name} failed ({exc}); install what it needs, or import the plugin "
            f"where megatron.training is absent; megatron-core {megatron_core_version()}"
        ) from exc
    except ImportError as exc:
        raise UnsupportedMegatronError(
            f"importing {module_name} failed ({exc}); megatron-core {megatron_core_version()}"
        ) from exc


def full_cuda_graph_wrapper_class():
    """Megatron's ``FullCudaGraphWrapper`` (full-iteration CUDA graphs), or None where the release
    has none or it lacks ``reset_cuda_graph``."""
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError:
        return None
    return FullCudaGraphWrapper if hasattr(FullCudaGraphWrapper, "reset_cuda_graph") else None


def transformer_engine_fused_adam_available() -> bool:
    """True if transformer-engine's ``FusedAdam`` (the precision-aware optimizer) imports."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except Exception:  # noqa: BLE001 - TE raises various errors without CUDA
        return False
    return True
