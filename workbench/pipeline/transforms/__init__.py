"""Transform families; importing this package registers every transform under its seed key."""

from . import cleanup, export  # noqa: F401
