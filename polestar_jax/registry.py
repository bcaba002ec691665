"""Named registries: how model families and decoding policies are added without writing into a dict.

A :class:`Registry` maps a name to an item. :meth:`Registry.register` refuses a name that is taken (so two
modules cannot silently replace each other's entry), and a lookup of an unknown name is a one-line
:class:`~polestar_jax.errors.ConfigError` that lists what is registered. The families live in
:data:`polestar_jax.models.family.FAMILIES`, the policies in :data:`polestar_jax.decode.policy.POLICIES`.
"""
from __future__ import annotations

import importlib
from typing import Generic, Iterator, TypeVar

from polestar_jax.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> item, filled by :meth:`register`; read with ``registry[name]``, ``name in registry``, iteration
    (the names, in registration order) and :meth:`items`. ``kind`` names the items in errors
    (``"model family"``, ``"decoder"``)."""

    def __init__(self, kind: str, builtins: tuple[str, ...] = ()):
        self.kind = kind
        self._items: dict[str, T] = {}
        #: modules that register the built-in items, imported on the first lookup (so a lookup never depends
        #: on which modules the caller happened to import, and the registry's module imports none of them)
        self._builtins = builtins

    def _load(self) -> None:
        if self._builtins:
            names, self._builtins = self._builtins, ()
            for name in names:
                importlib.import_module(name)

    def register(self, name: str, item: T) -> T:
        """Adds ``item`` under ``name`` and returns it; a :class:`ValueError` if ``name`` is registered."""
        self._load()
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} is registered under a non-empty name, not {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> T:
        """Removes ``name`` (a test's temporary entry) and returns its item; a KeyError if it is not there."""
        return self._items.pop(name)

    def __getitem__(self, name: str) -> T:
        self._load()
        if name not in self._items:
            raise ConfigError(f"unknown {self.kind} {name!r} (registered: {', '.join(self._items) or 'none'})")
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(list(self._items))

    def __len__(self) -> int:
        self._load()
        return len(self._items)

    def items(self) -> list[tuple[str, T]]:
        self._load()
        return list(self._items.items())
