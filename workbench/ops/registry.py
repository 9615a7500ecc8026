"""One shape for every backend table: attention, fusion (RMSNorm, RoPE, SiLU*mul) and compile.

A backend is registered whatever the machine (a YAML naming it always validates, a saved graph that
uses its op always loads); whether it can *run* is asked when it is picked, through
``unavailable_reason(device)``, so the transform that picks it and the notebook panel that offers
it give the same answer. A registry is filled once, where it is defined, and never mutated after.

    registry.names()                    -> every backend name (config Literals, UI options)
    registry.get(name)                  -> the backend, or a ValueError listing the known names
    registry.pick(name, device, field)  -> the backend, or a RuntimeError saying what it needs and
                                           which field to set to what instead
    registry.choose(name, device, field, refuse=...)  -> a ``Choice``: the backend and why

Registration checks each backend against its family's contract (``Backend.contract_problems``):
a backend that lacks a required member is refused when the table is built, naming what it lacks,
not when a model first asks for it.

``choose`` is the one backend choice every family makes (attention, fusion, compile): an explicit
name is picked (refused, with what runs here, when it cannot run or ``refuse`` names a reason); ``auto``
(or None) takes the first of ``auto_order[device type]`` that runs on the device and that ``refuse``
does not turn down, and says what it passed over.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Generic, Iterable, Iterator, List, Mapping, Optional, Tuple, TypeVar

import torch


@dataclass(frozen=True)
class Backend:
    """A named way of doing one thing, with what it needs to run."""

    name: str
    requirement: str  # what it needs, for error messages ("triton and a CUDA GPU ...")

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        """Why this backend cannot run on ``device`` (None: it can)."""
        return None

    def contract_problems(self) -> List[str]:
        """What this backend lacks of its family's contract ([]: nothing); ``BackendRegistry``
        refuses to register a backend with problems, naming them."""
        return [] if self.name and self.requirement else ["a name and a requirement (what it needs to run)"]


@dataclass(frozen=True)
class OpBackend(Backend):
    """A backend that is one ``torch.ops.workbench`` op, defined (and asked ``is_available``) in
    ``module``, imported on first use so that importing a table never needs triton or flashinfer."""

    module: str = ""
    op_name: str = ""

    def _module(self):
        return importlib.import_module(self.module)

    def contract_problems(self) -> List[str]:
        """Its op must be a registered ``workbench::`` op once its module is imported; a backend
        other than the torch reference must say where it runs (the module's ``is_available``)."""
        problems = super().contract_problems()
        try:
            module = self._module()
        except ImportError as e:
            return problems + [f"an importable module ({self.module}: {e})"]
        if not hasattr(torch.ops.workbench, self.op_name) or not self.op_name:
            problems.append(f"its op workbench::{self.op_name} registered by {self.module}")
        if self.name != "torch" and not callable(getattr(module, "is_available", None)):
            problems.append(f"is_available(device) in {self.module} (where it can run)")
        return problems

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        is_available = getattr(self._module(), "is_available", None)
        if is_available is None:
            return None
        ok, why = is_available(torch.device(device))
        return None if ok else why

    @property
    def op(self) -> torch._ops.OpOverload:
        self._module()
        return getattr(torch.ops.workbench, self.op_name).default


B = TypeVar("B", bound=Backend)


@dataclass(frozen=True)
class Choice(Generic[B]):
    """A backend a transform chose and why ("auto on cuda: triton (passed over: flashinfer: ...)")."""

    backend: B
    why: str

    @property
    def name(self) -> str:
        return self.backend.name


class BackendRegistry(Generic[B]):
    """An immutable, ordered table of backends of one kind (``kind`` names it in messages);
    ``auto_order``: what ``auto`` tries, in order, per device type (absent: the default)."""

    def __init__(
        self,
        kind: str,
        backends: Iterable[B],
        default: Optional[str] = None,
        auto_order: Optional[Mapping[str, Tuple[str, ...]]] = None,
    ):
        self.kind = kind
        self._backends: Dict[str, B] = {}
        for b in backends:
            if b.name in self._backends:
                raise ValueError(f"{kind} backend {b.name!r} registered twice")
            problems = b.contract_problems()
            if problems:
                raise ValueError(f"{kind} backend {b.name!r} cannot be registered: it lacks {'; '.join(problems)}")
            self._backends[b.name] = b
        self.default = default or next(iter(self._backends))
        self.auto_order: Dict[str, Tuple[str, ...]] = dict(auto_order or {})
        for order in self.auto_order.values():
            for name in order:
                self.get(name)  # a typo in a table fails at import

    def names(self) -> Tuple[str, ...]:
        return tuple(self._backends)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def __iter__(self) -> Iterator[B]:
        return iter(self._backends.values())

    def __getitem__(self, name: str) -> B:
        return self.get(name)

    def get(self, name: str) -> B:
        if name not in self._backends:
            raise ValueError(f"unknown {self.kind} backend {name!r}; known: {', '.join(self._backends)}")
        return self._backends[name]

    def pick(self, name: Optional[str], device: torch.device, field: str) -> B:
        """The backend ``name`` (None: the default) if it can run on ``device``; otherwise a
        RuntimeError naming what is missing, what it needs, and the backends that do run here."""
        backend = self.get(name or self.default)
        why = backend.unavailable_reason(torch.device(device))
        if why is None:
            return backend
        here = [b.name for b in self if b.name != backend.name and b.unavailable_reason(torch.device(device)) is None]
        instead = ""
        if here:
            instead = f" Pick backend '{here[0]}' ({field}={here[0]}) instead"
            instead += f" (also runs here: {', '.join(here[1:])})." if here[1:] else "."
        raise RuntimeError(
            f"{self.kind} backend '{backend.name}' cannot run on {torch.device(device)}: {why}. "
            f"It needs {backend.requirement}.{instead}"
        )

    def choose(
        self,
        name: Optional[str],
        device: torch.device,
        field: str,
        refuse: Callable[[B], Optional[str]] = lambda backend: None,
        measured: Optional[Tuple[Tuple[str, ...], str]] = None,
    ) -> Choice[B]:
        """The backend ``name`` asks for on ``device`` (``auto``/None: ``auto_order``'s first that
        runs and is not refused) and why. ``refuse(backend)``: why a backend cannot serve this
        model (None: it can). ``measured``: (an order, fastest first, and how it was measured) that
        replaces ``auto_order`` for this device. An explicit name that cannot run or is refused is an
        error naming the backends that would do."""
        device = torch.device(device)
        if name in (None, "auto"):
            skipped: List[str] = []
            order = measured[0] if measured is not None else self.auto_order.get(device.type, (self.default,))
            for candidate in order:
                backend = self.get(candidate)
                why = backend.unavailable_reason(device) or refuse(backend)
                if why is None:
                    note = f" (passed over: {'; '.join(skipped)})" if skipped else ""
                    how = f", {measured[1]}" if measured is not None else ""
                    return Choice(backend, f"auto on {device.type}: {backend.name}{note}{how}")
                skipped.append(f"{candidate}: {why}")
            name = None  # nothing in the order serves: the default explains itself below
        backend = self.pick(name, device, field)
        why = refuse(backend)
        if why is not None:
            serve = [
                b.name
                for b in self
                if b.name != backend.name and b.unavailable_reason(device) is None and refuse(b) is None
            ]
            instead = (
                f"Use backend {' or '.join(repr(n) for n in serve)} ({field}=...)."
                if serve
                else f"No other {self.kind} backend runs here and serves it."
            )
            raise ValueError(f"{self.kind} backend '{backend.name}' does not support this model: {why}. {instead}")
        return Choice(backend, f"{backend.name} (requested)")


__all__ = ["Backend", "OpBackend", "BackendRegistry", "Choice"]
