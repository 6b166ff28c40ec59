"""GPU telemetry for inference-worker metrics: NVML readings when a GPU and ``nvidia-ml-py`` are present.

No topics of its own: the readings are merged into the worker's ``Metric`` values on ``clawstream.metrics``.
``nvidia-ml-py`` (import name ``pynvml``) is the optional ``gpu`` extra; without it, or without a GPU/driver
(``NVMLError``), :func:`gpu_readings` returns ``{}`` and nothing is logged beyond one debug line.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_nvml: Any = None  # the pynvml module once initialised; False when unavailable
_handles: list[Any] = []


def _init() -> Any:
    global _nvml
    with _lock:
        if _nvml is None:
            try:
                import pynvml  # type: ignore[import-not-found]

                pynvml.nvmlInit()
                _handles.extend(pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount()))
                _nvml = pynvml
            except ImportError:
                log.debug("nvidia-ml-py is not installed: no GPU telemetry")
                _nvml = False
            except Exception as exc:  # pynvml.NVMLError (no driver, no GPU); its class needs the import
                log.debug("NVML unavailable (%s): no GPU telemetry", exc)
                _nvml = False
        return _nvml


def gpu_readings() -> dict[str, float]:
    """``gpu{i}_mem_used_bytes``, ``gpu{i}_mem_total_bytes``, ``gpu{i}_util_pct`` per GPU; ``{}`` without NVML."""
    nvml = _init()
    if not nvml:
        return {}
    values: dict[str, float] = {}
    try:
        for i, handle in enumerate(_handles):
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            values[f"gpu{i}_mem_used_bytes"] = float(mem.used)
            values[f"gpu{i}_mem_total_bytes"] = float(mem.total)
            values[f"gpu{i}_util_pct"] = float(util.gpu)
    except Exception as exc:  # an NVMLError mid-run (GPU lost): omit, as when absent
        log.debug("NVML reading failed (%s)", exc)
        return {}
    return values
