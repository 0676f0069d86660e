"""The runtime classes of the model drafters' heads, per (backend, draft kind), and their loaders.

The model drafters pick a backend for their heads (hidden_drafter.head_runtime_backend: native or
torch); this table says which class runs each kind there. DSpark's Markov head chains through the
block token by token, which the native kernels do not do: beside a native target it runs on torch's
CPU path. Core opens a runtime from whatever table it is given (core/drafting/draft_models.py).
"""

from __future__ import annotations

from spekula.core.backend import Backend, BackendOptions, ModelInfo
from spekula.core.drafting.assistant_runtime import AssistantRuntime, open_assistant_runtime
from spekula.core.drafting.draft_models import DFlashRuntime, Eagle3Runtime, RuntimeEntry, open_draft_runtime
from spekula.core.drafting.mtp_runtime import MtpRuntime, open_mtp_runtime

_TORCH_DFLASH = RuntimeEntry("spekula.backends.torch.dflash:TorchDFlashRuntime")

DRAFT_RUNTIMES: dict[tuple[str, str], RuntimeEntry] = {
    ("native", "eagle3"): RuntimeEntry("spekula.backends.native.eagle3:NativeEagle3Runtime", shares_target=True),
    ("native", "dflash"): RuntimeEntry("spekula.backends.native.dflash:NativeDFlashRuntime", shares_target=True),
    ("native", "dspark"): _TORCH_DFLASH,
    ("native", "mtp"): RuntimeEntry("spekula.backends.native.mtp:NativeMtpRuntime"),
    ("torch", "eagle3"): RuntimeEntry("spekula.backends.torch.eagle3:TorchEagle3Runtime"),
    ("torch", "dflash"): _TORCH_DFLASH,
    ("torch", "dspark"): _TORCH_DFLASH,
    ("torch", "mtp"): RuntimeEntry("spekula.backends.torch.mtp:TorchMtpRuntime"),
    # Gemma 4's assistant reads the target's KV cache: it runs on the target's own backend.
    ("native", "assistant"): RuntimeEntry("spekula.backends.native.gemma4_assistant:NativeGemma4Assistant"),
    ("torch", "assistant"): RuntimeEntry("spekula.backends.torch.gemma4_assistant:TorchGemma4Assistant"),
}


def load_draft_runtime(backend_name: str, gguf_path: str, target: ModelInfo, options: BackendOptions | None = None,
                       target_backend: Backend | None = None) -> Eagle3Runtime | DFlashRuntime:
    """An EAGLE-3 / DFlash / DSpark head from its GGUF on ``backend_name`` (a native runtime runs over
    ``target_backend``'s threads and prepared weights)."""
    return open_draft_runtime(DRAFT_RUNTIMES, backend_name, gguf_path, target, options, target_backend)


def load_mtp_runtime(backend_name: str, target: Backend, draft_path: str | None, options: BackendOptions) -> MtpRuntime:
    """The MTP heads of ``draft_path`` (an MTP GGUF given with -md) or, without one, of the target's own GGUF."""
    return open_mtp_runtime(DRAFT_RUNTIMES, backend_name, target, draft_path, options)


def load_assistant_runtime(target_backend_name: str, target: Backend, draft_path: str) -> AssistantRuntime:
    """The KV-sharing assistant of ``draft_path`` (-md) on the target's own backend."""
    return open_assistant_runtime(DRAFT_RUNTIMES, target_backend_name, target, draft_path)
