"""Canonical forwards for the mla family (see the package docstring)."""

from __future__ import annotations

PATCHES: tuple = ()
