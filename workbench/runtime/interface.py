"""The runtime as the pipeline sees it: the one module of ``workbench.runtime`` that
``workbench.pipeline`` imports (``tests/test_architecture.py`` checks that).

The pipeline describes graphs and the caches they need; the runtime allocates the caches, feeds
the steps and builds the runners. What crosses the seam:

* descriptions the cache-stage transforms produce: ``CacheSpec`` (one cache tensor a graph input
  reads), ``KVCacheConfig`` (the pool's geometry and the ``RuntimeLimits`` it serves: one holder
  of each limit, made by the stepper and read by every stage), ``add_specs``;
* the names of a cached graph's step inputs (``TOKEN_INPUTS``, ``METADATA_INPUTS``,
  ``LAST_TOKEN_INPUT``, ``SLOT_INPUT``, ``INPUT_KEY``) and ``module_input_names`` / ``is_cached_module``;
* what the cache stage asks the runtime to do: ``allocate_caches``, ``prefill_forward`` (a measured
  forward), ``CachedProbe`` (the numerics probe of a cached graph), and what a runner's step buffers
  cost (``step_buffer_bytes``: checked against free memory with the pool before allocating);
* the compile backends (``COMPILE_BACKENDS``: ``unavailable_reason``, ``build``) that
  ``compile_model`` looks up by name.
"""

from .backends import COMPILE_BACKENDS, BuildRequest, Built, CompileBackend
from .kv_cache import PAGED, PER_TOKEN, SLOT, CacheSpec, KVCacheConfig, add_specs, allocate_caches
from .limits import RuntimeLimits
from .probe import CachedProbe, prefill_forward, run_cached
from .sequence_info import (
    INPUT_KEY,
    LAST_TOKEN_INPUT,
    METADATA_INPUTS,
    SLOT_INPUT,
    TOKEN_INPUTS,
    is_cached_module,
    module_input_names,
    step_buffer_bytes,
)

__all__ = [
    "COMPILE_BACKENDS",
    "BuildRequest",
    "Built",
    "CompileBackend",
    "PAGED",
    "PER_TOKEN",
    "SLOT",
    "SLOT_INPUT",
    "CacheSpec",
    "KVCacheConfig",
    "RuntimeLimits",
    "add_specs",
    "allocate_caches",
    "step_buffer_bytes",
    "CachedProbe",
    "prefill_forward",
    "run_cached",
    "INPUT_KEY",
    "LAST_TOKEN_INPUT",
    "METADATA_INPUTS",
    "TOKEN_INPUTS",
    "is_cached_module",
    "module_input_names",
]
