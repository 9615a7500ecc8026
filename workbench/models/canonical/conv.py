"""Canonical forwards for the short causal conv families (see the package docstring)."""

from __future__ import annotations

PATCHES: tuple = ()
