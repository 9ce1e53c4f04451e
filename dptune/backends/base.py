"""The probe interface shared by the real-GPU and the simulated backends.

The tuner sees only this: a list of :class:`Device` and a ``probe(chunk_sizes)`` method that
runs one training step with that split and returns a :class:`ProbeResult`. It cannot tell
which backend it talks to. All memory figures are ``int`` bytes.

What a backend can do beyond that is declared, not probed for: :class:`Capabilities` (its
kind, whether an out-of-memory probe's peaks are exact, whether it can gather the outputs on
another card) and :class:`ModelFacts` (what it found out about the model: BatchNorm, gradient
checkpointing). dptune's backends give both; :func:`capabilities` and :func:`model_facts` read
them in one place, with the defaults of a backend that gives only the five required members
(a user's own backend, the tests' synthetic ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from dptune.types import CATEGORIES, BackendKind, Device, ProbeResult

__all__ = ["Device", "ProbeResult", "Backend", "CATEGORIES", "Capabilities", "ModelFacts",
           "capabilities", "model_facts"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do.

    - ``kind``: real cards (:attr:`BackendKind.CUDA`) or simulated ones;
    - ``exact_on_oom``: an out-of-memory probe still gives every card's whole-step peak (the
      simulator measures the whole step); on real cards the peaks of an OOM probe are only
      lower bounds;
    - ``output_device``: ``probe(sizes, output_device=k)`` gathers the outputs on card k;
    - ``op_observer``: the backend shows every op of the step to its ``op_observer`` (the
      simulator: :class:`dptune.backends.simulated.timing.TimedBackend` estimates the step's time so).
    """

    kind: str                    # a BackendKind; a foreign backend's own kind otherwise
    exact_on_oom: bool = False
    output_device: bool = False
    op_observer: bool = False

    @classmethod
    def simulated(cls, output_device: bool = True, op_observer: bool = False) -> "Capabilities":
        return cls(BackendKind.SIMULATED, exact_on_oom=True, output_device=output_device,
                   op_observer=op_observer)

    @classmethod
    def cuda(cls, output_device: bool) -> "Capabilities":
        return cls(BackendKind.CUDA, exact_on_oom=False, output_device=output_device)


@dataclass(frozen=True)
class ModelFacts:
    """What a backend found out about the user's model (``None``: not known yet, e.g. a
    model given as a factory that no probe has built)."""

    has_batchnorm: Optional[bool] = None
    gradient_checkpointing: Optional[bool] = None


@runtime_checkable
class Backend(Protocol):
    """What the tuner needs from a backend.

    Required: ``kind``, ``devices``, ``describe()``, ``probe(chunk_sizes)``, ``close()``.
    dptune's own backends also give ``capabilities`` (a :class:`Capabilities`) and
    ``model_facts`` (a :class:`ModelFacts`), read through :func:`capabilities` and
    :func:`model_facts`; a backend whose ``capabilities.output_device`` is true takes
    ``probe(chunk_sizes, output_device=k)``.
    """

    @property
    def kind(self) -> str:
        """A :class:`BackendKind`: ``"simulated"`` or ``"cuda"``."""
        ...

    @property
    def devices(self) -> Sequence[Device]:
        """The cards, in the order of ``chunk_sizes``."""
        ...

    def describe(self) -> str:
        """A short name for reports, e.g. ``'4x24GB (simulated)'`` or ``'2x NVIDIA H100'``."""
        ...

    def probe(self, chunk_sizes: Sequence[int]) -> ProbeResult:
        """Run one training step with this split; OOM is a result, not an exception.

        Errors in the user's code raise :class:`dptune.errors.UserCodeError`.
        """
        ...

    def close(self) -> None:
        """Release what the backend holds; the user's objects are as they were."""
        ...


def capabilities(backend: Any) -> Capabilities:
    """The backend's declared :class:`Capabilities`; for a backend that declares none, those
    of its ``kind`` with nothing optional (an exact OOM only for ``"simulated"``)."""
    caps = getattr(backend, "capabilities", None)
    if isinstance(caps, Capabilities):
        return caps
    kind = str(getattr(backend, "kind", "unknown"))
    if kind == BackendKind.SIMULATED:
        return Capabilities.simulated(output_device=False)
    return Capabilities(BackendKind.CUDA if kind == BackendKind.CUDA else kind)


def model_facts(backend: Any) -> ModelFacts:
    """What the backend found out about the model, read now (a simulated backend learns it
    when its first probe builds a model given as a factory)."""
    facts = getattr(backend, "model_facts", None)
    if isinstance(facts, ModelFacts):
        return facts
    flag = getattr(backend, "has_batchnorm", None)   # a backend declaring only the flag
    return ModelFacts(has_batchnorm=None if flag is None else bool(flag))
