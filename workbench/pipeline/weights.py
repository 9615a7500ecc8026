"""Weights apart from the graph: traced on ``meta``, bound to real tensors at ``weight_load``.

``export_to_gm`` traces a weightless twin of the model on the ``meta`` device, so nothing about the
graph depends on where the weights will live (nor costs a copy of them). Until ``load_weights``
runs, every parameter and buffer of the graph module is a meta tensor and every factory call in
the graph (``arange``, ``full``, ``_to_copy``...) names ``device=meta``. Binding a graph to real
tensors therefore means three things, which this module does in one place for both users:

* ``load_weights`` (stage ``weight_load``) binds the live graph for good: each meta tensor is
  replaced by the real one of the same name from the ``WeightSource`` (moved to the pipeline device
  when it lives elsewhere), device arguments in nodes are retargeted, and the fake values
  move to the device so shape propagation sees one device.
* the numerics probe (and ``PipelineStepper.forward``) runs graphs from before ``weight_load`` with
  ``run_unloaded``: a plain node loop (what ``fx.Interpreter`` does, cheaper) that serves ``get_attr``
  from the source and rewrites ``device=meta`` on the fly, without touching the graph.

Weights a transform derives before ``weight_load`` (e.g. per-expert views of a stacked MoE tensor)
are recorded with ``record_weight_view`` and rebuilt from their base when the base is bound.

Tensors the model makes inside ``forward`` from Python data (``torch.tensor([...], device=x.device)``,
an index list such as Falcon's ``fused_qkv[..., [-2], :]``) are constants to ``torch.export``, which
lifts them into the graph as attributes; made on ``meta`` they hold no values. ``export_to_gm``
recovers their values (a trace on CPU, see ``export/forward_constants.py``) and records them with
``record_forward_constant``; they are bound here like weights (the attribute stays ``meta`` until
``load_weights``, so the unloaded graph is uniformly weightless).

Quantized checkpoints: the eager model is the *dequantized* twin, and the source also carries the
checkpoint's raw tensors by their checkpoint names (``WeightSource.checkpoint``). A quantize
transform that gives the graph a tensor the eager model does not hold (an fp8 ``weight``, its
``weight_scale``, experts stacked from per-expert checkpoint tensors, AWQ codes repacked for our
op) declares where it comes from with ``record_tensor_binding``: named inputs from the checkpoint
or the eager model, and the conversion applied at load -- visible in ``gm.meta``, no load hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .graph.utils import size_expr, symbolic_fake_mode
from .graph.weights import fetch_attr

WEIGHT_VIEWS_KEY = "weight_views"  # gm.meta: target -> (base target, index into the base)
TENSOR_BINDINGS_KEY = "tensor_bindings"  # gm.meta: target -> TensorBinding
TRACE_DEVICE_KEY = "trace_device"  # gm.meta: the device export traced on ("meta" or the model's)
FORWARD_CONSTANTS_KEY = "forward_constants"  # gm.meta: target -> real (CPU) value of a tensor made in forward


class WeightSource(Mapping):
    """The real tensors of the eager model, by the names the exported graph uses.

    ``module`` is the module that was exported (``CausalLMLogits(model)``), so its parameter and
    buffer names are exactly the graph module's attribute targets. Tied names map to one tensor.
    Nothing is copied: this is a name index over the eager model's own tensors.

    ``checkpoint``: a quantized checkpoint's raw tensors by checkpoint name (None for other
    models); only ``record_tensor_binding`` entries read them.
    """

    def __init__(self, module: Optional[torch.nn.Module], checkpoint: Optional[Mapping] = None):
        self._tensors: Dict[str, torch.Tensor] = (
            {}
            if module is None
            else {
                **dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False)),
            }
        )
        self.checkpoint = checkpoint

    def with_checkpoint(self, checkpoint: Optional[Mapping]) -> "WeightSource":
        """The same eager tensors with ``checkpoint``'s raw tensors beside them (no copy)."""
        out = WeightSource(None, checkpoint)
        out._tensors = self._tensors
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        extra = f", checkpoint: {len(self.checkpoint)} tensors" if self.checkpoint is not None else ""
        return f"WeightSource({len(self)} tensors{extra})"


def with_checkpoint(source: Optional[Mapping], checkpoint: Optional[Mapping]) -> Optional[Mapping]:
    """``source`` (a ``WeightSource`` or a plain mapping) with ``checkpoint`` beside it."""
    if source is None or checkpoint is None or getattr(source, "checkpoint", None) is checkpoint:
        return source
    if isinstance(source, WeightSource):
        return source.with_checkpoint(checkpoint)
    out = WeightSource(None, checkpoint)
    out._tensors = dict(source)
    return out


