"""What each node of a pipeline graph costs: FLOPs, bytes, roofline time, measured time.

- ``rules.node_cost(node, sizes)``: FLOPs and bytes of one node from its fake values at a phase.
- ``categories``: the op category of a node or profiler event (``category_of``, ``CATEGORIES``).
- ``layers``: the decoder layer of each node (``assign_layers``).
- ``sizes``: the decode-step / prefill shapes a graph is evaluated at (``DECODE``, ``PREFILL``).
- ``devices``: the H100 datasheet profile and this machine's measured one.
- ``table``: per-node frames, sums per category / layer, predicted vs measured tables.
- ``measure``: torch.profiler time per op category of a snapshot's graph on this machine.
- ``across``: predicted and measured time per decode step / prefill token after each transform.
"""

from .across import cost_across_pipeline
from .categories import CATEGORIES, category_of
from .devices import H100, DeviceProfile, device_profile, measure_this_cpu
from .layers import assign_layers
from .measure import measure_categories, step_function
from .rules import NodeCost, node_cost
from .sizes import DECODE, PREFILL, Phase, SizeBinding
from .table import by_category, by_layer, category_table, node_costs

__all__ = [
    "CATEGORIES",
    "DECODE",
    "PREFILL",
    "H100",
    "DeviceProfile",
    "NodeCost",
    "Phase",
    "SizeBinding",
    "assign_layers",
    "by_category",
    "by_layer",
    "category_of",
    "category_table",
    "cost_across_pipeline",
    "device_profile",
    "measure_categories",
    "measure_this_cpu",
    "node_cost",
    "node_costs",
    "step_function",
]
