"""Analyses of pipeline graphs that the pipeline itself never needs (costs, ...).

Reads snapshots and graphs; ``workbench.pipeline``, ``workbench.ops`` and ``workbench.runtime`` never
import it, ``workbench.viz`` and ``workbench.api`` may.
"""
