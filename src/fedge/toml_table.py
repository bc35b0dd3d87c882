"""Reading a TOML document field by field, with errors that name the field.

Used by every hand-written config format (scenarios, job manifests). Unknown keys are
rejected when a table is opened, so a typo (``trainig``) is reported as the typo rather
than as the missing ``training`` it causes; ``allowed=None`` accepts any key. Errors are
raised as the caller's own error class, so each format keeps its place in the tree.
"""

import math
from collections.abc import Mapping

from fedge.errors import FedgeError


class TomlTable:
    def __init__(
        self,
        data: Mapping[str, object],
        path: str,
        allowed: frozenset[str] | None,
        *,
        error: type[FedgeError],
    ) -> None:
        self._data = data
        self._path = path
        self._error = error
        if allowed is not None:
            unknown = sorted(set(data) - allowed)
            if unknown:
                known = ", ".join(sorted(allowed))
                raise error(f"unknown field '{self._name(unknown[0])}' (known: {known})")

    def _name(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def names(self) -> list[str]:
        return list(self._data)

    def items(self) -> list[tuple[str, object]]:
        return list(self._data.items())

    def _get(self, key: str) -> object:
        if key not in self._data:
            raise self._error(f"missing field {self._name(key)}")
        return self._data[key]

    def text(self, key: str, default: str | None = None, *, non_empty: bool = False) -> str:
        if default is not None and key not in self._data:
            return default
        value = self._get(key)
        if not isinstance(value, str) or (non_empty and not value):
            kind = "a non-empty string" if non_empty else "a string"
            raise self._error(f"{self._name(key)} must be {kind}, got {value!r}")
        return value

    def integer(self, key: str, *, minimum: int | None = None, default: int | None = None) -> int:
        if default is not None and key not in self._data:
            return default
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._error(f"{self._name(key)} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self._error(f"{self._name(key)} must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        if default is not None and key not in self._data:
            return default
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._error(f"{self._name(key)} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise self._error(f"{self._name(key)} must be finite, got {value!r}")
        return float(value)

    def optional_number(self, key: str) -> float | None:
        return self.number(key) if key in self._data else None

    def table(self, key: str, allowed: frozenset[str] | None) -> "TomlTable":
        value = self._get(key)
        if not isinstance(value, dict):
            raise self._error(f"{self._name(key)} must be a table ([{self._name(key)}])")
        return TomlTable(value, self._name(key), allowed, error=self._error)

    def optional_table(self, key: str, allowed: frozenset[str] | None) -> "TomlTable | None":
        return self.table(key, allowed) if key in self._data else None

    def tables(self, key: str, allowed: frozenset[str]) -> list["TomlTable"]:
        """An optional array of tables (``[[fleet.groups]]``); absent means empty."""
        value = self._data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self._error(
                f"{self._name(key)} must be an array of tables ([[{self._name(key)}]])"
            )
        return [
            TomlTable(item, f"{self._name(key)}[{index}]", allowed, error=self._error)
            for index, item in enumerate(value)
        ]
