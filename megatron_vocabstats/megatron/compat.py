"""Feature detection across megatron-core releases, in one place: lazy lookups (importing this
module imports no Megatron, transformer-engine or apex) by ``hasattr`` / ``inspect.signature``;
the version string only appears in messages.
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
    """The release of the imported megatron-core (``"0.19.2"``), None if it cannot be imported;
    from ``package_info``, else ``__version__`` without its ``+local`` part (the commit of
    whatever git repository holds the installed package, maybe another project's)."""
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
    """``"0.19.2 (/path/to/megatron/core)"``: :func:`megatron_core_release` and where it is, plus
    ``+<commit>`` for a source checkout outside site-packages; ``"not installed"`` if absent."""
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
            + ("; pip install megatron-core into this environment (or this package with its "
               "[megatron] extra)" if isinstance(exc, ModuleNotFoundError)
               and (exc.name or "").split(".")[0] == "megatron" else "")
        ) from exc
    method = getattr(LanguageModule, "compute_language_model_loss", None)
    params = list(inspect.signature(method).parameters) if method is not None else []
    if params[:3] != ["self", "labels", "logits"]:
        raise UnsupportedMegatronError(
            f"megatron-core {megatron_core_version()} has no "
            "LanguageModule.compute_language_model_loss(self, labels, logits); the plugin "
            f"supports {SUPPORTED}")
    return LanguageModule


def gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel


def hybrid_model_class():
    """The hybrid (Mamba / attention) model class: ``HybridModel`` (0.18+), else the
    ``MambaModel`` of 0.16-0.17, or None where neither imports (its fused head is then skipped)."""
    for module_name, name in (("megatron.core.models.hybrid.hybrid_model", "HybridModel"),
                              ("megatron.core.models.mamba.mamba_model", "MambaModel")):
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    return None


def mtp_loss_bindings() -> list:
    """The modules binding Megatron's ``process_mtp_loss`` (0.17+); empty before 0.17 (0.16's
    MTP loss is inline in ``_postprocess``)."""
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
    """True where ``model_cls.method`` takes ``output_processor`` (0.18+)."""
    return "output_processor" in inspect.signature(getattr(model_cls, method)).parameters


def training_module(name: str):
    """``megatron.training.<name>``, or None where the wheel has none (< 0.17). Raises
    :class:`UnsupportedMegatronError` where it fails to import, so that the patch applies
    nothing rather than leave the parser without our flags."""
    module_name = f"megatron.training.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name in ("megatron.training", module_name):
            return None
        raise UnsupportedMegatronError(
            f"importing {module_name} failed ({exc}); install what it needs, or import the plugin "
            f"where megatron.training is absent; megatron-core {megatron_core_version()}") from exc
    except ImportError as exc:
        raise UnsupportedMegatronError(
            f"importing {module_name} failed ({exc}); megatron-core {megatron_core_version()}"
        ) from exc


def full_cuda_graph_wrapper_class():
    """Megatron's ``FullCudaGraphWrapper``, None where absent or without ``reset_cuda_graph``."""
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
