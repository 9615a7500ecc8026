"""Piecewise CUDA graphs: prefill and mixed steps replay captured graphs between eager attention.

A decode-only step has a fixed shape per batch size, so the whole forward is captured
(``CudaGraphRunner``). A step with prefill tokens does not: its attention depends on how the T
tokens split into sequences (``seq_lens``, page tables), which a captured graph cannot follow.
Everything else in the forward (embedding, norms, projections, RoPE, MLP, LM head) is row-wise in
the flattened tokens and depends only on T. So the graph is cut at its cached-attention calls::

    piece_0  (embed, norm, qkv)   -> attention_0 (eager) -> piece_1 (o_proj, mlp, norm, qkv) -> ...
    captured per token bucket        real tokens only        captured per token bucket

(a graph that gathers each sequence's last token before the LM head -- ``gather_logits_before_lm_head``
-- runs that gather and everything after it eagerly too: its shapes follow B, not T), and for a
step of T tokens the smallest bucket ``T_b >= T`` is used: token inputs are padded to
``T_b`` (padding ids and positions are 0), the captured pieces replay on ``[1, T_b, ...]``, and each
attention runs eagerly on the first T rows and writes its output into a fixed per-bucket buffer
``[1, T_b, Hq, Dv]`` that the next piece was captured reading. Padding rows never reach the KV
cache (only attention writes it, and it sees real rows only) and their logits are never read.

Replays need every input of a piece at the address it was captured with. In steady state that
holds by construction -- metadata and token inputs are views of ``SequenceInfo``'s fixed buffers,
parameters do not move, earlier pieces' outputs are graph-owned, attention outputs are the
per-bucket buffers -- so nothing is copied; an input found elsewhere is copied into the captured
one, and a piece whose non-tensor inputs differ from the captured ones runs eagerly.

Without CUDA graphs (``use_cuda_graphs=False``: the CPU) the same split, padding and slicing run
with every piece eager, which is how the CPU tests check this module's numerics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from ..ops.backends import ATTENTION_BACKENDS
from .sequence_info import INPUT_KEY, LAST_TOKEN_INPUT

logger = logging.getLogger("workbench.runtime")


# ops that run eagerly between captured pieces: the cached-attention ops of every backend, which read
# the per-sequence layout of a step (the op objects themselves: ``import workbench.ops`` registers them)
def eager_ops() -> frozenset:
    return frozenset(b.op for b in ATTENTION_BACKENDS)


SMALLEST_DEFAULT_BUCKET = 64


def default_token_buckets(max_num_tokens: int) -> List[int]:
    """Powers of two from 64 up to ``max_num_tokens``, plus ``max_num_tokens`` itself."""
    sizes, b = [], SMALLEST_DEFAULT_BUCKET
    while b < max_num_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_tokens]


def is_eager_op(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in eager_ops()


@dataclass
class PieceState:
    """What the wrapped pieces of one ``PiecewiseGraphs`` need to know about the current call."""

    bucket: int = 0
    num_tokens: int = 0
    capturing: bool = False
    pool: Any = None
    eager_pieces: int = 0  # piece calls that could not replay (inputs differed from the capture)


@dataclass
class _Capture:
    graph: Any
    tensor_inputs: List[torch.Tensor]
    other_inputs: List[Any]
    outputs: Any


class CapturedPiece(torch.nn.Module):
    """A row-wise piece of the forward: one CUDA graph per token bucket (or eager without CUDA)."""

    def __init__(self, fn: Callable[..., Any], state: PieceState, use_cuda_graphs: bool):
        super().__init__()
        self.fn, self.state, self.use_cuda_graphs = fn, state, use_cuda_graphs
        self.captures: Dict[int, _Capture] = {}

    def forward(self, *args):
        st = self.state
        if not self.use_cuda_graphs:
            return self.fn(*args)
        if st.capturing:
            return self._capture(args)
        cap = self.captures.get(st.bucket)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        others = [a for a in args if not isinstance(a, torch.Tensor)]
        if (
            cap is None
            or others != cap.other_inputs
            or any(t.shape != c.shape for t, c in zip(tensors, cap.tensor_inputs))
        ):
            st.eager_pieces += 1
            return self.fn(*args)
        for t, c in zip(tensors, cap.tensor_inputs):
            if t.data_ptr() != c.data_ptr():
                c.copy_(t)
        cap.graph.replay()
        return cap.outputs

    def _capture(self, args):
        st = self.state
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up off the capture: lazy init, cuBLAS workspaces, autotuning
                self.fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=st.pool):
            out = self.fn(*args)
        self.captures[st.bucket] = _Capture(
            graph,
            [a for a in args if isinstance(a, torch.Tensor)],
            [a for a in args if not isinstance(a, torch.Tensor)],
            out,
        )
        return out


class PaddedAttention(torch.nn.Module):
    """An attention piece: runs on the real tokens of a padded step, output padded to the bucket.

    Inputs as the attention op's: q [1, T_b, Hq, D], k/v [1, T_b, Hkv, D], caches, metadata.
    Output: a fixed buffer [1, T_b, Hq, Dv] per bucket whose first T rows are the attention output.
    """

    def __init__(self, fn: Callable[..., Any], state: PieceState, qkv_positions: Sequence[int]):
        super().__init__()
        self.fn, self.state, self.qkv_positions = fn, state, tuple(qkv_positions)
        self.out_buffers: Dict[Tuple[int, ...], torch.Tensor] = {}

    def forward(self, *args):
        st = self.state
        q, v = args[self.qkv_positions[0]], args[self.qkv_positions[2]]
        shape = (1, q.shape[1], q.shape[2], v.shape[3])
        buf = self.out_buffers.get(shape)
        if buf is None or buf.dtype != q.dtype:
            buf = self.out_buffers[shape] = torch.zeros(shape, dtype=q.dtype, device=q.device)
        if st.capturing:
            return buf  # the pieces are captured on placeholder values; no cache is written
        t = st.num_tokens
        real = [a[:, :t] if i in self.qkv_positions else a for i, a in enumerate(args)]
        buf[:, :t].copy_(self.fn(*real))
        return buf


class PiecewiseGraphs:
    """``module`` cut at its cached-attention calls, with captured pieces per token bucket.

    ``module``: a cached graph (its inputs as ``module_input_names`` lists them). ``buckets``: the
    padded token counts. ``compile_pieces``: ``torch.compile`` each captured piece (``torch-opt``).
    """

    def __init__(
        self, module: fx.GraphModule, buckets: Sequence[int], use_cuda_graphs: bool, compile_pieces: bool = False
    ):
        if not isinstance(module, fx.GraphModule):
            raise TypeError(f"piecewise CUDA graphs split an fx graph, not a {type(module).__name__}")
        if use_cuda_graphs and not torch.cuda.is_available():
            raise RuntimeError("piecewise CUDA graphs need CUDA; use_cuda_graphs=False runs the pieces eagerly")
        self.buckets = sorted({int(b) for b in buckets})
        self.use_cuda_graphs = use_cuda_graphs
        self.state = PieceState()
        self.split, self.num_attention, tail = _split_at_eager_ops(module)
        if self.num_attention == 0:
            raise ValueError("no cached attention in the graph: nothing to split at (run the cache stage first)")
        self.num_captured_pieces = 0
        for name, sub in list(self.split.named_children()):
            if not name.startswith("submod_") or name == f"submod_{tail}":
                continue  # the gathered LM head (if any) runs as it is
            eager_node = next((n for n in sub.graph.nodes if is_eager_op(n)), None)
            if eager_node is not None:
                phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
                positions = [phs.index(a) for a in eager_node.args[:3]]
                setattr(self.split, name, PaddedAttention(sub, self.state, positions))
            else:
                fn = torch.compile(sub, dynamic=True) if compile_pieces else sub
                setattr(self.split, name, CapturedPiece(fn, self.state, use_cuda_graphs))
                self.num_captured_pieces += 1
        self.steps = 0

    def bucket(self, num_tokens: int) -> Optional[int]:
        """The smallest bucket that holds ``num_tokens`` tokens (None: run the step unsplit)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def capture(self, inputs_for_bucket: Callable[[int], List[Any]]) -> None:
        """Capture every piece for every bucket, largest first (smaller ones reuse its memory pool).
        ``inputs_for_bucket(b)``: the module's inputs with token inputs of length ``b``."""
        if not self.use_cuda_graphs:
            return
        st = self.state
        st.pool = torch.cuda.graph_pool_handle()
        try:
            for b in sorted(self.buckets, reverse=True):
                st.bucket, st.num_tokens, st.capturing = b, b, True
                with torch.no_grad():
                    self.split(*inputs_for_bucket(b))
        finally:
            st.capturing = False
        torch.cuda.synchronize()

    def __call__(self, inputs: List[Any], num_tokens: int) -> torch.Tensor:
        """Logits [1, T_b, V] of a step of ``num_tokens`` real tokens whose token inputs in
        ``inputs`` are padded to its bucket (rows past ``num_tokens`` are padding)."""
        b = self.bucket(num_tokens)
        if b is None:
            raise ValueError(f"{num_tokens} tokens exceed the largest piecewise bucket {self.buckets[-1]}")
        self.state.bucket, self.state.num_tokens = b, num_tokens
        self.steps += 1
        with torch.no_grad():
            return self.split(*inputs)


