"""GPU telemetry for the metrics stream: utilization, memory, power and temperature via NVML.

:class:`GpuTelemetry` samples one GPU through ``pynvml`` (the ``nvidia-ml-py`` package) in a named
daemon thread every ``interval_s`` seconds. A sample is a plain dict::

    {"time": 1712345678.9,          # time.time() when taken
     "device_index": 0,             # the CUDA device index (as torch numbers devices)
     "gpu_util_pct": 87.0, "mem_util_pct": 41.0,
     "mem_used_bytes": 1234567890, "mem_total_bytes": 85899345920,
     "power_w": 312.5, "temperature_c": 61.0}

Any field the GPU does not report (``NVMLError_NotSupported``, common on MIG slices and some
virtualised GPUs) is ``None``; other NVML errors also give ``None`` and are kept in ``last_error``.
Without pynvml, without the NVML library or without a GPU the object is a silent no-op:
``available`` is False, :meth:`GpuTelemetry.sample` returns None and no thread is started -- so
training code can create one unconditionally.

:class:`GpuMetrics` puts those samples into the training loop's metrics records: on a CUDA device it samples
in the background, and each record gets the mean of the samples taken since the previous record (or the
latest sample, when none was taken in between): ``gpu_util_pct``, ``gpu_mem_util_pct``,
``gpu_mem_used_bytes``, ``gpu_mem_total_bytes``, ``gpu_power_w``, ``gpu_temperature_c``, ``gpu_samples``.
On the CPU, with ``interval_s == 0``, or when NVML is unavailable, it is a silent no-op whose
:meth:`GpuMetrics.fields` is empty.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from wagma.checks import check_int, check_number, check_optional_int

__all__ = ["GpuMetrics", "GpuTelemetry", "Sample"]

Sample = dict[str, Any]


def _default_device_index() -> int:
    try:
        if torch.cuda.is_available():
            return torch.cuda.current_device()
    except Exception:  # noqa: BLE001 - a broken CUDA setup just means "device 0"
        pass
    return 0


def _nvml_handle(nvml: Any, cuda_index: int) -> Any:
    """NVML's handle for CUDA device ``cuda_index``, honouring ``CUDA_VISIBLE_DEVICES``.

    NVML numbers all GPUs of the machine, CUDA only the visible ones, in the order listed there
    (indices or full ``GPU-...`` UUIDs).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        nvml_index = cuda_index
    else:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if cuda_index >= len(entries):
            raise ValueError(
                f"GpuTelemetry: device_index {cuda_index} is not visible "
                f"(CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)} device(s))"
            )
        entry = entries[cuda_index]
        if not entry.isdigit():
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        nvml_index = int(entry)
    count = nvml.nvmlDeviceGetCount()
    if nvml_index >= count:
        raise ValueError(f"GpuTelemetry: NVML device {nvml_index} requested but the machine has {count}")
    return nvml.nvmlDeviceGetHandleByIndex(nvml_index)