@dataclass(frozen=True)
class TensorBinding:
    """Where ``load_weights`` gets a graph tensor the eager model does not hold as it is.

    ``inputs`` are tensor names in ``namespace``: ``"checkpoint"`` (the quantized checkpoint's raw
    tensors, by checkpoint name) or ``"model"`` (the eager model's, by graph name). ``convert``
    (a module-level function, named in renders and reports) makes the tensor from them, with the
    static ``kwargs``; None takes the single input as it is. ``output`` picks one element when
    ``convert`` returns a tuple (several graph tensors from one conversion run it once per load).
    """

    inputs: Tuple[str, ...]
    namespace: str = "checkpoint"
    convert: Optional[Callable[..., torch.Tensor]] = None
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    output: Optional[int] = None

    def __post_init__(self):
        if self.namespace not in ("checkpoint", "model"):
            raise ValueError(f"TensorBinding.namespace must be 'checkpoint' or 'model', got {self.namespace!r}")
        if self.convert is None and len(self.inputs) != 1:
            raise ValueError(f"a TensorBinding without convert takes exactly one input, got {self.inputs}")

    def describe(self) -> str:
        args = ", ".join([*self.inputs, *(f"{k}={v!r}" for k, v in self.kwargs)])
        call = f"{self.convert.__name__}({args})" if self.convert is not None else args
        pick = f"[{self.output}]" if self.output is not None else ""
        return f"{self.namespace}: {call}{pick}"


def record_tensor_binding(gm: fx.GraphModule, target: str, binding: TensorBinding) -> None:
    """Declare that attribute ``target`` is made at load as ``binding`` says (takes precedence over
    an eager tensor of the same name: e.g. ``q_proj.weight`` fp8 from the checkpoint, not the
    dequantized twin's fp32). A new dict each time: snapshots share the old one."""
    gm.meta[TENSOR_BINDINGS_KEY] = {**gm.meta.get(TENSOR_BINDINGS_KEY, {}), target: binding}


def tensor_bindings(gm: fx.GraphModule) -> Dict[str, TensorBinding]:
    return dict(gm.meta.get(TENSOR_BINDINGS_KEY, {}))


def record_weight_view(gm: fx.GraphModule, target: str, base: str, index: Tuple[Any, ...]) -> None:
    """Note that attribute ``target`` is ``base[index]`` (ints and slices), so that binding ``base``
    to its real tensor rebuilds ``target`` as a view of it."""
    gm.meta.setdefault(WEIGHT_VIEWS_KEY, {})[target] = (base, tuple(index))


