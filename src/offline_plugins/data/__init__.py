"""Offline datasets: Minari recipes made locally, and any Minari dataset as TorchRL replay buffers.

``load_offline_data`` and ``OfflineData`` are imported on first use, so importing
this package (and listing recipes) loads no torch.
"""

from __future__ import annotations

from offline_plugins._lazy import lazy_exports

__all__ = ["load_offline_data", "OfflineData", "DataStatistics", "DatasetError", "make_dataset"]

_LAZY = {
    "load_offline_data": "offline_plugins.data.offline",
    "OfflineData": "offline_plugins.data.offline",
    "DataStatistics": "offline_plugins.data.offline",
    "DatasetError": "offline_plugins.data.errors",
    "make_dataset": "offline_plugins.data.store",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
