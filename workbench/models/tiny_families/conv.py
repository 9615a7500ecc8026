"""Tiny random configs of the short causal conv families (merged into ``workbench.models.tiny.TINY_ARCHS``)."""

from __future__ import annotations

ARCHS: dict = {}
