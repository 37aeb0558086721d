"""The environment report: ``vocabstats-env`` or ``python -m megatron_vocabstats.env``.

What Python imports, the CUDA devices, what ``kernel="auto"`` picks and why, and the Megatron
bindings the patch touches (docs/install.md); a failed lookup is reported, not raised.
"""

from __future__ import annotations

import importlib
import inspect
import os
import platform
import sys
import warnings

from . import __version__, versions

TITLE = "megatron-vocabstats environment (paste into bug reports)"


def _status(name: str, version: str) -> str:
    problem = versions.check_version(name, version)
    if problem is None:
        return "ok"
    return f"OUTSIDE the supported {versions.component(name).supported}"


def _where(module) -> str:
    return os.path.dirname(getattr(module, "__file__", None) or "?")


def _import(name: str):
    """``(module, None)`` or ``(None, why not)``: absent, or present but failing to import."""
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            return None, "not installed"
        return None, f"installed, but its import fails ({exc})"
    except Exception as exc:  # noqa: BLE001 - TE/apex raise anything without CUDA; report it
        return None, f"installed, but its import fails ({type(exc).__name__}: {exc})"


def _dist_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _versions(torch) -> list[tuple[str, str]]:
    from .megatron import compat

    rows = [("megatron-vocabstats", f"{__version__} ({_where(sys.modules[__package__])})"),
            ("platform", platform.platform()),
            ("Python", f"{platform.python_version()} ({sys.executable}) "
                       f"[{_status('Python', platform.python_version())}]"),
            ("torch", f"{torch.__version__} ({_where(torch)}) "
                      f"[{_status('torch', torch.__version__)}]")]
    release = compat.megatron_core_release()
    if release is None:
        rows.append(("megatron-core", "not importable (pip install 'megatron-core"
                                      f"{versions.component('megatron-core').requirement}')"))
    else:
        rows.append(("megatron-core", f"{compat.megatron_core_version()} "
                                      f"[{_status('megatron-core', release)}]"))
        training, why = _import("megatron.training")
        rows.append(("megatron.training", f"importable ({_where(training)})" if training
                     else f"{why} (then the patch adds no flags: the import alone turns it on)"))
    triton, why = _import("triton")
    rows.append(("Triton", f"{triton.__version__} ({_where(triton)}) "
                           f"[{_status('Triton', triton.__version__)}]" if triton else why))
    te, why = _import("transformer_engine")
    rows.append(("transformer-engine", f"{getattr(te, '__version__', '?')} ({_where(te)})"
                 if te else why))
    apex, why = _import("apex")
    rows.append(("apex", f"{_dist_version('apex') or '?'} ({_where(apex)})" if apex else why))
    return rows


def _devices(torch) -> list[tuple[str, str]]:
    rows = [("torch built with CUDA", str(torch.version.cuda or "no (CPU build)"))]
    if not torch.cuda.is_available():
        return rows + [("CUDA devices", "none available")]
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        capability = f"{major}.{minor}"
        status = _status("CUDA capability", capability)
        rows.append((f"cuda:{i}", f"{torch.cuda.get_device_name(i)}, capability {capability} "
                                  f"[Triton kernels: {status}]"))
    return rows


def auto_kernel(torch) -> tuple[str, str]:
    """``(backend, why)`` of ``kernel="auto"`` for tensors on this machine's first device."""
    from .ops import kernels

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        chosen = kernels.resolve_kernel("auto", device)
    except ValueError as exc:
        return "error", str(exc)
    forced = kernels.forced_kernel()
    if forced:
        why = f"{kernels.KERNEL_ENV}={forced} is set"
    elif device.type != "cuda":
        why = "no CUDA device: the Triton kernels run on CUDA only"
    elif not kernels.triton_available():
        why = "triton is not installed"
    elif not kernels.AUTO_TRITON_ON_CUDA:
        why = ("ops.kernels.AUTO_TRITON_ON_CUDA is off: the Triton kernels have not yet passed "
               "the GPU suite; kernel='triton' (or VOCABSTATS_KERNEL=triton) opts in")
    else:
        why = "CUDA device, triton installed, ops.kernels.AUTO_TRITON_ON_CUDA on"
    return chosen, why


