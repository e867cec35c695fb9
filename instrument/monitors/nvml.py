"""Which NVML devices the process sees, in its own order (`SystemMonitor`'s GPU keys use the process's numbering)."""

from typing import Any, List, Optional

__all__ = ["visible_nvml_handles"]


def visible_nvml_handles(nvml: Any, visible: Optional[str]) -> List[Any]:
    """NVML handles of the devices the process sees, in its own order (``cuda:0`` first), as the CUDA runtime
    reads ``CUDA_VISIBLE_DEVICES``: entries are indices or (prefixes of) UUIDs, ``GPU-...`` or ``MIG-...``, and
    the list ends at the first entry that names no device, or one already named. Unset: every device, in NVML's
    order (PCI bus order, which is CUDA's for identical devices or with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)."""
    count = nvml.nvmlDeviceGetCount()
    if visible is None:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids: Optional[List[str]] = None
    chosen: List[Any] = []
    seen: set = set()
    for entry in (part.strip() for part in visible.split(",")):
        key: Any = None
        if entry.isdigit():  # an index among the physical devices
            key = int(entry) if int(entry) < count else None
        elif entry.startswith("GPU-"):  # a whole UUID, or a unique prefix of one
            if uuids is None:
                uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            key = matches[0] if len(matches) == 1 else None
        elif entry.startswith("MIG-"):  # a MIG instance: NVML finds it by its whole UUID
            key = entry
        if key is None or key in seen:
            break
        try:
            chosen.append(nvml.nvmlDeviceGetHandleByIndex(key) if isinstance(key, int)
                          else nvml.nvmlDeviceGetHandleByUUID(key))
        except Exception:  # an unknown MIG UUID: as the CUDA runtime, the list ends here
            break
        seen.add(key)
    return chosen


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
