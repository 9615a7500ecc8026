"""The stream markers the ``multi_stream_*`` transforms insert: small ``nn.Module``s (``call_module``
nodes, so a graph prints, copies and renders as usual) that hop a branch onto an auxiliary CUDA
stream and back, passing their tensors through unchanged (on CPU tensors they are pass-throughs).

``AuxStreams`` holds the aux stream of one rewrite (created on first use per device: no global
state); ``AuxSite`` the CUDA events of one branch. ``AuxFork`` records an event on the main stream,
makes the aux stream wait on it and switches to aux; ``AuxEnd`` records "done" and switches back;
``AuxWait`` makes main wait on "done" right before the branch's first consumer. The fork calls
``x.record_stream(aux)`` and the wait ``y.record_stream(main)``, so the caching allocator never
hands a block to one stream while the other may still read it; all of it is legal under CUDA-graph
capture (the aux stream forks from and rejoins the capturing stream).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch


class AuxStreams:
    """The auxiliary stream of one rewritten graph, one per device, created on first use."""

    def __init__(self) -> None:
        self._streams: Dict[torch.device, Any] = {}

    def aux(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


class AuxSite:
    """One fork/join site: its events and the main stream it forked from (set at fork time)."""

    def __init__(self, streams: AuxStreams, name: str) -> None:
        self.streams, self.name = streams, name
        self._events: Dict[torch.device, Tuple[Any, Any]] = {}
        self.main: Optional[Any] = None

    def events(self, device: torch.device) -> Tuple[Any, Any]:
        if device not in self._events:
            self._events[device] = (torch.cuda.Event(), torch.cuda.Event())
        return self._events[device]


def passthrough(xs: Tuple[torch.Tensor, ...]) -> Any:
    """One tensor as itself, several as the tuple (what a marker returns)."""
    return xs[0] if len(xs) == 1 else xs


class _Marker(torch.nn.Module):
    """A graph node that switches streams on CUDA (``on_cuda``) and passes its inputs through."""

    def __init__(self, site: AuxSite) -> None:
        super().__init__()
        self.site = site
        _compiler_disabled_forward(type(self))

    def extra_repr(self) -> str:
        return self.site.name

    def forward(self, *ys: torch.Tensor) -> Any:
        if ys[0].is_cuda:
            self.on_cuda(ys, ys[0].device)
        return passthrough(ys)

    def on_cuda(self, ys: Tuple[torch.Tensor, ...], device: torch.device) -> None:
        raise NotImplementedError


def _compiler_disabled_forward(cls: type) -> None:
    """Make ``cls.forward`` opaque to ``torch.compile`` (``torch.compiler.disable``), once per class.

    Done when the first marker is made rather than with a decorator at import: the decorator imports
    Dynamo (with Inductor and Triton, ~1 s and ~140 MB), which every process importing the
    transforms would pay, while markers exist only in multi-stream CUDA graphs."""
    if "forward" in cls.__dict__ and getattr(cls.__dict__["forward"], "_torchdynamo_disable", False):
        return
    cls.forward = torch.compiler.disable(cls.forward)  # type: ignore[attr-defined]


class AuxFork(_Marker):
    """Main records an event, the aux stream waits on it and becomes the current stream."""

    def on_cuda(self, ys: Tuple[torch.Tensor, ...], device: torch.device) -> None:
        fork, _ = self.site.events(device)
        aux = self.site.streams.aux(device)
        self.site.main = torch.cuda.current_stream(device)
        fork.record(self.site.main)
        aux.wait_event(fork)
        ys[0].record_stream(aux)
        torch.cuda.set_stream(aux)


class AuxEnd(_Marker):
    """The aux stream records "done"; the main stream becomes current again."""

    def on_cuda(self, ys: Tuple[torch.Tensor, ...], device: torch.device) -> None:
        _, done = self.site.events(device)
        done.record(torch.cuda.current_stream(device))
        assert self.site.main is not None  # set by the fork
        torch.cuda.set_stream(self.site.main)


class AuxWait(_Marker):
    """The main stream waits for "done" before the branch's results are consumed."""

    def on_cuda(self, ys: Tuple[torch.Tensor, ...], device: torch.device) -> None:
        _, done = self.site.events(device)
        main = torch.cuda.current_stream(device)
        main.wait_event(done)
        for y in ys:
            y.record_stream(main)


__all__ = ["AuxStreams", "AuxSite", "AuxFork", "AuxEnd", "AuxWait", "passthrough"]
