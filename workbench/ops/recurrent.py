"""The cached-state op kit: a recurrent mixer's ops registered from one description.

Every recurrent mixer (causal conv, Mamba-1 and Mamba-2 scans, RG-LRU, the delta rules, decayed
linear attention) keeps a fixed-size state per sequence and is served by three ops that the kit
defines from one ``RecurrentOp``::

    torch_<name>(<inputs>, *, <options>) -> Tensor          whole sequences from a zero state
    torch_cached_<name>(<inputs>, seq_lens, input_pos, slot_idx, num_prefill, <state>(a!), *, <options>)
    triton_cached_<name>(the same)                            decode rows in a Triton kernel

What a family writes is its math (``RecurrentMath``), in two forms, and its checks:

- ``run(inputs, init, options) -> (y, final)``: whole sequences ``[b, s, ...]`` from ``init``
  (``[b, *state]``, or ``None`` for fresh sequences: some mixers treat their first token apart,
  RG-LRU's reset); the uncached op and every prefill sequence of the cached ops call it.
- ``step(inputs, held, fresh, options) -> (y, new)``: one token per row, ``inputs [n, ...]``,
  ``held [n, *state]`` (zeros where ``fresh``), for the decode rows of the torch backend.
- ``check(inputs, options)``: shapes, naming the argument that is off (at trace time too, from
  the fakes); the kit adds the flattened-token, state and metadata checks (``ops/state.py``).

and, optionally, ``triton_decode(rows, state, options)``: launches the family's kernel on the
step's decode rows (``DecodeRows``: the inputs and output cut to the decode tokens, each row's slot
and position), which the kit hands it non-empty. Its state is a ``RecurrentState``: a ``StateSpec``
that also names its dims (for errors) and says what it holds.

The kit does the rest once for every family: the schemas (the cached ops share one, so backends are
interchangeable in a graph), the fakes, reading and checking the step metadata into a typed
``StepMetadata``, the prefill loop, the state reads and writes, the Triton availability check that
names the torch backend, and the ``StatefulOp`` entry the cache stage rewrites by.

A Triton backend op is always registered; ``triton_available(device)`` (``ops/triton_support.py``)
says whether its kernel can run: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests).
Called where it cannot run, it raises and names the ``torch`` backend instead of silently falling
back. A decode-only step (``num_prefill == 0``) of a Triton op reads no metadata on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from .library import define_op
from .state import (
    STATE_HOST_SYNC,
    TRITON_STATE_HOST_SYNC,
    StatefulOp,
    StateSpec,
    check_decode_only_metadata,
    check_state_shape,
    check_step_metadata,
    initial_states,
    register_stateful_op,
)
from .triton_support import require_triton

Inputs = Dict[str, Any]  # an op's inputs by schema name (tensors, or None for an absent optional)
Options = Dict[str, Any]  # its keyword-only options, defaults filled in

TRITON_REQUIREMENT = "a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"


@dataclass(frozen=True)
class StepMetadata:
    """One continuous-batching step: ``num_prefill`` prefill sequences first, then one-token decode
    rows, their tokens back to back in the flattened token dim. ``lens`` is ``seq_lens`` read on
    the host, ``None`` in a decode-only step that must not read it (a CUDA-graph capture)."""

    input_pos: torch.Tensor  # [B] int32: tokens each sequence had before this step
    slot_idx: torch.Tensor  # [B] int32: its state row
    num_prefill: int
    lens: Optional[List[int]]
    first_decode_token: int  # the decode rows' tokens are first_decode_token..T-1

    @property
    def first_decode_row(self) -> int:
        return self.num_prefill

    @property
    def num_decode(self) -> int:
        return self.slot_idx.numel() - self.num_prefill

    def prefill_spans(self) -> Iterator[Tuple[int, slice]]:
        """``(sequence, its tokens)`` for each prefill sequence with tokens."""
        assert self.lens is not None, "prefill spans need seq_lens read on the host"
        start = 0
        for i in range(self.num_prefill):
            if self.lens[i]:
                yield i, slice(start, start + self.lens[i])
            start += self.lens[i]


def read_step(
    num_tokens: int, seq_lens, input_pos, slot_idx, num_prefill: int, tokens_of: str, *, host: bool
) -> StepMetadata:
    """Check one step's metadata against ``num_tokens`` flattened tokens (of input ``tokens_of``).
    ``host=False`` (decode-only steps of a capturable backend) checks sizes only."""
    if not host:
        check_decode_only_metadata(num_tokens, slot_idx, input_pos)
        return StepMetadata(input_pos, slot_idx, num_prefill, None, 0)
    lens = check_step_metadata(num_tokens, seq_lens, input_pos, slot_idx, num_prefill, tokens_of)
    return StepMetadata(input_pos, slot_idx, num_prefill, lens, sum(lens[:num_prefill]))


@dataclass(frozen=True)
class DecodeRows:
    """A step's decode rows, one token each, as ``step`` and ``triton_decode`` get them: the
    per-token inputs and the output cut to the decode tokens, and each row's slot and position, so
    decode row ``r`` is token ``r``, ``slot_idx[r]`` and ``input_pos[r]`` alike. Views (slices of
    the step's tensors): nothing is read on the host, a CUDA graph can capture them."""

    inputs: Inputs  # per-token inputs [n, ...]; the others as the op got them
    slot_idx: torch.Tensor  # [n] int32: each row's state row
    input_pos: torch.Tensor  # [n] int32: tokens it had before this step (0: a new sequence)
    out: torch.Tensor  # [n, ...]: the output's decode tokens, written in place

    @property
    def num_rows(self) -> int:
        return self.slot_idx.numel()


@dataclass(frozen=True, kw_only=True)
class RecurrentState(StateSpec):
    """A recurrent family's per-sequence state: the ``StateSpec`` the cache stage allocates by
    (``name``, ``shape`` from the inputs by name, ``dtype``), its dims by name and what it holds."""

    layout: str  # its dims, for errors: "c, k-1"
    description: str  # what it holds, for tables and renders (the stateful-op entry's)


@dataclass(frozen=True)
class RecurrentMath:
    """What a family writes (module docstring): its math over whole sequences (``run``) and over one
    token per row (``step``), and its shape checks."""

    check: Callable[[Inputs, Options], None]
    run: Callable[[Inputs, Optional[torch.Tensor], Options], Tuple[torch.Tensor, torch.Tensor]]
    step: Callable[[Inputs, torch.Tensor, torch.Tensor, Options], Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RecurrentOp:
    """A recurrent mixer: its schema text, its state and its math (module docstring)."""

    name: str  # ops torch_<name>, torch_cached_<name>, triton_cached_<name>
    inputs: str  # schema text of the inputs: "Tensor x, Tensor weight, Tensor? bias"
    options: str  # schema text of the keyword-only options: "str? activation=None" ("" for none)
    state: RecurrentState  # the per-sequence state (its shape from the inputs by name)
    token_args: Tuple[str, ...]  # inputs that are per-token [b, s, ...]
    insert_key: str  # the cache_init transform that rewrites it
    math: RecurrentMath
    triton_decode: Optional[Callable[[DecodeRows, torch.Tensor, Options], None]] = None
    output_like: Optional[Callable[[Inputs], torch.Tensor]] = None  # default: like the first input
    input_names: Tuple[str, ...] = field(init=False)

    def __post_init__(self):
        names = tuple(arg.strip().rsplit(" ", 1)[1] for arg in self.inputs.split(","))
        object.__setattr__(self, "input_names", names)
        unknown = set(self.token_args) - set(names)
        if unknown:
            raise ValueError(f"recurrent op {self.name}: token_args {sorted(unknown)} are not among its inputs {names}")

    @property
    def tokens_of(self) -> str:
        return self.token_args[0]

    def empty_output(self, inputs: Inputs) -> torch.Tensor:
        if self.output_like is not None:
            return self.output_like(inputs)
        return torch.empty_like(inputs[self.input_names[0]])


def _schema_defaults(op) -> Dict[str, Any]:
    return {a.name: a.default_value for a in op._schema.arguments if a.kwarg_only and a.has_default_value()}


class _Bodies:
    """The op bodies of one ``RecurrentOp``: the dispatcher passes the inputs, metadata and state
    positionally and the options by name (leaving out ones at their default)."""

    def __init__(self, spec: RecurrentOp):
        self.spec = spec
        self.defaults: Dict[str, Any] = {}

    def _options(self, given: Mapping[str, Any]) -> Options:
        return {**self.defaults, **given}

    def _inputs(self, args) -> Inputs:
        return dict(zip(self.spec.input_names, args))

    def _cached_args(
        self, args, options: Mapping[str, Any], capturable: bool
    ) -> Tuple[Inputs, StepMetadata, torch.Tensor, Options]:
        """The inputs, the step, the state and the options of a cached call, all checked; a
        ``capturable`` backend reads ``seq_lens`` on the host only in steps with prefill."""
        n = len(self.spec.input_names)
        inputs = self._inputs(args[:n])
        seq_lens, input_pos, slot_idx, num_prefill, state = args[n : n + 5]
        opts = self._options(options)
        self.check_cached(inputs, state, opts)
        tokens = inputs[self.spec.tokens_of].shape[1]
        host = num_prefill > 0 or not capturable
        step = read_step(tokens, seq_lens, input_pos, slot_idx, num_prefill, self.spec.tokens_of, host=host)
        return inputs, step, state, opts

    def check_cached(self, inputs: Inputs, state: torch.Tensor, options: Options) -> None:
        spec = self.spec
        spec.math.check(inputs, options)
        tokens = inputs[spec.tokens_of]
        if tokens.shape[0] != 1:
            raise ValueError(
                f"cached {spec.name} expects flattened tokens {spec.tokens_of} [1, T, ...]; got {tuple(tokens.shape)}"
            )
        expected = spec.state.shape(inputs)
        check_state_shape(state, expected, f"{spec.state.name} must be [num_slots, {spec.state.layout}]")

    def uncached(self, *args, **options) -> torch.Tensor:
        inputs, opts = self._inputs(args), self._options(options)
        self.spec.math.check(inputs, opts)
        y, _ = self.spec.math.run(inputs, None, opts)
        out = self.spec.empty_output(inputs)
        out.copy_(y)
        return out

    def fake(self, *args, **options) -> torch.Tensor:
        inputs = self._inputs(args[: len(self.spec.input_names)])
        self.spec.math.check(inputs, self._options(options))
        return self.spec.empty_output(inputs)

    def prefill(self, inputs: Inputs, step: StepMetadata, state: torch.Tensor, out: torch.Tensor, opts: Options):
        """Each prefill sequence through ``run`` from its slot's state (fresh: ``None``)."""
        slots = step.slot_idx.long()
        past = step.input_pos[: step.num_prefill].tolist()
        for i, span in step.prefill_spans():
            part = {k: (v[:, span] if k in self.spec.token_args else v) for k, v in inputs.items()}
            init = state[slots[i]][None] if past[i] > 0 else None
            y, final = self.spec.math.run(part, init, opts)
            out[:, span] = y
            state[slots[i]] = final[0].to(state.dtype)

    def decode_rows(self, inputs: Inputs, step: StepMetadata, out: torch.Tensor) -> DecodeRows:
        """The step's decode rows: per-token inputs and ``out`` (``[1, T, ...]``) cut to their tokens."""
        token_args = self.spec.token_args
        if not step.num_prefill:  # decode only (every eager decode step): the whole tensors, no slicing
            whole = {k: (v[0] if k in token_args else v) for k, v in inputs.items()}
            return DecodeRows(whole, step.slot_idx, step.input_pos, out[0])
        tokens = slice(step.first_decode_token, None)
        rows = slice(step.first_decode_row, None)
        part = {k: (v[0, tokens] if k in token_args else v) for k, v in inputs.items()}
        return DecodeRows(part, step.slot_idx[rows], step.input_pos[rows], out[0, tokens])

    def torch_decode(self, rows: DecodeRows, state: torch.Tensor, opts: Options) -> None:
        """The decode rows together through ``step``: one token each."""
        slots, pos = rows.slot_idx.long(), rows.input_pos
        y, new = self.spec.math.step(rows.inputs, initial_states(state, slots, pos), pos <= 0, opts)
        rows.out.copy_(y)
        state.index_copy_(0, slots, new.to(state.dtype))

    def torch_cached(self, *args, **options) -> torch.Tensor:
        inputs, step, state, opts = self._cached_args(args, options, capturable=False)
        out = self.spec.empty_output(inputs)
        self.prefill(inputs, step, state, out, opts)
        if step.num_decode:
            self.torch_decode(self.decode_rows(inputs, step, out), state, opts)
        return out

    def triton_cached(self, *args, **options) -> torch.Tensor:
        spec = self.spec
        tokens = args[spec.input_names.index(spec.tokens_of)]
        require_triton(tokens.device, f"triton_cached_{spec.name}", f"{spec.insert_key}.backend=torch")
        inputs, step, state, opts = self._cached_args(args, options, capturable=True)
        out = spec.empty_output(inputs)
        if step.num_prefill:  # prefill sequences (rare, long) run the reference's chunked form
            self.prefill(inputs, step, state, out, opts)
        if step.num_decode:
            assert spec.triton_decode is not None  # the triton op is defined only with a launcher
            spec.triton_decode(self.decode_rows(inputs, step, out), state, opts)
        return out


@dataclass(frozen=True)
class RecurrentOps:
    """The ops one ``RecurrentOp`` defined, and its stateful-op entry."""

    uncached: Any
    torch_cached: Any
    triton_cached: Optional[Any]
    stateful: StatefulOp


def define_recurrent_op(spec: RecurrentOp) -> RecurrentOps:
    """Define ``spec``'s ops (module docstring) and declare its state for the cache stage."""
    bodies = _Bodies(spec)
    metadata = "Tensor seq_lens, Tensor input_pos, Tensor slot_idx, SymInt num_prefill"
    options = f", *, {spec.options}" if spec.options else ""
    cached_schema = f"({spec.inputs}, {metadata}, Tensor(a!) {spec.state.name}{options}) -> Tensor"
    # ``define_op`` (a Library kernel), not a mutating ``custom_op``: that pays ~50-80 us of Python
    # argument handling per call (library.py), and a decode step calls each cached op once per layer.
    uncached = define_op(
        f"torch_{spec.name}({spec.inputs}{options}) -> Tensor", bodies.uncached, bodies.fake, category="attention"
    )
    bodies.defaults = _schema_defaults(uncached.default)
    # backend -> (its body, why a CUDA graph cannot capture it); the category is the cost model's mixers'
    backends = {"torch": (bodies.torch_cached, STATE_HOST_SYNC)}
    if spec.triton_decode is not None:
        backends["triton"] = (bodies.triton_cached, TRITON_STATE_HOST_SYNC)
    cached_ops = {
        backend: define_op(
            f"{backend}_cached_{spec.name}" + cached_schema, body, bodies.fake, host_sync=sync, category="attention"
        )
        for backend, (body, sync) in backends.items()
    }
    cached = {backend: f"workbench::{backend}_cached_{spec.name}" for backend in cached_ops}
    stateful = register_stateful_op(
        StatefulOp(
            source=f"workbench::torch_{spec.name}",
            cached=cached,
            token_args=spec.token_args,
            states=(spec.state,),
            insert_key=spec.insert_key,
            description=spec.state.description,
            backend_requirements={"triton": TRITON_REQUIREMENT} if "triton" in cached_ops else {},
        )
    )
    return RecurrentOps(uncached, cached_ops["torch"], cached_ops.get("triton"), stateful)


__all__ = [
    "DecodeRows",
    "Inputs",
    "Options",
    "RecurrentMath",
    "RecurrentOp",
    "RecurrentOps",
    "RecurrentState",
    "StepMetadata",
    "define_recurrent_op",
    "read_step",
]
