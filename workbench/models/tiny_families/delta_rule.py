"""Tiny random configs of the delta_rule families (merged into ``workbench.models.tiny.TINY_ARCHS``)."""

from __future__ import annotations

ARCHS: dict = {}
