"""GpuTelemetry against a fake pynvml: field decoding, unsupported fields, the no-GPU no-op, the thread."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from wagma.telemetry import GpuTelemetry


class _NVMLError(Exception):
    pass


class _NotSupported(_NVMLError):
    pass


class _LibraryNotFound(_NVMLError):
    pass


class _Unknown(_NVMLError):
    pass


def _fake_pynvml(count: int = 2, init_error: type[Exception] | None = None, **failing: type[Exception]):
    """A stand-in for the ``pynvml`` module; ``failing`` maps a function name to the error it raises."""
    fake = types.ModuleType("pynvml")
    fake.NVMLError = _NVMLError
    fake.NVMLError_NotSupported = _NotSupported
    fake.NVMLError_LibraryNotFound = _LibraryNotFound
    fake.NVML_TEMPERATURE_GPU = 0
    fake.calls = []
    fake.shutdowns = 0

    def init() -> None:
        if init_error is not None:
            raise init_error("no NVML here")

    def shutdown() -> None:
        fake.shutdowns += 1

    def reader(name, value):
        def read(*args):
            fake.calls.append((name, args))
            if name in failing:
                raise failing[name]("nope")
            return value

        return read

    fake.nvmlInit = init
    fake.nvmlShutdown = shutdown
    fake.nvmlDeviceGetCount = lambda: count
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    fake.nvmlDeviceGetHandleByUUID = lambda u: ("uuid", u)
    fake.nvmlDeviceGetUtilizationRates = reader("util", types.SimpleNamespace(gpu=87, memory=41))
    fake.nvmlDeviceGetMemoryInfo = reader("mem", types.SimpleNamespace(used=3 << 30, total=80 << 30, free=77 << 30))
    fake.nvmlDeviceGetPowerUsage = reader("power", 312_500)  # milliwatts
    fake.nvmlDeviceGetTemperature = reader("temp", 61)
    return fake


@pytest.fixture
def no_cvd(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _telemetry_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wagma-gpu-telemetry")]


def test_fields_are_read_and_converted(monkeypatch, no_cvd):
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    tel = GpuTelemetry(interval_s=1.0, device_index=1)
    assert tel.available
    s = tel.sample()
    assert s is not None
    assert {k: v for k, v in s.items() if k != "time"} == {
        "device_index": 1,
        "gpu_util_pct": 87.0,
        "mem_util_pct": 41.0,
        "mem_used_bytes": 3 << 30,
        "mem_total_bytes": 80 << 30,
        "power_w": 312.5,
        "temperature_c": 61.0,
    }
    assert abs(s["time"] - time.time()) < 5
    assert ("temp", (("handle", 1), 0)) in fake.calls  # the handle of the requested device is used
    assert tel.latest() == s
    assert tel.drain() == []  # on-demand samples are not part of the periodic stream
    tel.close()
    assert fake.shutdowns == 1
    tel.close()  # idempotent
    assert fake.shutdowns == 1


def test_unsupported_fields_become_none(monkeypatch, no_cvd):
    fake = _fake_pynvml(power=_NotSupported, temp=_NotSupported)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuTelemetry(interval_s=10.0, device_index=0) as tel:
        s = tel.sample()
    assert s["power_w"] is None and s["temperature_c"] is None
    assert s["gpu_util_pct"] == 87.0 and s["mem_total_bytes"] == 80 << 30
    assert tel.last_error is None  # "not supported" is normal, not an error


def test_other_nvml_errors_become_none_and_are_recorded(monkeypatch, no_cvd):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(util=_Unknown))
    tel = GpuTelemetry(device_index=0)
    s = tel.sample()
    assert s["gpu_util_pct"] is None and s["mem_util_pct"] is None and s["power_w"] == 312.5
    assert "_Unknown" in tel.last_error
    tel.close()


def _assert_noop(tel: GpuTelemetry) -> None:
    assert not tel.available
    assert tel.unavailable_reason
    assert tel.sample() is None and tel.latest() is None
    before = threading.active_count()
    assert tel.start() is tel
    assert threading.active_count() == before and not _telemetry_threads()
    assert tel.drain() == []
    tel.close()


def test_without_pynvml_it_is_a_noop(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes ``import pynvml`` raise ImportError
    _assert_noop(GpuTelemetry(interval_s=0.01))


def test_without_nvml_library_it_is_a_noop(monkeypatch):
    fake = _fake_pynvml(init_error=_LibraryNotFound)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    tel = GpuTelemetry(interval_s=0.01)
    _assert_noop(tel)
    assert "no NVML" in tel.unavailable_reason


def test_without_gpus_it_is_a_noop_and_releases_nvml(monkeypatch):
    fake = _fake_pynvml(count=0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    _assert_noop(GpuTelemetry(interval_s=0.01))
    assert fake.shutdowns == 1


def test_real_pynvml_on_this_machine_does_not_fail():
    pytest.importorskip("pynvml")
    with GpuTelemetry(interval_s=0.05) as tel:  # a no-op here without a GPU, a real sampler with one
        s = tel.sample()
    assert (s is None) == (not tel.available)


def test_thread_samples_at_the_interval_and_stops_on_close(monkeypatch, no_cvd):
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    seen: list[dict] = []
    tel = GpuTelemetry(interval_s=0.05, device_index=0, on_sample=seen.append).start()
    threads = _telemetry_threads()
    assert len(threads) == 1 and threads[0].daemon and threads[0].name == "wagma-gpu-telemetry-0"
    time.sleep(0.5)
    tel.close()
    assert not threads[0].is_alive()
    samples = tel.drain()
    # ~10 expected; wide bounds because the CI machine is shared and may stall the thread
    assert 3 <= len(samples) <= 14
    assert samples == seen
    gaps = [b["time"] - a["time"] for a, b in zip(samples, samples[1:])]
    assert min(gaps) > 0.02  # paced by the interval, not a busy loop
    assert fake.shutdowns == 1
    n_calls = len(fake.calls)
    time.sleep(0.15)
    assert len(fake.calls) == n_calls and tel.drain() == []  # nothing samples after close
    with pytest.raises(RuntimeError, match="closed"):
        tel.start()


def test_callback_error_is_handed_back(monkeypatch, no_cvd):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())

    def boom(sample: dict) -> None:
        raise KeyError("metrics sink is gone")

    tel = GpuTelemetry(interval_s=0.01, device_index=0, on_sample=boom).start()
    deadline = time.monotonic() + 5
    while tel._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tel._thread.is_alive()  # sampling stopped at the error
    with pytest.raises(RuntimeError, match="on_sample") as info:
        tel.close()
    assert isinstance(info.value.__cause__, KeyError)
    tel.close()  # reported once


def test_cuda_visible_devices_maps_to_nvml_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(count=4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    tel = GpuTelemetry(device_index=1)
    assert tel._handle == ("handle", 1)
    tel.close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0f1e2d3c-aaaa-bbbb-cccc-000000000000")
    tel = GpuTelemetry(device_index=0)
    assert tel._handle == ("uuid", "GPU-0f1e2d3c-aaaa-bbbb-cccc-000000000000")
    tel.close()
    with pytest.raises(ValueError, match="not visible"):
        GpuTelemetry(device_index=2)


def test_bad_arguments_raise_value_error(monkeypatch, no_cvd):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(count=2))
    with pytest.raises(ValueError, match="^GpuTelemetry: interval_s: expected a finite number > 0, found 0$"):
        GpuTelemetry(interval_s=0)
    with pytest.raises(ValueError, match="^GpuTelemetry: device_index: expected None or an integer >= 0, found -1$"):
        GpuTelemetry(device_index=-1)
    with pytest.raises(ValueError, match="machine has 2"):
        GpuTelemetry(device_index=5)