def _is_last_token_gather(node: fx.Node) -> bool:
    index = node.args[2] if node.op == "call_function" and len(node.args) > 2 else None
    return (
        node.target is torch.ops.aten.index_select.default
        and isinstance(index, fx.Node)
        and index.op == "placeholder"
        and index.meta.get(INPUT_KEY, index.name) == LAST_TOKEN_INPUT
    )


def _split_at_eager_ops(gm: fx.GraphModule) -> Tuple[fx.GraphModule, int, Optional[int]]:
    """``split_module`` with each eager op in a partition of its own, the row-wise nodes between
    them in one partition each, and a last-token gather with everything after it in a final eager
    partition (its id is returned, None without a gather); placeholders keep their order (the
    runner feeds them positionally). Parameters stay shared with ``gm``."""
    partition: Dict[fx.Node, int] = {}
    current, num_eager, tail = 0, 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if tail is None and _is_last_token_gather(node):
            tail = current + 1
        if tail is not None:
            partition[node] = tail
        elif is_eager_op(node):
            num_eager += 1
            partition[node] = current + 1
            current += 2
        else:
            partition[node] = current
    split = split_module(gm, gm, lambda n: partition[n], keep_original_order=True)
    # the export's pytree codegen (the forward returns the logits, not a 1-tuple) carries over
    split.graph._codegen = gm.graph._codegen  # immutable in practice; a deepcopy trips a pytree warning
    split.recompile()
    before = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    after = [n.name for n in split.graph.nodes if n.op == "placeholder"]
    if before != after:  # would feed inputs to the wrong placeholders
        raise RuntimeError(f"splitting reordered the graph inputs: {before} -> {after}")
    return split, num_eager, tail


__all__ = ["PiecewiseGraphs", "CapturedPiece", "PaddedAttention", "default_token_buckets", "eager_ops"]
