"""Model errors (a :class:`fedge.errors.FedgeError` branch).

Each subclass stays in the module of its model family (``digits.ModelError``,
``inspection.ModelExportError``, ``distill.ProxyError``, ...); this module holds only their
common base, so a caller can catch the whole package at once.
"""

from fedge.errors import FedgeError


class ModelsError(FedgeError):
    """A model cannot be built, loaded, distilled or exported; the message says which."""
