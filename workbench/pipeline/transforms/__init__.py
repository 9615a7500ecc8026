"""Transform families; importing this package registers every transform under its seed key."""

from . import cleanup, export  # noqa: F401
from . import attention, hidden_states, layout, moe, norms, rope, swiglu  # noqa: F401
from . import weight_load  # noqa: F401  (weight_load: bind the meta-traced graph to the weights)
from . import cached_attention, cached_residual_add, gather_logits, hf_cached_attention, kvcache  # noqa: F401
from . import fusion, multi_stream  # noqa: F401  (post_load_fusion backends; compile-stage streams)
from . import linear_layout  # noqa: F401  (CPU GEMV weight layout)
from . import compile_model  # noqa: F401  (compile stage: the runner generate uses)
