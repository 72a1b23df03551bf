"""GPU telemetry in the metrics stream: :class:`GpuMetrics` turns :class:`~wagma.telemetry.GpuTelemetry`
samples into ``gpu_*`` fields of the training loop's JSON-lines records.

On a CUDA device it samples in the background every ``interval_s`` seconds, and each metrics record gets
the mean of the samples taken since the previous record (or the latest sample, when none was taken in
between): ``gpu_util_pct``, ``gpu_mem_util_pct``, ``gpu_mem_used_bytes``, ``gpu_mem_total_bytes``,
``gpu_power_w``, ``gpu_temperature_c``, ``gpu_samples``. On the CPU, with ``interval_s == 0``, or when
NVML is unavailable, it is a silent no-op whose :meth:`GpuMetrics.fields` is empty.
"""

from __future__ import annotations

from typing import Any

import torch

from wagma.telemetry import GpuTelemetry, Sample

__all__ = ["GpuMetrics"]

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
