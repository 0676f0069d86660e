"""Pick the ONNX Runtime execution provider without letting a failed CUDA load spray errors.

onnxruntime-gpu lists CUDAExecutionProvider as "available" whether or not a driver and the CUDA
libraries exist; asking for it on a machine without them logs an ERROR line and quietly runs on CPU.
So the choice is made here, once per process and device: no driver -> CPU without touching ORT's CUDA
provider; otherwise a throwaway one-node session is created with CUDA (ORT's logging silenced for
just that attempt) and CUDA counts as usable only if the session really got it.

The rule (`--device` x `--ort-provider`), same outcome as the torch backend wherever a device is
named explicitly:

  ort_provider=cpu          CPU, whatever the device says (forcing CPU never fails).
  ort_provider=cuda         CUDA device N (from cuda:N, else 0); ConfigError if CUDA is not usable.
  ort_provider=auto, device=cuda[:N]
                            CUDA device N; ConfigError if CUDA is not usable. An explicit CUDA device
                            never degrades to CPU in silence: the torch backend refuses too, and a run
                            100x slower than asked for is worse than an error.
  ort_provider=auto, device=cpu (the default)
                            CUDA device 0 when usable (as docs/backends.md documents: the ONNX backend takes a
                            GPU when there is one), otherwise CPU without a word. Never an error.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
from collections.abc import Callable
from dataclasses import dataclass

from spekula.core.backend import BackendOptions
from spekula.core.errors import ConfigError

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
PROVIDER_CHOICES = ("auto", "cuda", "cpu")
_ORT_ERROR = 3  # ORT log severities: 0 verbose .. 3 error, 4 fatal
_ORT_FATAL = 4


@dataclass(frozen=True, slots=True)
class ProviderChoice:
    name: str  # "cuda" | "cpu"
    device_id: int = 0

    def ort_providers(self) -> list[str | tuple[str, dict[str, str]]]:
        if self.name == "cuda":
            return [(CUDA_EP, {"device_id": str(self.device_id)}), CPU_EP]
        return [CPU_EP]


def _cuda_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@functools.cache
def cuda_usable(device_id: int) -> str | None:
    """None when ORT can run on CUDA device `device_id`, else the reason it cannot."""
    import onnxruntime as ort

    if CUDA_EP not in ort.get_available_providers():
        return "this onnxruntime build has no CUDA provider"
    if not _cuda_driver_present():
        return "no CUDA driver (libcuda.so.1 not found)"
    preload = getattr(ort, "preload_dlls", None)  # loads pip-installed CUDA/cuDNN libraries when present
    if preload is not None:  # it print()s every library it misses: keep that out of the user's terminal
        with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            preload(directory="")
    from onnx import TensorProto, helper

    node = helper.make_node("Identity", ["x"], ["y"])
    value = helper.make_tensor_value_info
    graph = helper.make_graph([node], "probe", [value("x", TensorProto.FLOAT, [1])], [value("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.log_severity_level = _ORT_FATAL
    ort.set_default_logger_severity(_ORT_FATAL)  # the provider-library load error goes to the default logger
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=[(CUDA_EP, {"device_id": str(device_id)}), CPU_EP])
        got = sess.get_providers()
    except Exception as exc:  # a bad device id or a broken CUDA install
        return f"CUDA session failed: {exc}".splitlines()[0]
    finally:
        ort.set_default_logger_severity(_ORT_ERROR)
    if CUDA_EP not in got:
        return "the CUDA provider did not load (CUDA/cuDNN libraries missing or incompatible)"
    return None


def _device_id(device: str) -> int:
    if device in ("cuda", "gpu"):
        return 0
    try:
        return int(device.split(":", 1)[1])
    except (IndexError, ValueError):
        raise ConfigError(f"bad device {device!r}; use cpu, cuda or cuda:N") from None


def select_provider(options: BackendOptions, probe: Callable[[int], str | None] = cuda_usable) -> ProviderChoice:
    """The provider by the rule in the module docstring: a CUDA device asked for (by `--device cuda[:N]`
    or `--ort-provider cuda`) is CUDA or a ConfigError; `auto` with `--device cpu` takes a usable GPU
    and otherwise stays on CPU; `--ort-provider cpu` is always CPU.

    `probe` is injectable so the decision logic is tested on machines without a GPU.
    """
    forced = options.ort_provider
    if forced not in PROVIDER_CHOICES:
        raise ConfigError(f"unknown ORT provider {forced!r}; available: {', '.join(PROVIDER_CHOICES)}")
    device = options.device.strip().lower()
    if device != "cpu" and not device.startswith(("cuda", "gpu")):
        raise ConfigError(f"bad device {options.device!r}; use cpu, cuda or cuda:N")
    if forced == "cpu":
        return ProviderChoice("cpu")
    device_id = _device_id(device) if device != "cpu" else 0
    why_not = probe(device_id)
    if why_not is None:
        return ProviderChoice("cuda", device_id)
    if forced == "cuda":
        raise ConfigError(f"ORT provider cuda was requested but CUDA is not usable: {why_not}")
    if device != "cpu":
        raise ConfigError(f"device {options.device!r} requested but CUDA is not available to onnxruntime: "
                          f"{why_not}; use --device cpu")
    return ProviderChoice("cpu")