def record_forward_constant(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Note that attribute ``target`` (a ``meta`` tensor export lifted from the model's forward) has
    the real value ``value``: ``load_weights`` binds it, the unloaded probe reads it. A new dict each
    time: snapshots share the old one."""
    gm.meta[FORWARD_CONSTANTS_KEY] = {**gm.meta.get(FORWARD_CONSTANTS_KEY, {}), target: value}


def forward_constants(gm: fx.GraphModule) -> Dict[str, torch.Tensor]:
    return dict(gm.meta.get(FORWARD_CONSTANTS_KEY, {}))


def tensor_attributes(gm: fx.GraphModule) -> Dict[str, torch.Tensor]:
    """Every tensor the graph module holds: parameters, buffers (tied names included) and plain
    tensor attributes that ``get_attr`` nodes read (constants export lifted)."""
    out: Dict[str, torch.Tensor] = {
        **dict(gm.named_parameters(remove_duplicate=False)),
        **dict(gm.named_buffers(remove_duplicate=False)),
    }
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in out:
            value = fetch_attr(gm, node.target)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return out


def unloaded_targets(mod: torch.nn.Module) -> List[str]:
    """Names of the meta tensors a graph module still holds (empty once ``load_weights`` ran)."""
    if not isinstance(mod, fx.GraphModule):
        return []
    return [name for name, t in tensor_attributes(mod).items() if t.is_meta]


class WeightResolver:
    """Real tensor for a graph attribute name: made as a recorded binding says, taken from the
    source, rebuilt as a recorded view, or the recorded value of a tensor made in forward."""

    def __init__(self, gm: fx.GraphModule, source: Optional[Mapping]):
        self.source = source if source is not None else {}
        self.views: Dict[str, Tuple[str, tuple]] = dict(gm.meta.get(WEIGHT_VIEWS_KEY, {}))
        self.bindings: Dict[str, TensorBinding] = tensor_bindings(gm)
        self.constants: Dict[str, torch.Tensor] = forward_constants(gm)
        self._memo: Dict[str, torch.Tensor] = {}
        self._converted: Dict[tuple, Any] = {}  # one conversion run per load, however many outputs

    def _input(self, namespace: str, name: str) -> torch.Tensor:
        if namespace == "model":
            return self.source[name]
        checkpoint = getattr(self.source, "checkpoint", None)
        if checkpoint is None:
            raise KeyError(f"{name} (a quantized checkpoint tensor, and this weight source has no checkpoint)")
        return checkpoint[name]

    def _bound(self, binding: TensorBinding) -> torch.Tensor:
        key = (binding.convert, binding.namespace, binding.inputs, binding.kwargs)
        if key not in self._converted:
            tensors = [self._input(binding.namespace, n) for n in binding.inputs]
            with torch.no_grad():
                self._converted[key] = (
                    binding.convert(*tensors, **dict(binding.kwargs)) if binding.convert is not None else tensors[0]
                )
        out = self._converted[key]
        return out[binding.output] if binding.output is not None else out

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._memo:
            return self._memo[name]
        if name in self.bindings:
            value = self._bound(self.bindings[name])
        elif name in self.source:
            value = self.source[name]
        elif name in self.views:
            base, index = self.views[name]
            value = self(base)[index]
        elif name in self.constants:
            value = self.constants[name]
        else:
            raise KeyError(name)
        self._memo[name] = value
        return value

    def missing(self, names) -> List[str]:
        out = []
        for name in names:
            try:
                self(name)
            except KeyError:
                out.append(name)
        return out


def _retarget(value: Any, old: str, new: torch.device) -> Any:
    if isinstance(value, torch.device) and value.type == old:
        return new
    return value


def retarget_node_devices(gm: fx.GraphModule, old: str, new: torch.device) -> int:
    """Rewrite ``device=<old>`` arguments of graph nodes (factories, ``_to_copy``...) to ``new``.

    Returns how many nodes changed. Export bakes the trace device into every tensor factory call;
    without this a graph traced on meta would keep creating meta tensors on the real device.
    """
    n = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: _retarget(a, old, new))
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            n += 1
    if n:
        gm.recompile()
    return n


def retarget_values(gm: fx.GraphModule, device: torch.device) -> int:
    """Move every node's fake value (``meta['val']``, tuples included) from another device to
    ``device``, sizes and strides kept: what a shape propagation after binding would give, at a
    fraction of its cost (one ``to`` per value instead of re-running every op). Returns how many
    nodes changed. New dicts, so snapshots that share the old ones keep their meta values."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    n = 0
    if mode is None:
        return n

    # One fresh fake tensor per description (sizes, strides, dtype), shared by the values that
    # have it -- the 30 layers repeat a few dozen; creating one with symbolic sizes costs ~0.3 ms.
    made: Dict[Tuple[Any, ...], torch.Tensor] = {}

    def move(v: Any) -> Any:
        # a fresh fake tensor of the same sizes and strides: what ``v.to(device)`` gives for a dense
        # value, without its copy (``_to_copy``'s decomposition)
        if not isinstance(v, torch.Tensor) or v.device == device:
            return v
        key = (tuple(map(size_expr, v.shape)), tuple(map(size_expr, v.stride())), v.dtype)
        if key not in made:
            made[key] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        return made[key]

    with symbolic_fake_mode(mode):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if val is None:
                continue
            new = torch.utils._pytree.tree_map(move, val)
            if new is not val:
                node.meta = {**node.meta, "val": new}
                n += 1
    return n


@dataclass
class Placement:
    """What ``place_weights`` did (reported in the ``load_weights`` snapshot)."""

    device: str
    tensors: int = 0
    bytes: int = 0  # bytes the graph holds afterwards (each storage once)
    bytes_copied: int = 0  # bytes that had to be copied to reach the device
    bytes_made: int = 0  # bytes a declared conversion made (a rank's weight shards, repacked checkpoints)
    bound_from_source: int = 0  # meta tensors replaced by the eager model's tensors
    bound_by_binding: List[str] = field(default_factory=list)  # made per record_tensor_binding
    bound_constants: List[str] = field(default_factory=list)  # tensors made in forward (record_forward_constant)
    moved: List[str] = field(default_factory=list)  # names copied across devices (first few)
    device_args_retargeted: int = 0
    values_retargeted: int = 0

    def summary(self) -> str:
        mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
        shared = self.bytes - self.bytes_copied - self.bytes_made
        bound = (
            (
                f"; {len(self.bound_by_binding)} tensors ({mib(self.bytes_made)}) made from the quantized "
                "checkpoint or by a declared conversion (a rank's shards)"
            )
            if self.bound_by_binding
            else ""
        )
        if self.bound_constants:
            bound += f"; {len(self.bound_constants)} tensors made in the model's forward (values recorded at export)"
        return (
            f"{self.tensors} tensors, {mib(self.bytes)} on {self.device}: {mib(self.bytes_copied)} copied, "
            f"{mib(shared)} shared with the eager model or checkpoint{bound}; {self.device_args_retargeted} "
            "nodes retargeted from device=meta"
        )

    def details(self) -> Dict[str, Any]:
        return {
            "summary": self.summary(),
            "device": self.device,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "bytes_copied": self.bytes_copied,
            "bytes_made": self.bytes_made,
            "bytes_shared": self.bytes - self.bytes_copied - self.bytes_made,
            "bound_from_source": self.bound_from_source,
            "moved_examples": self.moved[:5],
            "bound_by_binding": len(self.bound_by_binding),
            "binding_examples": self.bound_by_binding[:5],
            "bound_constants": len(self.bound_constants),
            "constant_examples": self.bound_constants[:5],
            "device_args_retargeted": self.device_args_retargeted,
            "values_retargeted": self.values_retargeted,
        }


def _set_attr(gm: fx.GraphModule, target: str, value: torch.Tensor, original: torch.Tensor) -> None:
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if name in owner._parameters:
        owner._parameters[name] = (
            value
            if isinstance(value, torch.nn.Parameter)
            else torch.nn.Parameter(value, requires_grad=original.requires_grad)
        )
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def place_weights(gm: fx.GraphModule, source: Optional[Mapping], device: torch.device) -> Placement:
    """Bind every meta tensor of ``gm`` to its real tensor and put every tensor on ``device``.

    A tensor already on ``device`` is bound as it is (storage shared with the eager model: nothing
    is copied); one elsewhere is copied once (tied names share the copy). Raises ``KeyError``
    naming the tensors that have no real counterpart before anything is changed.
    """
    device = torch.device(device)
    attrs = tensor_attributes(gm)
    resolver = WeightResolver(gm, source)
    missing = resolver.missing([n for n, t in attrs.items() if t.is_meta])
    if missing:
        raise KeyError(
            f"{len(missing)} graph tensor(s) have no real weights to load: {missing[:5]}. They are not "
            "parameters or buffers of the eager model and no transform recorded how it derived them "
            "(record_weight_view, record_tensor_binding: a binding to a quantized checkpoint needs the "
            "model loaded from that checkpoint); the transform that created them must run after weight_load."
        )
    out = Placement(device=str(device))
    memo: Dict[int, torch.Tensor] = {}  # id(original graph tensor) -> placed tensor (keeps ties)
    seen_storage: set = set()
    made: set = set()  # storages a binding's conversion allocated (not the source's own tensor)
    source_storages = {
        _storage(v)
        for v in (source.values() if source is not None else ())
        if isinstance(v, torch.Tensor) and not v.is_meta
    }
    for name, t in attrs.items():
        if id(t) not in memo:
            real = resolver(name) if t.is_meta else t
            if t.is_meta and name in resolver.bindings:
                out.bound_by_binding.append(name)
            elif t.is_meta and name in resolver.constants and name not in resolver.source:
                out.bound_constants.append(name)
            else:
                out.bound_from_source += int(t.is_meta)
            placed = real
            if not _on(real, device):
                placed = real.detach().to(device)
                out.bytes_copied += placed.numel() * placed.element_size()
                out.moved.append(name)
            elif t.is_meta and name in resolver.bindings and _storage(placed) not in source_storages:
                made.add(_storage(placed))
            if isinstance(t, torch.nn.Parameter) and not isinstance(placed, torch.nn.Parameter):
                placed = torch.nn.Parameter(placed, requires_grad=False)
            memo[id(t)] = placed
        placed = memo[id(t)]
        _set_attr(gm, name, placed, t)
        key = (placed.device, placed.untyped_storage().data_ptr())
        if key not in seen_storage:
            seen_storage.add(key)
            out.bytes += placed.untyped_storage().nbytes()
            out.bytes_made += placed.untyped_storage().nbytes() if key in made else 0
    out.tensors = len(memo)
    trace = gm.meta.get(TRACE_DEVICE_KEY)
    for old in {"meta", *([trace] if trace else [])}:
        if old != device.type:
            out.device_args_retargeted += retarget_node_devices(gm, old, device)
    out.values_retargeted = retarget_values(gm, device)
    gm.meta[TRACE_DEVICE_KEY + "_loaded_on"] = str(device)
    return out


def _storage(t: torch.Tensor) -> Tuple[torch.device, int]:
    return (t.device, t.untyped_storage().data_ptr())


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _has_device(value: Any, device_type: str) -> bool:
    """Whether ``value`` (node arguments: nested tuples, lists, dicts) holds a ``torch.device`` of
    ``device_type`` anywhere."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, torch.device) and v.type == device_type:
            return True
    return False


def _run_bound(gm: fx.GraphModule, resolve: Callable[[str], torch.Tensor], device: torch.device, args) -> Any:
    """Runs a graph from before ``weight_load``: meta attributes come from ``resolve``, and
    ``device=meta`` arguments of ``call_function`` nodes become ``device``. The graph module is not
    modified.

    What ``fx.Interpreter(gm, garbage_collect_values=True).run`` does for these graphs (each value is
    dropped after its last use), in one plain loop: the interpreter's per-node dispatch and context
    managers cost ~20 us a node, ~25 ms per probe of a 1,400-node graph (~18 ms of it saved). Whether a node carries a meta device is checked
    on its own arguments (no tensors in them), and only such nodes' values are mapped, instead of
    mapping every call's materialized arguments. Same ops on the same values: bitwise-equal logits.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    # last use: the values each node is the last reader of (freed right after it runs)
    free_after: Dict[int, List[int]] = {}
    seen: set = set()
    for i in range(len(nodes) - 1, -1, -1):
        for n in nodes[i]._input_nodes:
            if n not in seen:
                seen.add(n)
                free_after.setdefault(i, []).append(index[n])
    env: List[Any] = [None] * len(nodes)
    fetch = lambda n: env[index[n]]  # noqa: E731
    retarget = lambda a: _retarget(a, "meta", device)  # noqa: E731
    args_iter = iter(graph.process_inputs(*args))
    for i, node in enumerate(nodes):
        op, target = node.op, node.target
        try:
            if op == "call_function":
                a, k = fx.node.map_arg((node.args, node.kwargs), fetch)
                if _has_device((node.args, node.kwargs), "meta"):
                    a, k = fx.node.map_aggregate((a, k), retarget)
                value = target(*a, **k)
            elif op == "get_attr":
                value = fetch_attr(gm, target)
                if isinstance(value, torch.Tensor):
                    if value.is_meta:
                        value = resolve(target)
                    if not _on(value, device):
                        value = value.to(device)
            elif op == "placeholder":
                if target.startswith("*"):
                    value = list(args_iter)
                else:
                    try:
                        value = next(args_iter)
                    except StopIteration:
                        if not node.args:
                            raise RuntimeError(
                                f"Expected positional argument for parameter {target}, but one was not passed in!"
                            ) from None
                        value = node.args[0]
            elif op == "call_method":
                a, k = fx.node.map_arg((node.args, node.kwargs), fetch)
                value = getattr(a[0], target)(*a[1:], **k)
            elif op == "call_module":
                a, k = fx.node.map_arg((node.args, node.kwargs), fetch)
                value = fetch_attr(gm, target)(*a, **k)
            elif op == "output":
                return graph.process_outputs(fx.node.map_arg(node.args[0], fetch))
            else:
                raise RuntimeError(f"unknown node op {op!r}")
        except Exception as e:  # the interpreter's context: which node failed
            msg = f"While executing {node.format_node()}"
            msg = f"{e.args[0]}\n\n{msg}" if e.args else msg
            e.args = (msg,) + e.args[1:]
            if isinstance(e, KeyError):
                raise RuntimeError(*e.args) from e
            raise
        env[i] = value
        for j in free_after.get(i, ()):
            env[j] = None
    raise RuntimeError("graph has no output node")


def run_unloaded(gm: fx.GraphModule, source: Optional[Mapping], args, device: torch.device):
    """Run ``gm`` (holding meta tensors) on ``args`` with the real weights of ``source``."""
    resolver = WeightResolver(gm, source)
    with torch.no_grad():
        return _run_bound(gm, resolver, torch.device(device), args)


__all__ = [
    "WeightSource",
    "WeightResolver",
    "Placement",
    "place_weights",
    "run_unloaded",
    "unloaded_targets",
    "tensor_attributes",
    "record_weight_view",
    "record_forward_constant",
    "forward_constants",
    "FORWARD_CONSTANTS_KEY",
    "retarget_node_devices",
    "retarget_values",
    "WEIGHT_VIEWS_KEY",
    "TRACE_DEVICE_KEY",
    "TensorBinding",
    "record_tensor_binding",
    "tensor_bindings",
    "with_checkpoint",
    "TENSOR_BINDINGS_KEY",
]