class GpuTelemetry:
    """Periodic NVML sampling of one GPU in a background thread.

    Args:
        interval_s: seconds between samples of the background thread (> 0).
        device_index: CUDA device index to watch; ``None`` means torch's current device (0 when
            CUDA is unavailable).
        on_sample: optional callback called in the sampling thread with every periodic sample. If
            it raises, sampling stops and the error is re-raised by :meth:`drain` or :meth:`close`.
        max_buffered: periodic samples kept for :meth:`drain`; the oldest are dropped beyond it.

    Use as a context manager (``__enter__`` starts the thread, ``__exit__`` closes it) or call
    :meth:`start` and :meth:`close`. :meth:`sample` takes a reading on demand from any thread.
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        device_index: int | None = None,
        *,
        on_sample: Callable[[Sample], None] | None = None,
        max_buffered: int = 10_000,
    ) -> None:
        self.interval_s = check_number("GpuTelemetry: interval_s", interval_s, minimum=0, above=True)
        check_optional_int("GpuTelemetry: device_index", device_index, minimum=0)
        check_int("GpuTelemetry: max_buffered", max_buffered, minimum=1)
        self.device_index = _default_device_index() if device_index is None else device_index
        self.available = False
        self.unavailable_reason: str | None = None
        self.last_error: str | None = None
        self._on_sample = on_sample
        self._nvml: Any = None
        self._handle: Any = None
        self._lock = threading.Lock()
        self._latest: Sample | None = None
        self._buffer: collections.deque[Sample] = collections.deque(maxlen=max_buffered)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._init_nvml()

    def _init_nvml(self) -> None:
        try:
            import pynvml  # optional dependency
        except ImportError as exc:
            self.unavailable_reason = f"pynvml not importable: {exc}"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound without a driver, among others
            self.unavailable_reason = f"nvmlInit failed: {exc}"
            return
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                self.unavailable_reason = "NVML reports no GPU"
                pynvml.nvmlShutdown()
                return
            self._handle = _nvml_handle(pynvml, self.device_index)
        except pynvml.NVMLError as exc:
            self.unavailable_reason = f"NVML device lookup failed: {exc}"
            pynvml.nvmlShutdown()
            return
        except BaseException:
            pynvml.nvmlShutdown()  # a bad device_index is the caller's error: release NVML, re-raise
            raise
        self._nvml = pynvml
        self.available = True

    # ------------------------------------------------------------------------------------------
    def _field(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except self._nvml.NVMLError_NotSupported:
            return None
        except self._nvml.NVMLError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None

    def sample(self) -> Sample | None:
        """Read the GPU now and return the sample (``None`` when telemetry is unavailable)."""
        if not self.available or self._closed:
            return None
        nvml, h = self._nvml, self._handle
        util = self._field(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        mem = self._field(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        power_mw = self._field(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        temp = self._field(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        s: Sample = {
            "time": time.time(),
            "device_index": self.device_index,
            "gpu_util_pct": None if util is None else float(util.gpu),
            "mem_util_pct": None if util is None else float(util.memory),
            "mem_used_bytes": None if mem is None else int(mem.used),
            "mem_total_bytes": None if mem is None else int(mem.total),
            "power_w": None if power_mw is None else power_mw / 1000.0,  # NVML reports milliwatts
            "temperature_c": None if temp is None else float(temp),
        }
        with self._lock:
            self._latest = s
        return s

    def latest(self) -> Sample | None:
        """The most recent sample (periodic or on demand), or ``None`` if none was taken."""
        with self._lock:
            return None if self._latest is None else dict(self._latest)

    def drain(self) -> list[Sample]:
        """Return and forget the periodic samples taken since the last call, oldest first.

        Raises RuntimeError if the ``on_sample`` callback failed (sampling stopped then).
        """
        self._raise_thread_error()
        with self._lock:
            out = list(self._buffer)
            self._buffer.clear()
        return out

    # ------------------------------------------------------------------------------------------
    def start(self) -> GpuTelemetry:
        """Start the sampling thread; a no-op when unavailable or already started. Returns self."""
        if self._closed:
            raise RuntimeError("GpuTelemetry.start: this instance is closed; create a new one")
        if not self.available or self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name=f"wagma-gpu-telemetry-{self.device_index}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            try:
                s = self.sample()
                if s is not None:
                    with self._lock:
                        self._buffer.append(s)
                    if self._on_sample is not None:
                        self._on_sample(s)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller by drain/close
                self._error = exc
                return
            # Stay on the interval grid; when a sample overran, skip the missed ticks, don't burst.
            deadline += self.interval_s
            now = time.monotonic()
            if deadline < now:
                deadline += math.ceil((now - deadline) / self.interval_s) * self.interval_s
            self._stop.wait(deadline - now)

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"GpuTelemetry: the on_sample callback raised {type(exc).__name__}") from exc

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (joining it for at most ``timeout_s``) and release NVML. Idempotent.

        Raises TimeoutError if the thread did not stop in time, and RuntimeError if the ``on_sample``
        callback failed and :meth:`drain` has not reported it yet.
        """
        self._close(timeout_s, raise_errors=True)

    def _close(self, timeout_s: float, raise_errors: bool) -> None:
        if not self._closed:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout_s)
                if self._thread.is_alive():
                    # It may be inside an NVML call: leave NVML initialised rather than pull it away.
                    raise TimeoutError(f"GpuTelemetry.close: sampling thread still running after {timeout_s} s")
            self._closed = True
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError:
                    pass  # nothing useful to do with a failed shutdown at teardown
        if raise_errors:
            self._raise_thread_error()

    def __enter__(self) -> GpuTelemetry:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Do not mask an exception from the with-body with one from the sampling thread.
        self._close(5.0, raise_errors=exc_type is None)


_SKIP = ("time", "device_index")


class GpuMetrics:
    """Background GPU sampling for one rank's device, summarised per metrics record.

    Args:
        device: the rank's training device; anything but CUDA disables sampling.
        interval_s: seconds between samples; 0 disables sampling.
    """

    def __init__(self, device: torch.device, interval_s: float) -> None:
        self._telemetry: GpuTelemetry | None = None
        if device.type == "cuda" and interval_s > 0:
            index = device.index if device.index is not None else torch.cuda.current_device()
            telemetry = GpuTelemetry(interval_s, index)
            if telemetry.available:
                self._telemetry = telemetry.start()
            else:
                telemetry.close()

    @property
    def active(self) -> bool:
        """Whether GPU samples are being taken."""
        return self._telemetry is not None

    def fields(self) -> dict[str, Any]:
        """``gpu_*`` means of the samples since the last call (empty when inactive or nothing sampled)."""
        if self._telemetry is None:
            return {}
        samples: list[Sample] = self._telemetry.drain()
        if not samples:
            latest = self._telemetry.latest()
            samples = [latest] if latest is not None else []
        if not samples:
            return {}
        out: dict[str, Any] = {"gpu_samples": len(samples)}
        for key in samples[0]:
            if key in _SKIP:
                continue
            values = [s[key] for s in samples if s.get(key) is not None]
            name = key if key.startswith("gpu_") else f"gpu_{key}"
            out[name] = sum(values) / len(values) if values else None
        return out

    def close(self) -> None:
        """Stop sampling (idempotent)."""
        telemetry, self._telemetry = self._telemetry, None
        if telemetry is not None:
            telemetry.close()
