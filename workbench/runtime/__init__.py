"""The runtime: batch description, paged KV cache, runners and ``generate``.

Dependency direction: ``sequence_info`` and ``kv_cache`` depend on torch only (the pipeline's cache
transforms use them too); the rest never imports ``workbench.pipeline``.
"""

from .generate import GenerationOutput, GenerationResult, GenerationStats, TokenEvent, generate  # noqa: F401
from .kv_cache import CacheSpec, KVCacheConfig, PageAllocator  # noqa: F401
from .runner import CachedRunner, Runner, UncachedRunner  # noqa: F401
from .runner_for import runner_for  # noqa: F401
from .sampling import SamplingParams  # noqa: F401
from .scheduler import Request, Scheduler, Step  # noqa: F401
from .sequence_info import SequenceInfo  # noqa: F401

__all__ = [
    "generate",
    "GenerationOutput",
    "GenerationResult",
    "GenerationStats",
    "TokenEvent",
    "CacheSpec",
    "KVCacheConfig",
    "PageAllocator",
    "CachedRunner",
    "Runner",
    "UncachedRunner",
    "runner_for",
    "SamplingParams",
    "Request",
    "Scheduler",
    "Step",
    "SequenceInfo",
]
