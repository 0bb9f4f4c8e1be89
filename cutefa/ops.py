"""TRANSITION ONLY: the user API moved to :mod:`cutefa.api` (validate, launch, dense, descales,
fp8, plans, attention). This module is a view of those modules for code that still names
``cutefa.ops``: reading an attribute reads it where it lives now, and replacing one (as tests do
with the kernel getter, the accepted device types or the plan table) replaces it in every
``cutefa.api`` module that holds that object, so the replacement takes effect. Deleted once
nothing imports ``cutefa.ops``.
"""

from __future__ import annotations

import sys
import types

from cutefa.api import attention, dense, descales, fp8, launch, plans, validate

_MODULES = (validate, launch, plans, dense, descales, fp8, attention)
# Old private names -> (module, name there).
_RENAMED = {
    "_choose": (launch, "choose"),
    "_aligned": (launch, "aligned"),
    "_launch": (dense, "_launch"),
    "_make_plan": (dense, "make_plan"),
    "_bind": (dense, "bind"),
    "_launch_fp8": (fp8, "_launch"),
    "_make_fp8_plan": (fp8, "make_plan"),
    "_fp8_kernel_args": (descales, "kernel_args"),
    "_block_choice": (descales, "block_choice"),
    "_plain_eager": (plans, "plain_eager"),
}
_MISSING = object()


def _home(name: str) -> tuple[types.ModuleType, str]:
    if name in _RENAMED:
        return _RENAMED[name]
    for module in _MODULES:
        if name in vars(module):
            return module, name
    raise AttributeError(f"module 'cutefa.ops' has no attribute {name!r} (the API moved to cutefa.api)")


# name -> its value before the first replacement through this view (what deleting it restores).
_REPLACED: dict[str, object] = {}


def _replace(name: str, value: object) -> object:
    """Bind ``value`` wherever the API binds the object ``name`` names now; returns that object."""
    module, there = _home(name)
    current = getattr(module, there)
    for m in _MODULES:
        if vars(m).get(there, _MISSING) is current:
            setattr(m, there, value)
    return current


class _View(types.ModuleType):
    """Holds none of the API's names itself: reads go to their modules, writes are replacements
    there, and deleting a replaced name (how ``monkeypatch`` undoes a replacement of a name that
    is not in this module's ``__dict__``) puts the original back."""

    def __getattr__(self, name: str) -> object:
        module, there = _home(name)
        return getattr(module, there)

    def __setattr__(self, name: str, value: object) -> None:
        if name in vars(self):
            super().__setattr__(name, value)
        else:
            _REPLACED.setdefault(name, _replace(name, value))

    def __delattr__(self, name: str) -> None:
        if name in vars(self):
            super().__delattr__(name)
        elif name in _REPLACED:
            _replace(name, _REPLACED.pop(name))
        else:
            _home(name)  # AttributeError for a name the API never had


sys.modules[__name__].__class__ = _View
