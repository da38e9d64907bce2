"""Offline RL and LLM preference optimisation as TorchRL losses and Lightning modules.

Importing this package does no plugin discovery and imports neither torch nor
lightning; use :func:`offline_plugins.plugins.load_registry` to see what is
installed.

>>> import offline_plugins
>>> offline_plugins.__version__
'0.1.0'
"""

from offline_plugins import _moved

__version__ = "0.1.0"

__all__ = ["__version__"]

_moved.install()  # the old paths of the modules that moved (offline_plugins._moved)
