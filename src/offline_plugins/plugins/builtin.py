"""The plugins shipped inside offline-plugins, registered explicitly by the host.

Each entry maps a plugin name (what ``OFFLINE_PLUGINS_DISABLE`` takes) to the module
that holds its ``@hookimpl`` functions. These modules must import no torch at module
level, so that listing algorithms stays fast.
"""

from __future__ import annotations

BUILTIN_PLUGINS: dict[str, str] = {
}
