"""Real GPUs or simulated cards, decided once: :func:`choose_backend` (the one place that
decides), :class:`BackendChoice` (what it decided), :func:`build_backend` (the backend it
names) and :func:`timed` (a simulated backend whose probes carry their estimated time).

Below the tuner, the length plans and the integrations, which all choose and build their
cards here; the two backends are imported only when built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dptune.backends.base import Backend, capabilities
from dptune.errors import UsageError
from dptune.types import BackendKind

__all__ = ["BackendChoice", "choose_backend", "build_backend", "timed"]


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class BackendChoice:
    """Real GPUs or simulated cards, decided once (:func:`choose_backend`).

    ``cluster`` is the simulated cluster (``None``: real GPUs, ``device_ids`` of them or all
    ``visible`` ones); ``notice`` is said once when dptune chose the default cluster itself.
    Give it to :class:`dptune.Tuner` (``choice=``) so that the run does not decide again.
    """

    cluster: Any = None
    device_ids: Optional[list[int]] = None
    notice: Optional[str] = None
    visible: int = 0                 # GPUs visible when all of them were chosen

    @property
    def simulated(self) -> bool:
        return self.cluster is not None

    @property
    def kind(self) -> BackendKind:
        return BackendKind.SIMULATED if self.simulated else BackendKind.CUDA

    @property
    def cards(self) -> int:
        """How many cards the run will use."""
        if self.simulated:
            return len(self.cluster)
        return len(self.device_ids) if self.device_ids is not None else self.visible


def choose_backend(device_ids: Optional[Sequence[int]] = None, simulate: Any = None
                   ) -> BackendChoice:
    """Are the GPUs asked for here, else simulate: the one place that decides.

    ``simulate`` (a spec such as ``"4x24GB"`` or a ``Cluster``) forces simulated cards;
    ``device_ids`` picks real GPUs and raises :class:`BackendUnavailableError` when they are
    not all visible; neither: every visible GPU, or the simulated ``4x24GB`` when none is.
    """
    from dptune.hardware.cluster import DEFAULT_CLUSTER, parse_cluster

    if simulate is not None and device_ids is not None:
        raise UsageError("give real GPUs (device_ids=, --devices) or simulated cards "
                         "(simulate=, --simulate), not both")
    if simulate is not None:
        return BackendChoice(cluster=parse_cluster(simulate))
    if device_ids is not None:
        from dptune.backends.cuda import check_devices

        return BackendChoice(device_ids=check_devices(device_ids))
    have = _visible_gpus()
    if have == 0:
        return BackendChoice(cluster=parse_cluster(DEFAULT_CLUSTER),
                             notice=f"no GPU is visible: simulating {DEFAULT_CLUSTER} "
                                    "(choose the cards with --simulate SPEC or simulate=)")
    return BackendChoice(visible=have)


def build_backend(workload: Any, choice: BackendChoice, isolated: Any = None,
                  reserved: Any = None) -> Backend:
    """The backend ``choice`` names; with ``isolated``, real cards probed in child processes
    that rebuild the workload from that spec; ``reserved``: the allocator model of simulated
    cards (real cards measure their reserved memory)."""
    if choice.simulated:   # Tuner.from_spec refuses isolate=True on simulated cards
        from dptune.backends.simulated.backend import SimulatedBackend

        return SimulatedBackend(workload, choice.cluster, reserved=reserved)
    from dptune.backends.cuda import CudaBackend

    if isolated is not None:
        return CudaBackend(isolated, device_ids=choice.device_ids, isolate=True)
    return CudaBackend(workload, device_ids=choice.device_ids)


def timed(backend: Backend) -> Backend:
    """A simulated backend whose probes carry the step's estimated time."""
    if capabilities(backend).op_observer:
        from dptune.backends.simulated.timing import TimedBackend

        return TimedBackend(backend)
    return backend
