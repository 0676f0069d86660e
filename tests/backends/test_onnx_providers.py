"""Execution-provider choice: the decision logic with a fake CUDA probe, and the real probe's quiet
answer on this machine (a GPU machine skips the no-GPU checks)."""

from __future__ import annotations

import pytest

from spekula.core.backend import BackendOptions
from spekula.core.errors import ConfigError
from spekula.fixtures.tiny_gguf import tiny_model_path

pytest.importorskip("onnxruntime")
from spekula.backends.onnx import providers as onnx_providers
from spekula.backends.onnx.providers import ProviderChoice, select_provider


class _Probe:
    def __init__(self, answer: str | None) -> None:
        self.answer = answer
        self.asked: list[int] = []

    def __call__(self, device_id: int) -> str | None:
        self.asked.append(device_id)
        return self.answer


@pytest.mark.parametrize(
    ("device", "provider", "usable", "expected"),
    [
        ("cpu", "auto", True, ProviderChoice("cuda", 0)),  # auto takes a usable GPU
        ("cpu", "auto", False, ProviderChoice("cpu")),
        ("cuda:1", "auto", True, ProviderChoice("cuda", 1)),
        ("cuda:1", "cuda", True, ProviderChoice("cuda", 1)),
        ("cuda", "cpu", True, ProviderChoice("cpu")),  # forced CPU wins over a GPU
    ],
)
def test_selection(device: str, provider: str, usable: bool, expected: ProviderChoice) -> None:
    probe = _Probe(None if usable else "no GPU (test)")
    got = select_provider(BackendOptions(device=device, ort_provider=provider), probe=probe)
    assert got == expected
    assert probe.asked == ([] if provider == "cpu" else [expected.device_id if usable else int(device[5:] or 0)])


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "GPU"])
def test_explicit_cuda_device_without_gpu_is_a_clear_error(device: str) -> None:
    """`--device cuda` with `--ort-provider auto` used to fall back to CPU with one info line; the torch
    backend refuses, and so does this one now (naming the device and why CUDA is unusable)."""
    probe = _Probe("no GPU (test)")
    with pytest.raises(ConfigError, match=rf"device '{device}' requested but CUDA is not available .*no GPU \(test\)"):
        select_provider(BackendOptions(device=device, ort_provider="auto"), probe=probe)
    assert probe.asked == [int(device[5:] or 0) if device.startswith("cuda") else 0]


def test_cpu_device_with_auto_never_fails() -> None:
    """The default (`--device cpu`, `auto`) stays on CPU without a GPU, without an error or a probe error."""
    assert select_provider(BackendOptions(), probe=_Probe("no GPU (test)")) == ProviderChoice("cpu")


def test_forced_cuda_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cuda was requested but CUDA is not usable: no GPU"):
        select_provider(BackendOptions(ort_provider="cuda"), probe=_Probe("no GPU"))


@pytest.mark.parametrize(("device", "provider"), [("tpu", "auto"), ("cuda:x", "auto"), ("cpu", "rocm")])
def test_bad_names(device: str, provider: str) -> None:
    with pytest.raises(ConfigError):
        select_provider(BackendOptions(device=device, ort_provider=provider), probe=_Probe(None))


def test_ort_provider_lists() -> None:
    assert ProviderChoice("cpu").ort_providers() == ["CPUExecutionProvider"]
    assert ProviderChoice("cuda", 2).ort_providers() == [("CUDAExecutionProvider", {"device_id": "2"}), "CPUExecutionProvider"]


def _machine_has_cuda() -> bool:
    return onnx_providers.cuda_usable(0) is None


@pytest.mark.parametrize("pretend_driver", [False, True])
def test_real_probe_is_quiet(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                             pretend_driver: bool) -> None:
    """The probe answers without ORT's provider-load ERROR lines reaching stderr (fd level). With
    `pretend_driver` the driver check is skipped, so ORT really tries (and here fails) to load CUDA."""
    if pretend_driver:
        monkeypatch.setattr(onnx_providers, "_cuda_driver_present", lambda: True)
    onnx_providers.cuda_usable.cache_clear()
    try:
        answer = onnx_providers.cuda_usable(0)
    finally:
        onnx_providers.cuda_usable.cache_clear()
    out, err = capfd.readouterr()
    assert "onnxruntime" not in out + err and "Failed to load" not in out + err, out + err
    if answer is not None:
        assert isinstance(answer, str) and answer


def test_backend_without_gpu(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
                             capfd: pytest.CaptureFixture[str]) -> None:
    if _machine_has_cuda():
        pytest.skip("this machine has a usable CUDA GPU; bench/cuda_check.py covers it")
    from spekula.backends.onnx.backend import OnnxBackend

    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onnx-cache"))
    path = tiny_model_path("llama")
    with pytest.raises(ConfigError, match="CUDA is not usable"):
        OnnxBackend(path, BackendOptions(ort_provider="cuda"))
    # An explicit CUDA device is refused as the torch backend refuses it (it used to run on CPU,
    # announced by one info line only); the default device with `auto` runs on CPU.
    with pytest.raises(ConfigError, match="device 'cuda' requested but CUDA is not available to onnxruntime"):
        OnnxBackend(path, BackendOptions(device="cuda", ort_provider="auto"))
    be = OnnxBackend(path, BackendOptions(device="cpu", ort_provider="auto"))
    assert be.provider == ProviderChoice("cpu")
    assert "Failed to load" not in capfd.readouterr().err


def test_cuda_choice_that_does_not_attach_is_a_clear_error(tmp_path_factory: pytest.TempPathFactory,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's CUDA branch on a machine where ORT cannot load CUDA: the session would silently
    run on CPU with device-side KV buffers; the backend must refuse with a ConfigError instead."""
    if _machine_has_cuda():
        pytest.skip("this machine has a usable CUDA GPU")
    from spekula.backends.onnx import backend as onnx_backend

    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onnx-cache"))
    monkeypatch.setattr(onnx_backend, "select_provider", lambda options: ProviderChoice("cuda", 0))
    with pytest.raises(ConfigError, match="CUDA provider did not attach"):
        onnx_backend.OnnxBackend(tiny_model_path("llama"), BackendOptions())
