"""GPU telemetry for inference-worker metrics: NVML readings when a GPU and ``nvidia-ml-py`` are present.

No topics of its own: the readings are merged into the worker's ``Metric`` values on ``clawstream.metrics``, its
``GET /metrics`` and, per completion, the response's ``engine_telemetry`` (:func:`engine_telemetry`: the readings
of the engine's own GPU), which the proxy copies onto the call event (``gpu_utilization``,
``gpu_memory_used_bytes``). ``nvidia-ml-py`` (import name ``pynvml``) is the optional ``gpu`` extra; without it,
or without a GPU/driver (``NVMLError``), :func:`gpu_readings` returns ``{}``, :func:`engine_telemetry` ``None``,
and nothing is logged beyond one debug line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
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


def gpu_uuids() -> list[str]:
    """NVML's UUID of each GPU, in NVML index order (``[]`` without NVML)."""
    nvml = _init()
    if not nvml:
        return []
    try:
        return [_text(nvml.nvmlDeviceGetUUID(handle)) for handle in _handles]
    except Exception as exc:  # NVMLError
        log.debug("NVML UUID query failed (%s)", exc)
        return []


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_index(device: str, visible_devices: str | None = None, uuids: Sequence[str] = ()) -> int | None:
    """NVML index of the GPU behind a torch device string (``cuda``, ``cuda:1``); ``None`` off CUDA or if unknown.

    torch numbers the GPUs that ``CUDA_VISIBLE_DEVICES`` (``visible_devices``) lists, NVML all of them: an integer
    entry is the NVML index itself, a UUID entry (``GPU-…``) is looked up in ``uuids`` (:func:`gpu_uuids`). A MIG
    slice matches no whole GPU and gives ``None``.
    """
    kind, _, number = device.partition(":")
    if kind != "cuda":
        return None
    index = int(number) if number.isdigit() else 0
    if visible_devices is None:
        return index
    entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
    if index >= len(entries):
        return None
    entry = entries[index]
    if entry.isdigit():
        return int(entry)
    matches = [i for i, uuid in enumerate(uuids) if uuid == entry or uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def engine_telemetry(readings: dict[str, float], index: int | None) -> dict[str, Any] | None:
    """The engine's GPU readings for a completion response: ``{"gpu_utilization": %, "gpu_memory_used_bytes": n}``
    of GPU ``index`` out of :func:`gpu_readings`; ``None`` when the engine has no GPU or it was not read."""
    if index is None:
        return None
    util, used = readings.get(f"gpu{index}_util_pct"), readings.get(f"gpu{index}_mem_used_bytes")
    if util is None or used is None:
        return None
    return {"gpu_utilization": float(util), "gpu_memory_used_bytes": int(used)}
