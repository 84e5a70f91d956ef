"""Where a node computes: the ``device`` run-config key (``auto``, ``cpu``, ``cuda``, ``cuda:N``).

Each node resolves the spec on its own machine, at discovery and in every handler (docs/devices.md).
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

__all__ = [
    "DEVICE_FORMS",
    "check_device_spec",
    "resolve_device",
    "DeviceUnavailableError",
    "cpu_environment",
]

#: Accepted forms of the ``device`` key (for error messages).
DEVICE_FORMS = ("auto", "cpu", "cuda", "cuda:<index>")

_CUDA_INDEX = re.compile(r"cuda:(\d+)")


class DeviceUnavailableError(RuntimeError):
    """The requested device does not exist on this machine (no CUDA, or an index beyond the GPU count)."""


def check_device_spec(spec: str) -> str:
    """The stripped ``spec``, its form checked without looking at the hardware.

    Raises:
        ValueError: any other text (the valid forms are listed).
    """
    text = str(spec).strip()
    if text in ("auto", "cpu", "cuda") or _CUDA_INDEX.fullmatch(text):
        return text
    raise ValueError(f"unknown device {spec!r}; valid forms: {', '.join(DEVICE_FORMS)}")


def resolve_device(spec: str) -> torch.device:
    """The ``torch.device`` a spec (:func:`check_device_spec`) names on *this* machine: ``auto`` is
    ``cuda`` (the current CUDA device) when ``torch.cuda.is_available()``, else ``cpu``.

    Raises:
        ValueError: a malformed spec.
        DeviceUnavailableError: ``cuda``/``cuda:N`` that torch does not see on this machine.
    """
    text = check_device_spec(spec)
    if text == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if text == "auto":
        return torch.device("cuda") if available else torch.device("cpu")
    if not available:
        raise DeviceUnavailableError(
            f"device={text!r}: this machine has no usable CUDA device (torch {torch.__version__}, built for "
            f"CUDA {torch.version.cuda or 'none'}; torch.cuda.is_available() is False); use device=auto or device=cpu "
            f"(under Flower's Ray simulation engine a ClientApp sees a GPU only with client-resources-num-gpus > 0)"
        )
    count = torch.cuda.device_count()
    m = _CUDA_INDEX.fullmatch(text)
    if m and int(m.group(1)) >= count:
        raise DeviceUnavailableError(
            f"device={text!r}: this machine has {count} visible CUDA device(s) "
            f"(indices 0..{count - 1}; CUDA_VISIBLE_DEVICES may hide others)"
        )
    return torch.device(text)


#: ``/proc/cpuinfo`` fields naming the CPU model, first found wins (x86, then ARM kernels' names).
_CPUINFO_FIELDS = ("model name", "Model", "Hardware", "Processor")


def cpu_environment(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """The CPU the run computed on (``results.json``'s ``environment``; docs/devices.md):
    ``{"cpu": model name, "machine": platform.machine(), "cpu_capability": torch's CPU kernel path
    (DEFAULT, AVX2, AVX512, ...), "torch": torch.__version__}``.

    Args:
        cpuinfo: the Linux CPU description file; without a model there, :func:`platform.processor`.
    """
    model = ""
    try:
        fields = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in Path(cpuinfo).read_text().splitlines())
        )
        model = next((fields[k] for k in _CPUINFO_FIELDS if fields.get(k)), "")
    except OSError:
        pass
    return {
        "cpu": model or platform.processor() or "unknown",
        "machine": platform.machine() or "unknown",
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "torch": torch.__version__,
    }
