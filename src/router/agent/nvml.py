"""GPU figures through NVML (`pynvml`, from the `nvidia-ml-py` package), or why there are none.

Each figure is read on its own; one the device or driver does not support stays None. Without
the library, a driver or a GPU, the reading says so in `error` and has no GPUs: the agent reports
GPU figures as missing, never as zero.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class GpuStats:
    index: int
    name: str | None = None
    mem_used: int | None = None  # bytes
    mem_total: int | None = None
    util: float | None = None  # share of time a kernel ran, 0..1
    temperature_c: float | None = None
    throttle_reasons: int | None = None  # NVML's clock event reason bits
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors


@dataclass(frozen=True)
class NvmlReading:
    gpus: list[GpuStats] = field(default_factory=list)
    error: str | None = None


class NvmlReader:
    """Initialises NVML once; `read()` each interval; `close()` at the end."""

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._nvml: Any = None
        self.error: str | None = None
        try:
            nvml = module if module is not None else importlib.import_module("pynvml")
        except ImportError:
            self.error = "pynvml (nvidia-ml-py) is not installed"
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # pynvml raises NVMLError subclasses, e.g. library or driver not found
            self.error = f"NVML is unavailable: {exc}"
            return
        self._nvml = nvml

    def read(self) -> NvmlReading:
        nvml = self._nvml
        if nvml is None:
            return NvmlReading([], self.error)
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            return NvmlReading([], f"NVML could not count devices: {exc}")
        gpus = []
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except Exception:
                gpus.append(GpuStats(i))
                continue

            def get(fn: str, *args: Any, handle: Any = handle) -> Any:
                try:
                    return getattr(nvml, fn)(handle, *args)
                except Exception:  # not supported by this device or driver: missing
                    return None

            memory = get("nvmlDeviceGetMemoryInfo")
            rates = get("nvmlDeviceGetUtilizationRates")
            name = get("nvmlDeviceGetName")
            reasons = get("nvmlDeviceGetCurrentClocksEventReasons")
            if reasons is None:
                reasons = get("nvmlDeviceGetCurrentClocksThrottleReasons")
            temperature = get("nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
            ecc = get(
                "nvmlDeviceGetTotalEccErrors",
                getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                getattr(nvml, "NVML_VOLATILE_ECC", 0),
            )
            gpus.append(
                GpuStats(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else name,
                    mem_used=int(memory.used) if memory is not None else None,
                    mem_total=int(memory.total) if memory is not None else None,
                    util=float(rates.gpu) / 100 if rates is not None else None,
                    temperature_c=float(temperature) if temperature is not None else None,
                    throttle_reasons=int(reasons) if reasons is not None else None,
                    ecc_uncorrected=int(ecc) if ecc is not None else None,
                )
            )
        return NvmlReading(gpus, None)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            finally:
                self._nvml = None
