"""Transform families; importing this package registers every transform under its seed key."""

from . import cleanup, export  # noqa: F401
from . import attention, hidden_states, layout, moe, norms, rope, swiglu  # noqa: F401