# The Megatron bindings the patch replaces or wraps: (label, module, attribute path, needed).
PATCH_TARGETS = (
    ("LanguageModule.compute_language_model_loss",
     "megatron.core.models.common.language_module.language_module",
     "LanguageModule.compute_language_model_loss", True),
    ("FullCudaGraphWrapper.reset_cuda_graph", "megatron.core.full_cuda_graph",
     "FullCudaGraphWrapper.reset_cuda_graph", False),
    ("megatron.training.arguments.add_megatron_arguments", "megatron.training.arguments",
     "add_megatron_arguments", False),
    ("megatron.training.arguments.validate_args", "megatron.training.arguments",
     "validate_args", False),
    ("megatron.training.initialize.validate_args", "megatron.training.initialize",
     "validate_args", False),
    ("megatron.training.yaml_arguments.validate_yaml", "megatron.training.yaml_arguments",
     "validate_yaml", False),
)


def _lookup(module_name: str, path: str):
    module, why = _import(module_name)
    if module is None:
        return None, why
    obj = module
    for part in path.split("."):
        if not hasattr(obj, part):
            return None, f"{module_name} has no {path}"
        obj = getattr(obj, part)
    return obj, None


def patch_targets() -> list[tuple[str, str]]:
    """``(label, "found" | "MISSING ..." | "absent ...")`` of every binding the patch touches."""
    rows = []
    for label, module_name, path, needed in PATCH_TARGETS:
        obj, why = _lookup(module_name, path)
        state = "found" if obj is not None else (f"MISSING: {why}" if needed else
                                                 f"absent, not needed ({why})")
        rows.append((label, state))
    gpt, why = _lookup("megatron.core.models.gpt.gpt_model", "GPTModel")
    if gpt is None:
        return rows + [("GPTModel", f"MISSING: {why}")]
    if "output_processor" in inspect.signature(gpt.forward).parameters:
        rows.append(("GPTModel.forward(output_processor=...)", "found (fused head hook, 0.18+)"))
    elif hasattr(gpt, "_postprocess"):
        rows.append(("GPTModel._postprocess", "found (fused head hook, 0.16-0.17)"))
    else:
        rows.append(("GPTModel fused-head hook", "MISSING: neither forward(output_processor=...) "
                                                 "nor _postprocess"))
    from .megatron import compat

    hybrid = compat.hybrid_model_class()
    rows.append((f"{hybrid.__name__}.forward" if hybrid is not None else "HybridModel.forward",
                 "found (fused head)" if hybrid is not None else
                 "absent, not needed (neither HybridModel nor MambaModel imports)"))
    bindings = compat.mtp_loss_bindings()
    rows.append(("process_mtp_loss", f"found in {len(bindings)} modules (fused MTP heads)"
                 if bindings else "absent, not needed (before 0.17 the MTP loss is inline)"))
    return rows


def report() -> str:
    """The whole report as text (what :func:`main` prints)."""
    import torch

    sections = [("versions", _versions(torch)), ("devices", _devices(torch))]
    kernel, why = auto_kernel(torch)
    interpret = os.environ.get("TRITON_INTERPRET", "unset")
    sections.append(("kernels", [('kernel="auto" picks', kernel), ("because", why),
                                 ("TRITON_INTERPRET", interpret)]))
    from .megatron import compat

    if compat.megatron_core_release() is not None:
        sections.append(("patch targets in this Megatron", patch_targets()))
    lines = [TITLE]
    for title, rows in sections:
        lines.append(f"\n[{title}]")
        width = max(len(name) for name, _ in rows)
        lines += [f"{name.ljust(width)}  {value}" for name, value in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv == ["--versions"]:  # the supported-versions table, as README.md shows it
        print(versions.markdown_table())
        return 0
    if argv:
        usage = (f"usage: vocabstats-env [--versions]\n{__doc__.splitlines()[0]}\n"
                 "--versions: print the supported-versions table instead").replace("``", "")
        help_asked = argv in (["-h"], ["--help"])
        print(usage, file=sys.stdout if help_asked else sys.stderr)
        return 0 if help_asked else 2
    with warnings.catch_warnings():
        # The components' import-time warnings (Megatron's "Transformer Engine and Apex are not
        # installed", ...) would only come above the report, which says what is installed.
        warnings.simplefilter("ignore")
        text = report()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
