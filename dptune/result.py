"""The tuner's result: what was probed, what was fitted, the chosen split, and the even split.

A :class:`TuneResult` holds everything needed to rebuild a report; ``to_dict``/``from_dict``
round-trip it through ``report.json`` (``REPORT_VERSION``). Memory figures are ``int`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from dptune.backends.base import Device, ProbeResult
from dptune.search.observations import Bracket
from dptune.solver import Fit

if TYPE_CHECKING:  # pragma: no cover
    import pandas
    import torch

__all__ = ["Fit", "Bracket", "SplitFigures", "TuneResult", "REPORT_VERSION", "shares", "imbalance"]

REPORT_VERSION = 1


def shares(peak_bytes: Sequence[int], budget_bytes: Sequence[int]) -> list[float]:
    """Each card's peak as a share of its budget."""
    return [p / b if b > 0 else float("inf") for p, b in zip(peak_bytes, budget_bytes)]


def imbalance(peak_bytes: Sequence[int], budget_bytes: Sequence[int],
              chunk_sizes: Sequence[int]) -> float:
    """max/min share of budget over the cards that hold samples (1.0 is perfectly balanced).

    Card 0 with no samples is left out: it runs no replica, so what it holds (the master
    weights, the gradients, the optimizer state, the gathered outputs) is a floor that no split
    changes (:attr:`TuneResult.card0_floor` says when that floor is the largest share).
    """
    s = [x for i, x in enumerate(shares(peak_bytes, budget_bytes)) if chunk_sizes[i] > 0]
    if not s:
        return float("inf")
    lo = min(s)
    return max(s) / lo if lo > 0 else float("inf")


@dataclass(frozen=True)
class SplitFigures:
    """A split and what a probe measured for it (used for the even-split comparison)."""

    chunk_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    imbalance: float
    feasible: bool = True
    oom_device: Optional[int] = None
    breakdown: Optional[tuple[dict[str, int], ...]] = None

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    def to_dict(self) -> dict[str, Any]:
        return dict(chunk_sizes=list(self.chunk_sizes), peak_bytes=list(self.peak_bytes),
                    imbalance=self.imbalance, feasible=self.feasible, oom_device=self.oom_device,
                    breakdown=list(self.breakdown) if self.breakdown is not None else None,
                    batch_size=self.batch_size)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SplitFigures":
        return cls(chunk_sizes=tuple(d["chunk_sizes"]), peak_bytes=tuple(d["peak_bytes"]),
                   imbalance=float(d["imbalance"]), feasible=bool(d.get("feasible", True)),
                   oom_device=d.get("oom_device"),
                   breakdown=tuple(d["breakdown"]) if d.get("breakdown") is not None else None)


