"""Canonical forwards for the mrope family (see the package docstring)."""

from __future__ import annotations

PATCHES: tuple = ()
