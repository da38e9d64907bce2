"""Package attributes imported on first use, so importing a package stays cheap (no torch).

>>> import types
>>> pkg = types.ModuleType("pkg")
>>> getattr_, dir_ = lazy_exports(pkg.__dict__, {"sqrt": "math", "dumps": "json"})
>>> getattr_("sqrt")(4.0), "dumps" in dir_()
(2.0, True)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(namespace: dict, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """A module's ``__getattr__`` and ``__dir__`` for ``exports`` (name -> the module defining it).

    A module path starting with ``.`` is relative to the package (``namespace["__name__"]``).
    The first lookup caches the value in ``namespace``, so later ones skip ``__getattr__``.
    ``namespace["__lazy_exports__"]`` keeps the map with absolute module paths (what importing a name
    imports: ``tests/test_import_rule.py`` reads it).
    """
    package = namespace.get("__name__", "")
    namespace["__lazy_exports__"] = {name: f"{package}{module}" if module.startswith(".") else module
                                     for name, module in exports.items()}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = f"{package}{module}" if module.startswith(".") else module
        value = getattr(importlib.import_module(target), name)
        namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