@dataclass
class TuneResult:
    """What :meth:`dptune.Tuner.fit` returns.

    - ``chunk_sizes``: the chosen split, one int per card; ``batch_size`` is their sum and
      ``gpu0_bsz`` the first (for users of the old ``BalancedDataParallel``).
    - ``peak_bytes``/``breakdown``: from the probe that verified the split.
    - ``budget_bytes``: per card, card memory - memory taken by others - headroom.
    - ``even``: the plain even split at the same batch (for ``max_batch``: at the largest
      batch the even split fits).
    - ``probes``: every probe run, in order; ``fits``: one :class:`Fit` per card.
    - ``certified``: the answer is proven: for ``max_batch`` one more sample was measured not
      to fit (every bracket closed); for ``balance`` no split can lower the largest share.
      ``brackets``: per card ``[lo, hi)``, ``lo`` measured within budget, ``hi`` over.
    - ``output_device``: the card DataParallel gathers the outputs on (0 unless another card
      raised the largest batch; ``card0_output_batch_size`` is then the batch with card 0).
    - ``model``: the user's model wrapped in a ``BalancedDataParallel`` with this split
      (``None`` after ``load``).
    """

    objective: str
    backend: str                          # "simulated" or "cuda"
    cluster: str                          # human description of the cards
    model_name: str
    devices: list[Device]
    headroom_bytes: int
    budget_bytes: list[int]
    chunk_sizes: list[int]
    peak_bytes: list[int]
    even: SplitFigures
    probes: list[ProbeResult]
    fits: list[Fit]
    breakdown: Optional[list[dict[str, int]]] = None
    requested_batch_size: Optional[int] = None
    seconds: float = 0.0
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    certified: bool = False
    brackets: list[Bracket] = field(default_factory=list)
    output_device: int = 0
    card0_output_batch_size: Optional[int] = None
    model: Optional["torch.nn.Module"] = field(default=None, repr=False, compare=False)

    # ---- derived figures -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def gpu0_bsz(self) -> int:
        return self.chunk_sizes[0]

    @property
    def shares(self) -> list[float]:
        return shares(self.peak_bytes, self.budget_bytes)

    @property
    def imbalance(self) -> float:
        return imbalance(self.peak_bytes, self.budget_bytes, self.chunk_sizes)

    @property
    def card0_floor(self) -> bool:
        """Card 0 holds no samples and still the largest share: a floor no split can beat."""
        s = self.shares
        return self.chunk_sizes[0] == 0 and len(s) > 1 and s[0] >= max(s[1:])

    @property
    def output_device_gain(self) -> int:
        """Samples the chosen ``output_device`` adds to the largest batch over gathering on
        card 0 (0 when card 0 was kept or the comparison was not run)."""
        if self.card0_output_batch_size is None:
            return 0
        return self.batch_size - self.card0_output_batch_size

    @property
    def num_probes(self) -> int:
        return len(self.probes)

    @property
    def batch_gain(self) -> float:
        """Relative gain in batch size over the even split (0.25 means +25%)."""
        return self.batch_size / self.even.batch_size - 1.0 if self.even.batch_size else float("inf")

    # ---- views ----------------------------------------------------------------------
    @property
    def table(self) -> "pandas.DataFrame":
        """Per card: even split and its peak, dptune's split and its peak, budget, shares."""
        from dptune.report import result_table

        return result_table(self)

    def plot(self, kind: str = "peaks", ax: Any = None, show: bool = False) -> Any:
        """Draw one of the report's plots (``peaks``, ``fits``, ``max_batch``); returns the Figure."""
        from dptune.report import plot_result

        return plot_result(self, kind=kind, ax=ax, show=show)

    def save(self, directory: str) -> str:
        """Write report.json, probes.csv, summary.md and the PNG plots into ``directory``."""
        from dptune.report import write_report

        return str(write_report(self, directory))

    def summary(self) -> str:
        """The Markdown summary (what ``summary.md`` holds)."""
        from dptune.report import render_summary

        return render_summary(self)

    def __str__(self) -> str:
        from dptune.report import render_table

        return render_table(self)

    # ---- serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dict(
            version=REPORT_VERSION, objective=self.objective, backend=self.backend,
            cluster=self.cluster, model_name=self.model_name,
            devices=[d.to_dict() for d in self.devices], headroom_bytes=self.headroom_bytes,
            budget_bytes=list(self.budget_bytes), chunk_sizes=list(self.chunk_sizes),
            batch_size=self.batch_size, gpu0_bsz=self.gpu0_bsz,
            peak_bytes=list(self.peak_bytes), imbalance=self.imbalance,
            breakdown=self.breakdown, even=self.even.to_dict(),
            probes=[p.to_dict() for p in self.probes], fits=[f.to_dict() for f in self.fits],
            requested_batch_size=self.requested_batch_size, seconds=self.seconds,
            advice=list(self.advice), notes=list(self.notes), certified=self.certified,
            brackets=[b.to_dict() for b in self.brackets], output_device=self.output_device,
            card0_output_batch_size=self.card0_output_batch_size,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TuneResult":
        version = d.get("version")
        if version != REPORT_VERSION:
            from dptune.errors import UsageError

            raise UsageError(f"report version {version!r} is not supported "
                             f"(this dptune reads version {REPORT_VERSION}); re-run `dptune search`")
        return cls(
            objective=d["objective"], backend=d["backend"], cluster=d["cluster"],
            model_name=d["model_name"], devices=[Device.from_dict(x) for x in d["devices"]],
            headroom_bytes=int(d["headroom_bytes"]), budget_bytes=list(d["budget_bytes"]),
            chunk_sizes=list(d["chunk_sizes"]), peak_bytes=list(d["peak_bytes"]),
            even=SplitFigures.from_dict(d["even"]),
            probes=[ProbeResult.from_dict(p) for p in d["probes"]],
            fits=[Fit.from_dict(f) for f in d["fits"]], breakdown=d.get("breakdown"),
            requested_batch_size=d.get("requested_batch_size"), seconds=float(d.get("seconds", 0.0)),
            advice=list(d.get("advice", [])), notes=list(d.get("notes", [])),
            certified=bool(d.get("certified", False)),
            brackets=[Bracket.from_dict(b) for b in d.get("brackets", [])],
            output_device=int(d.get("output_device", 0)),
            card0_output_batch_size=d.get("card0_output_batch_size"),
        )

    @classmethod
    def load(cls, path: str) -> "TuneResult":
        """Read a result from ``report.json`` or from the report folder that holds it."""
        import json
        import os

        from dptune.errors import UsageError

        p = os.path.join(path, "report.json") if os.path.isdir(path) else path
        try:
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise UsageError(f"no report at {p!r}; give a folder written by `dptune search` "
                             "or its report.json") from None
        except json.JSONDecodeError as e:
            raise UsageError(f"{p!r} is not valid JSON ({e}); re-run `dptune search`") from None
        return cls.from_dict(data)
