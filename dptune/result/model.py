"""The tuner's result: what was probed, what was fitted, the chosen split, and the even split.

A :class:`TuneResult` holds everything needed to rebuild a report; ``to_dict``/``from_dict``
round-trip it through ``report.json`` (``REPORT_VERSION``). Memory figures are ``int`` bytes.

The result's concerns, one module each, all below rendering (:mod:`dptune.report`) and the CLI:

- :mod:`dptune.result.figures`: the figures of a split (shares, imbalance, the budget check,
  :class:`SplitFigures`);
- :mod:`dptune.result.read`: reading ``report.json`` back, checked (:func:`load_result` and
  :meth:`TuneResult.from_dict` build the result from it);
- :mod:`dptune.result.wrap`: wrapping a model with the split (:meth:`TuneResult.wrap`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

from dptune.errors import ReportError
from dptune.result.figures import (AllocatorAnswer, BudgetCheck, GainRange, SplitFigures, budget_check,
                                   imbalance, shares)
from dptune.result.read import OBJECTIVES, REPORT_VERSION, read_json, result_fields
from dptune.result.wrap import NOT_GIVEN, wrap_model
from dptune.result.wrap import warn_settings as _warn_settings  # noqa: F401 (integrations.transformers)
from dptune.search.observations import Bracket
from dptune.solve.memory import Fit
from dptune.types import Device, MapCheck, ProbeResult, WindowCheck
from dptune.step.workload import StepSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dptune.parallel import BalancedDataParallel

__all__ = ["Fit", "Bracket", "SplitFigures", "AllocatorAnswer", "TuneResult", "REPORT_VERSION", "OBJECTIVES", "shares",
           "imbalance", "load_result", "BudgetCheck", "budget_check", "wrap_model", "NOT_GIVEN"]


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
    - ``allocator_answer``: ``max_batch`` on simulated cards at the reserved level, where the
      search showed fragmentation (the reserved figures falling as the work grows, which
      leaves the answer uncertified, or lying widely over the allocated ones): the same
      search with ``expandable_segments:True`` (:class:`AllocatorAnswer`), else ``None``.
    - ``looked_past``: ``max_batch`` on simulated cards at the reserved level with a
      certificate from the probes: what a look past its over points on the allocator model
      found (:class:`~dptune.types.WindowCheck`; a card fitting again above its over point
      leaves the answer uncertified), else ``None``.
    - ``balance_map``: ``balance`` on simulated cards at the reserved level: the balance
      solved on the allocator model's map of every chunk each card could take
      (:class:`~dptune.types.MapCheck`), else ``None``.
    - ``settings``: the training step the split was tuned for (mixed precision,
      accumulation, clipping, the user's step function); a split is only valid for it.
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
    allocator_answer: Optional[AllocatorAnswer] = None
    looked_past: Optional[WindowCheck] = None
    balance_map: Optional[MapCheck] = None
    settings: StepSettings = field(default_factory=StepSettings)
    model: Optional["torch.nn.Module"] = field(default=None, repr=False, compare=False)
    #: the report file this result was read from (set by :func:`load_result`)
    source: Optional[str] = field(default=None, repr=False, compare=False)

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
    def batch_gain(self) -> Optional[GainRange]:
        """The gain in batch size over the even split as the probes prove it (``low`` to
        ``high``; 0.25 means +25%): a range while the even split's bracket is open
        (``even.open_bracket``), ``None`` when no even split is known to fit or nothing
        bounds the gain from below."""
        return GainRange.of(self.batch_size, self.certified, self.even)

    def budget_check(self, probe: ProbeResult) -> "BudgetCheck":
        """What the search read from ``probe``: within every budget or not, and by how much."""
        return budget_check(probe, self.budget_bytes)

    def __str__(self) -> str:
        """One line; the per-card table is :func:`dptune.report.render_table`."""
        state = "certified" if self.certified else "not certified"
        return (f"TuneResult({self.model_name} on {self.cluster}: split {list(self.chunk_sizes)}, "
                f"batch {self.batch_size}, {self.objective}, {state}; "
                "dptune.report.render_table(result) prints the table)")

    # ---- using the split ---------------------------------------------------------------
    def wrap(self, model: "torch.nn.Module", device_ids: Optional[Sequence[Any]] = None, *,
             amp: Any = NOT_GIVEN, accumulate: Any = NOT_GIVEN, clip_grad_norm: Any = NOT_GIVEN,
             step: Any = NOT_GIVEN) -> "BalancedDataParallel":
        """``model`` in a :class:`~dptune.parallel.BalancedDataParallel` with this split.

        ``load_result("reports/mynet").wrap(net)`` reuses a saved split without probing again.
        See :func:`wrap_model` for the devices, the move onto the first card and the checks
        of ``amp``, ``accumulate``, ``clip_grad_norm`` and ``step``.
        """
        return wrap_model(self, model, device_ids, amp=amp, accumulate=accumulate,
                          clip_grad_norm=clip_grad_norm, step=step)

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
            advice=list(self.advice), notes=list(self.notes), settings=self.settings.to_dict(),
            certified=self.certified,
            brackets=[b.to_dict() for b in self.brackets], output_device=self.output_device,
            card0_output_batch_size=self.card0_output_batch_size,
            allocator_answer=(None if self.allocator_answer is None
                              else self.allocator_answer.to_dict()),
            looked_past=None if self.looked_past is None else self.looked_past.to_dict(),
            balance_map=None if self.balance_map is None else self.balance_map.to_dict(),
        )

    @classmethod
    def from_dict(cls, d: Any) -> "TuneResult":
        """Rebuild a result from :meth:`to_dict`'s form, checking every field.

        A missing key, a value of the wrong type, per-card lists whose length is not the
        number of cards, a negative chunk or peak, or a ``batch_size`` that is not the sum of
        the chunks raises :class:`~dptune.errors.ReportError` naming the field.
        """
        return cls(**result_fields(d))

    @classmethod
    def load(cls, path: str) -> "TuneResult":
        """Read and check a result from ``report.json`` or from the report folder that holds it.

        The one reader of report files (``dptune show``, ``dptune plot`` and
        :meth:`wrap` after ``load_result`` all come here). Any problem with the file raises
        :class:`~dptune.errors.ReportError` (a usage error, exit 2) in one line.
        """
        return load_result(path)


def load_result(path: "str | os.PathLike[str]") -> TuneResult:
    """:meth:`TuneResult.load`: read ``report.json`` (or the folder holding it) and check it."""
    p, data = read_json(path, "report.json", "report", "dptune search")
    try:
        return replace(TuneResult.from_dict(data), source=p)
    except ReportError as e:
        raise ReportError(f"the report {p!r} is not valid: {e}") from None
