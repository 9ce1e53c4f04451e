"""The tuner: choose the backend, run the certified search, wrap the model.

:class:`Tuner` is the front door of dptune's Python API::

    tuner = Tuner(model, sample, batch_size=256, simulate="4x24GB")
    result = tuner.fit()          # a dptune.result.model.TuneResult
    model = result.model          # BalancedDataParallel with the chosen split

The search itself lives in :mod:`dptune.search` (brackets from measured probes, fits only to
choose the next probe). Whether the cards are real GPUs or a simulated cluster is decided in
one place, :func:`dptune.backends.choice.choose_backend` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from dptune import search
from dptune.step.advice import unread_outputs_advice
from dptune.backends.base import Backend, ProbeResult, capabilities, model_facts
from dptune.backends.choice import BackendChoice, build_backend, choose_backend, timed
from dptune.backends.simulated.look import balance_map_of, even_line_of, look_past_of
from dptune.backends.simulated.reserved import ReservedModel, advice_lines
from dptune.budget import RESERVED_MODEL, BudgetLevel, at_level
from dptune.errors import BackendUnavailableError, DptuneError, NoFeasibleSplitError, UsageError
from dptune.result.model import AllocatorAnswer, SplitFigures, TuneResult, imbalance
from dptune.search.alike import device_keys
from dptune.search.messages import card0_holdings
from dptune.search.output_card import reuse, swapped, swapped_outcome
from dptune.search.throughput import check_global_batch
from dptune.settings import Budget, SearchSettings, Settings, sort_keywords
from dptune.step.spec import WorkloadSpec
from dptune.types import BackendKind, Objective
from dptune.units import format_bytes
from dptune.step.workload import Workload, min_chunk, model_name, smallest_chunk

__all__ = ["Tuner", "BackendChoice", "choose_backend"]

#: Share of card 0's peak taken by gathered outputs above which the report gives advice.
OUTPUTS_ADVICE_SHARE = 0.15

RESERVED_NOTE = ("budgets checked against the reserved level: peaks are the caching allocator's "
                 "reserved peak plus NCCL's buffers (allocated peaks in each probe's "
                 f"allocated_peak_bytes); on simulated cards {RESERVED_MODEL}")


def _notice(message: str, verbose: bool) -> None:
    if verbose:
        print(f"dptune: {message}", file=sys.stderr)


class Tuner:
    """Find the per-card split of a DataParallel batch that balances memory, or the largest batch.

    - ``model``, ``sample``, ``loss_fn``, ``optimizer``: the training step, as in
      :class:`dptune.step.workload.Workload` (``model`` may be a zero-argument factory).
    - ``batch_size``: the total batch. With ``objective="balance"`` it is kept and split
      so every card uses the same share of its memory; with ``objective="throughput"`` it is
      kept and split for the shortest step that fits every card's memory (cards differ in
      speed; a card may be left out when the step is faster without it): the memory search
      runs first, then up to ``max(3, max_probes - probes used)`` timed probes;
      with ``objective="max_batch"`` (or ``"max-batch"``) it is only the starting point of
      the search: the answer may be larger or smaller.
    - ``device_ids``: real GPUs to use (default: all visible).
    - ``simulate``: a cluster spec such as ``"4x24GB"`` or a ``Cluster``: tune on simulated
      cards. ``None``: real GPUs when there are any, else the simulated ``"4x24GB"`` (with a
      one-line notice on stderr when ``verbose``).
    - ``budget``: what each card's peak is checked against, a :class:`dptune.Budget`
      (``Budget.at(level="reserved", headroom="1GiB")``); default: the caching allocator's
      reserved peak plus the strategy's fixed costs (NCCL's buffers), with 256 MiB of headroom
      (1 GiB at ``level="allocated"``; why: :data:`dptune.budget.DEFAULT_HEADROOM`).
      On simulated cards the reserved level is predicted by a model of the allocator
      (:mod:`dptune.backends.simulated.allocator`); on real cards it is ``max_memory_reserved``.
      The shorthand keywords ``headroom=``, ``budget_level=``, ``allocator=``, ``nccl_bytes=``
      build the same object.
    - ``search``: a :class:`dptune.SearchSettings`: ``max_probes`` (the most training steps
      run, each one a probe), ``tolerance`` (the largest miss between a prediction and a
      probe for the fit to be trusted, as a fraction of the card's budget; for ``balance`` also
      the gain, relative in the largest share, below which the even split is kept) and ``verbose``;
      the keywords ``max_probes=``, ``tolerance=``, ``verbose=`` build the same object.
    - ``model`` may be a whole :class:`dptune.Workload` (then no ``sample``, ``loss_fn``,
      ``optimizer`` nor step keywords beside it).
    - ``backend``: an already-built backend (:class:`dptune.backends.base.Backend`); skips
      the selection above and is not closed by the tuner.
    - ``choice``: the cards already chosen by :func:`choose_backend` (instead of
      ``device_ids``/``simulate``), so that a caller that needed them first (the Hugging Face
      integration counts them for the default batch) and the tuner decide once.
    - ``amp`` (``None``, ``"bf16"``, ``"fp16"``), ``accumulate``, ``clip_grad_norm``, ``step``:
      the training step's settings, as in :class:`dptune.step.workload.Workload`; the result
      records them (``result.settings``).
    - A training step named by import strings (the command line's flags) is a
      :class:`dptune.step.spec.WorkloadSpec`: :meth:`from_spec` builds the tuner from it, and can
      run each probe in a child process (``isolate=True``).
    - ``output_device``: the card DataParallel gathers the outputs on (default 0). ``"auto"``
      (``max_batch``, on a backend that can probe it: the simulated cluster, or real cards with
      the built-in step) also searches
      with the outputs on the largest other card and keeps it when that fits a larger batch;
      an int forces that card. ``result.output_device``, ``result.output_device_gain``.
    - ``global_batch`` (``objective="throughput"``): the samples per optimizer step, trained
      as equal micro-batches with gradient accumulation; the number of micro-batches and the
      micro-batch's split that finish it fastest are chosen together (``batch_size`` is
      where the memory search runs; the result is the micro-batch's split, its notes and
      advice say how many micro-batches).
    """

    def __init__(self, model: Any, sample: Optional[Callable[[int], Any]] = None, batch_size: int = 256,
                 loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                 optimizer: Optional[Callable[[Iterable[Any]], Any]] = None, *,
                 objective: Union[str, Objective] = Objective.BALANCE,
                 device_ids: Optional[Sequence[int]] = None, simulate: Any = None,
                 budget: Optional[Budget] = None, search: Optional[SearchSettings] = None,
                 output_device: Union[int, str] = 0, global_batch: Optional[int] = None,
                 **keywords: Any):
        kw = sort_keywords("Tuner()", keywords, budget=budget, search=search, own=("backend", "choice"))
        backend: Optional[Backend] = kw.rest.get("backend")
        choice: Optional[BackendChoice] = kw.rest.get("choice")
        #: every setting, checked once (:class:`dptune.settings.Settings`)
        self.settings = Settings.for_tuner(
            batch_size=batch_size, objective=objective, budget=kw.budget, search=kw.search,
            device_ids=device_ids, simulate=simulate, output_device=output_device, choice=choice)
        self.workload = _workload(model, sample, loss_fn, optimizer, kw.step)
        self.backend = backend
        self.choice = choice
        self._isolated: Optional[WorkloadSpec] = None    # set by from_spec(isolate=True)
        #: the speed figures of the last fit (even, memory-balanced, fastest), when timed
        self.speed: tuple = ()
        self.global_batch = check_global_batch(global_batch, self.objective, self.workload.accumulate)

    # read-only: a tuner's settings are fixed when it is made (the others: ``tuner.settings``)
    @property
    def objective(self) -> Objective:
        assert self.settings.objective is not None
        return self.settings.objective

    @property
    def batch_size(self) -> int:
        assert self.settings.batch_size is not None
        return self.settings.batch_size

    @property
    def headroom_bytes(self) -> int:
        return self.settings.budget.headroom_bytes

    @property
    def budget_level(self) -> BudgetLevel:
        return self.settings.budget.level

    @property
    def reserved_model(self) -> Optional[ReservedModel]:
        """The allocator model at the reserved level on simulated cards (else ``None``)."""
        return self.settings.budget.reserved

    @classmethod
    def from_spec(cls, spec: WorkloadSpec, batch_size: int = 256, *, isolate: bool = False,
                  device_ids: Optional[Sequence[int]] = None, simulate: Any = None,
                  **options: Any) -> "Tuner":
        """A tuner for the training step ``spec`` names (``options``: the other arguments of
        :class:`Tuner`, e.g. ``objective``, ``headroom``, ``output_device``).

        ``isolate=True`` runs each probe on the real cards in a spawned child process that
        rebuilds the step from ``spec`` (a sticky CUDA error then costs only that child); it
        does not apply to simulated cards. The cards are checked before the user's modules
        are imported, so a bad cluster spec is a usage error first.
        """
        choice = choose_backend(device_ids, simulate)
        if isolate and choice.simulated:
            if simulate is None:
                raise BackendUnavailableError(
                    "isolate=True (--isolate) runs each probe on real GPUs, and no GPU is visible "
                    "here; drop isolate to tune on the simulated cluster (simulate=, --simulate)")
            raise UsageError("isolate=True (--isolate) runs each probe on real GPUs in a child "
                             "process; it does not apply to simulated cards (simulate=, --simulate)")
        tuner = cls(spec.build(), batch_size=batch_size, choice=choice, **options)
        tuner._isolated = spec if isolate else None
        return tuner

    def fit_lengths(self, lengths: Any, buckets: Any = 8, **options: Any) -> Any:
        """A batch per length bucket for this step and these cards: a
        :class:`dptune.lengths.LengthPlan` (see :func:`dptune.lengths.fit.fit_lengths`)."""
        from dptune.lengths.fit import fit_lengths

        return fit_lengths(self, lengths, buckets, **options)

    def fit(self) -> TuneResult:
        """Run the search and return a :class:`TuneResult` (``result.model`` is wrapped).

        Raises :class:`NoFeasibleSplitError` when no split fits every budget, with
        ``shortfall_bytes`` set where known.
        """
        start = time.perf_counter()
        notes: list[str] = []
        backend = timed(self._open_backend(notes))
        card0_batch: Optional[int] = None
        out_dev = 0
        try:
            outcome = self._search(backend)
            k = self._output_candidate(backend)
            if k:
                outcome, card0_batch, out_dev = self._gather_on(backend, outcome, k, notes)
            other = self._other_allocator(backend, outcome, out_dev, notes)
        finally:
            if self.backend is None:
                backend.close()
        speed_advice: list[str] = []
        if any(r.time is not None for r in outcome.probes):
            outcome = self._speed(backend, outcome, notes, speed_advice)
        notes.extend(outcome.notes)
        if self.settings.budget.level is BudgetLevel.RESERVED:
            notes.append(RESERVED_NOTE)
        chunk_sizes = list(outcome.best.chunk_sizes)
        if self._min_chunk(backend) > 1:
            notes.append("the model has BatchNorm: every card gets 0 or at least 2 samples")
        model = self._wrap(backend, chunk_sizes, notes, out_dev)
        budgets = [d.budget_bytes(self.settings.budget.headroom_bytes) for d in backend.devices]
        even = dataclasses.replace(_figures(outcome.even, list(outcome.even_split), budgets),
                                   implied_by=outcome.even_implied_by,
                                   open_bracket=outcome.even_open, at_most=outcome.even_at_most,
                                   on_model=outcome.even_on_model)
        best = outcome.best
        return TuneResult(
            objective=self.objective.value, backend=str(capabilities(backend).kind),
            cluster=backend.describe(), model_name=model_name(self.workload.model),
            devices=list(backend.devices), headroom_bytes=self.settings.budget.headroom_bytes,
            budget_bytes=budgets, chunk_sizes=chunk_sizes, peak_bytes=list(best.peak_bytes),
            even=even, probes=list(outcome.probes), fits=list(outcome.fits),
            breakdown=list(best.breakdown) if best.breakdown is not None else None,
            requested_batch_size=self.batch_size, seconds=time.perf_counter() - start,
            advice=(_advice(best, even, outcome, budgets) + _output_device_advice(out_dev)
                    + advice_lines(best) + speed_advice
                    + ([other.advice(best.batch_size)] if other is not None else [])),
            notes=notes,
            certified=outcome.certified, brackets=list(outcome.brackets), model=model,
            output_device=out_dev, card0_output_batch_size=card0_batch,
            allocator_answer=other, looked_past=outcome.window,
            balance_map=outcome.mapped,
            settings=_settings(self.workload, backend))

    def _open_backend(self, notes: list[str]) -> Backend:
        """The backend given, else the one the cards chosen name (said once in ``notes``)."""
        if self.backend is not None:
            return self.backend
        choice = self.choice or choose_backend(self.settings.device_ids, self.settings.simulate)
        self.settings.budget.check_cards(choice.simulated)
        if choice.notice is not None:
            _notice(choice.notice, self.settings.verbose)
            notes.append(choice.notice)
        return build_backend(self.workload, choice, self._isolated, self.settings.budget.reserved)

    def _gather_on(self, backend: Backend, outcome: search.SearchOutcome, k: int,
                   notes: list[str]) -> tuple[search.SearchOutcome, Optional[int], int]:
        """The search again with the outputs gathered on card ``k``: kept when it fits a larger
        batch (or ``k`` was asked for). Returns the outcome, the batch gathering on card 0
        (``None``: card 0 kept) and the card the outputs come back on."""
        alt = self._search(backend, output_device=k, first=outcome)
        probes = outcome.probes + alt.probes
        if alt.best.batch_size > outcome.best.batch_size or self.settings.output_device == k:
            notes.append(f"outputs gathered on card {k}: batch {alt.best.batch_size} "
                         f"against {outcome.best.batch_size} gathering on card 0")
            return dataclasses.replace(alt, probes=probes, even=outcome.even,
                                       even_split=outcome.even_split,
                                       even_implied_by=outcome.even_implied_by,
                                       even_open=outcome.even_open,
                                       even_at_most=outcome.even_at_most,
                                       even_line=outcome.even_line,
                                       even_on_model=outcome.even_on_model,
                                       notes=outcome.notes + alt.notes), outcome.best.batch_size, k
        notes.append(f"gathering the outputs on card {k} fits batch "
                     f"{alt.best.batch_size}, no more than on card 0: card 0 kept")
        return dataclasses.replace(outcome, probes=probes), None, 0

    def _other_allocator(self, backend: Backend, outcome: search.SearchOutcome,
                         output_device: int, notes: list[str]) -> Optional[AllocatorAnswer]:
        """``max_batch`` on simulated cards at the reserved level, where fragmentation shows:
        the probes saw the reserved figures fall as the work grows (the answer is then not
        certified), or the answer's reserved peak lies widely over its allocated peak (the
        simulator then predicts the figure with expandable segments too,
        ``expandable_reserved_bytes``): the same search with ``expandable_segments:True``
        added to the allocator's setting, under which segments grow in place and the figure
        follows the allocated one, so that the advice can give a certified batch for it.
        ``None`` otherwise (the tuned setting is never changed: this is advice beside it)."""
        # the allocator model the backend replays (one built by the caller may carry its own)
        own = getattr(backend, "reserved", None)
        model = own if isinstance(own, ReservedModel) else self.settings.budget.reserved
        switch = getattr(backend, "allocator_setting", None)
        fragmented = (outcome.not_monotone is not None
                      or outcome.best.expandable_reserved_bytes is not None)
        if (self.objective is not Objective.MAX_BATCH or not fragmented
                or self.settings.budget.level is not BudgetLevel.RESERVED
                or not isinstance(model, ReservedModel) or model.config.expandable_segments
                or switch is None):
            return None
        config = dataclasses.replace(model.config, expandable_segments=True)
        _notice("fragmentation (the reserved figures fall as the work grows, or lie widely over "
                f"the allocated ones): searching again with {config.to_conf()} for the advice",
                self.settings.verbose)
        try:
            with switch(config):
                # advice: its batch and certificate, not its even baseline (no even line)
                alt = self._search(backend, output_device=output_device, even_line=False)
        except NoFeasibleSplitError as e:     # the answer above stands; the advice has none
            notes.append(f"with {config.to_conf()} no split was found within every budget: {e}")
            return None
        except DptuneError as e:              # advice only: it never costs the answer above
            notes.append(f"the search again with {config.to_conf()} failed, so no advice for "
                         f"it: {type(e).__name__}: {e}")
            return None
        return AllocatorAnswer(setting=config.to_conf(), chunk_sizes=tuple(alt.best.chunk_sizes),
                               peak_bytes=tuple(alt.best.peak_bytes),
                               certified=alt.certified,   # search.run withholds it on a fall
                               probes=len(alt.probes))

    def _said_mapping(self, make: Optional[Callable[..., Any]],
                      what: str = "mapping every chunk each card could take on the allocator "
                                  "model (the balance's certificate at the reserved level)"
                      ) -> Optional[Callable[..., Any]]:
        """The balance's map (or the even line) on the model, saying ``what`` on the terminal
        as it starts (the probe bar stands still meanwhile: it replays the allocator, a few
        simulated steps and thousands of replays, no probe)."""
        if make is None:
            return None

        def mapped(*args: Any, **kw: Any) -> Any:
            _notice(what, self.settings.verbose)
            return make(*args, **kw)
        return mapped

    def _search(self, backend: Backend, output_device: int = 0,
                first: Optional[search.SearchOutcome] = None,
                even_line: bool = True) -> search.SearchOutcome:
        """One search; with ``output_device=k`` the outputs are gathered on card k, and the
        search sees the cards with 0 and k swapped (its card 0 is the one that gathers).
        ``first`` (max_batch): the search gathering on card 0, whose even baseline is kept
        and whose probes still measure the cards other than 0 and k."""
        devices = list(backend.devices)
        if not devices:
            raise BackendUnavailableError("the backend has no devices")
        m = self._min_chunk(backend)
        if m == 2 and self.batch_size < 2:
            raise UsageError("batch_size=1 cannot be trained through BatchNorm "
                             "(it needs more than 1 sample per card); use batch_size >= 2")
        budgets = [d.budget_bytes(self.settings.budget.headroom_bytes) for d in devices]
        perm = list(range(len(devices)))
        perm[0], perm[output_device] = output_device, 0
        level = self.settings.budget.level

        def probe(split: Sequence[int]) -> ProbeResult:
            if not output_device:
                return at_level(backend.probe(split), devices, level)
            real = [split[perm[i]] for i in range(len(split))]
            r = at_level(backend.probe(real, output_device=output_device),  # type: ignore[call-arg]
                         devices, level)
            return dataclasses.replace(swapped(r, perm), purpose=r.purpose)
        from tqdm.auto import tqdm

        # The total is the most probes the search may run, and stays so: a search that
        # certifies its answer early ends short of it ("7/12"), it is never rewritten.
        bar = tqdm(total=self.settings.max_probes, desc="probing (at most)", unit="probe",
                   file=sys.stderr, disable=not self.settings.verbose, leave=True)
        try:
            objective = self.objective     # throughput: the balance search, mapping memory only
            extra = reuse(first, perm, self.objective)
            known = dataclasses.replace(extra.pop("known", search.Known()),
                                        alike=[device_keys(devices)[perm[i]] for i in range(len(perm))],
                                        look_past=None if output_device else
                                        look_past_of(backend, budgets, level),
                                        even_line=None if output_device or not even_line else
                                        self._said_mapping(even_line_of(backend, budgets, level),
                                                           _READING_EVEN),
                                        balance_map=None if output_device else
                                        self._said_mapping(balance_map_of(backend, budgets,
                                                                          level)))
            out = search.run(probe, [budgets[perm[i]] for i in range(len(perm))], objective,
                             self.batch_size, min_chunk=m, max_probes=self.settings.max_probes,
                             tolerance=self.settings.tolerance,
                             exact_on_oom=capabilities(backend).exact_on_oom,
                             on_probe=lambda: bar.update(1), known=known, **extra)
            return out if not output_device else swapped_outcome(out, perm, output_device)
        finally:
            bar.close()

    def _speed(self, backend: Backend, outcome: search.SearchOutcome, notes: list[str],
               advice: list[str]) -> search.SearchOutcome:
        """Time figures for the report; with ``objective="throughput"`` the fastest split of
        the batch measured within every budget (:mod:`dptune.search.throughput`)."""
        from dptune.search import throughput

        budgets = [d.budget_bytes(self.settings.budget.headroom_bytes) for d in backend.devices]
        best = outcome.best
        cluster_speed = getattr(backend, "speed", None)     # TimedBackend: the card table's
        notes.extend(getattr(cluster_speed, "notes", ()))
        if self.objective is not Objective.THROUGHPUT:
            figs = throughput.figures(outcome.probes, budgets, best.batch_size, best)
            self.speed = figs
            notes.extend(throughput.speed_notes(figs, best))
            advice.extend(throughput.advice(figs))
            return outcome
        m = self._min_chunk(backend)
        def probe(split: Sequence[int]) -> ProbeResult:     # at the budget level, as the search's
            return at_level(backend.probe(split), backend.devices, self.budget_level)
        fast = throughput.fastest(probe, budgets, self.batch_size, outcome.probes,
                                  outcome.fits, best, min_chunk=m,
                                  max_probes=max(3, self.settings.max_probes - len(outcome.probes)),
                                  global_batch=self.global_batch)
        self.speed = fast.figures
        notes.extend(fast.notes)
        advice.extend(fast.advice)
        notes.append("throughput: the split is measured within every budget; its step time is "
                     + ("measured" if fast.best.time is not None and fast.best.time.source.value
                        == "measured" else "estimated") + " and the fastest the time fits predict, "
                     "not proven the fastest of all splits")
        return dataclasses.replace(outcome, best=fast.best, probes=fast.probes, card0_floor=False,
                                   certified=False,
                                   notes=tuple(f"memory-balanced split: {n}" for n in outcome.notes))

    def _output_candidate(self, backend: Backend) -> int:
        """The card to try gathering the outputs on (0: none): the one asked for, or with
        ``"auto"`` for ``max_batch`` the card other than 0 with the largest budget."""
        n = len(backend.devices)
        if isinstance(self.settings.output_device, int) and self.settings.output_device >= n:
            raise UsageError(f"output_device={self.settings.output_device}: there are cards 0..{n - 1}")
        if self.settings.output_device == 0 or n < 2 or not capabilities(backend).output_device:
            return 0
        if isinstance(self.settings.output_device, int):
            return self.settings.output_device
        if self.objective is not Objective.MAX_BATCH:
            return 0
        budgets = [d.budget_bytes(self.settings.budget.headroom_bytes) for d in backend.devices]
        return max(range(1, n), key=lambda i: (budgets[i], -i))

    # ---- the wrapped model ------------------------------------------------------------
    def _wrap(self, backend: Backend, chunk_sizes: list[int], notes: list[str],
              output_device: int = 0) -> Any:
        """The user's model in a ``BalancedDataParallel`` with the split found.

        On real cards the model is moved to ``device_ids[0]`` (where DataParallel needs its
        parameters). On the simulated cluster it is wrapped for the cards that exist here (a
        plain pass-through on a CPU-only machine), and a model given as a factory is not
        built at all: it may be far larger than this machine's memory.
        """
        import warnings

        import torch

        from dptune.parallel import BalancedDataParallel

        if capabilities(backend).kind == BackendKind.CUDA:
            ids = [d.index for d in backend.devices]
            model = self.workload.model() if self.workload.is_factory else self.workload.model
            assert isinstance(model, torch.nn.Module)
            return BalancedDataParallel(model.to(torch.device("cuda", ids[0])), device_ids=ids,
                                        output_device=ids[output_device], chunk_sizes=chunk_sizes)
        module = self.workload.model
        if not isinstance(module, torch.nn.Module):
            notes.append("the model was given as a factory and simulated, so result.model is None; "
                         "wrap the real model with BalancedDataParallel(model, chunk_sizes=...) "
                         "or dptune.load_result(report_dir).wrap(model)")
            return None
        n = len(chunk_sizes)
        if torch.cuda.is_available() and torch.cuda.device_count() >= n:
            first = next(module.parameters(), None)
            if first is not None and first.device == torch.device("cuda", 0):
                return BalancedDataParallel(module, device_ids=list(range(n)),
                                            output_device=output_device, chunk_sizes=chunk_sizes)
        with warnings.catch_warnings():   # the pass-through is expected after a simulation
            warnings.simplefilter("ignore", UserWarning)
            return BalancedDataParallel(module, chunk_sizes=chunk_sizes)

    def _min_chunk(self, backend: Backend) -> int:
        """The fewest samples a card may get (:func:`dptune.step.workload.smallest_chunk`),
        the backend's word on BatchNorm first."""
        flag = model_facts(backend).has_batchnorm
        if flag is not None:
            return min_chunk(bool(flag))
        try:
            return smallest_chunk(self.workload.model)
        except Exception:  # the backend will run the factory and report its errors
            return 1


def _settings(workload: Workload, backend: Backend) -> Any:
    """The workload's step settings; gradient checkpointing as the backend found the model."""
    settings = workload.settings
    ckpt = model_facts(backend).gradient_checkpointing
    if isinstance(ckpt, bool) and ckpt != settings.gradient_checkpointing:
        settings = dataclasses.replace(settings, gradient_checkpointing=ckpt)
    return settings


#: what the terminal says as the even line on the model starts
_READING_EVEN = ("reading the even split's largest batch on the allocator model (every even "
                 "batch replayed until one is over)")


def _figures(r: Optional[ProbeResult], split: list[int], budgets: list[int]) -> SplitFigures:
    if r is None:
        return SplitFigures(chunk_sizes=tuple(split), peak_bytes=tuple([0] * len(split)),
                            imbalance=float("inf"), feasible=False)
    within = r.within_budget(budgets)
    return SplitFigures(chunk_sizes=tuple(r.chunk_sizes), peak_bytes=tuple(r.peak_bytes),
                        imbalance=imbalance(r.peak_bytes, budgets, r.chunk_sizes),
                        feasible=within, oom_device=r.oom_device, breakdown=r.breakdown)


def _output_device_advice(k: int) -> list[str]:
    """What a loop must do when the outputs come back on card k, not card 0."""
    if not k:
        return []
    return [f"the outputs come back on card {k} (output_device={k}): compute the loss there, with "
            f"the targets on the output's card (targets.to(output.device)); targets moved to "
            "cuda:0 would not match"]


def _advice(best: ProbeResult, even: SplitFigures, outcome: search.SearchOutcome,
            budgets: list[int]) -> list[str]:
    out = []
    bd = even.breakdown if even.breakdown is not None else best.breakdown
    peaks = even.peak_bytes if even.breakdown is not None else best.peak_bytes
    # a share of the allocated peak (at the reserved level peak_bytes holds NCCL's buffers too)
    unread = unread_outputs_advice(best.unread_outputs, (best.allocated_peak_bytes or best.peak_bytes)[0])
    if unread is not None:   # names what to drop, so the general line below is not needed
        out.append(unread)
    elif bd is not None and peaks and peaks[0] > 0:
        outputs = int(bd[0].get("outputs", 0))
        frac = outputs / peaks[0]
        if frac > OUTPUTS_ADVICE_SHARE:
            out.append(
                f"gathered outputs take {format_bytes(outputs)} ({frac:.0%}) of card 0's peak "
                "at the even split: return only the loss from forward (and reduce the "
                "per-replica losses with `model.reduce(losses)`) to free most of it")
    if outcome.card0_floor:
        s = [p / b for p, b in zip(best.peak_bytes, budgets)]
        used = [s[i] for i in range(1, len(s)) if best.chunk_sizes[i] > 0]
        holds = card0_holdings([best]).replace("gathered outputs", "whole batch's outputs")
        out.append(
            f"no split can balance these cards: card 0 is the heaviest even with no samples "
            f"(it holds {format_bytes(best.peak_bytes[0])} for the {holds}: "
            f"{s[0]:.0%} of its budget, while "
            f"the cards holding samples reach at most {max(used, default=0.0):.0%} and are "
            f"within {imbalance(best.peak_bytes, budgets, best.chunk_sizes):.3f} of each "
            "other); the split given is the best possible. Returning only the loss from "
            "forward, a larger card 0" + (", or a smaller optimizer state" if "optimizer"
                                          in holds else "") + " would help")
    return out


def _workload(model: Any, sample: Optional[Callable[[int], Any]], loss_fn: Any, optimizer: Any,
              step: Any) -> Workload:
    """The training step: ``model`` given as a :class:`Workload` (nothing else of the step
    beside it), or built from the model, ``sample`` and the step's keywords."""
    if isinstance(model, Workload):
        given = [n for n, v in (("sample", sample), ("loss_fn", loss_fn), ("optimizer", optimizer))
                 if v is not None] + sorted(step)
        if given:
            raise UsageError(f"the model is given as a Workload, which holds the whole step: drop "
                             f"{', '.join(given)} (or give them to the Workload)")
        return model
    if sample is None:
        raise UsageError("Tuner(model, sample, ...) needs sample(batch_size) -> batch, or the "
                         "whole step as a dptune.Workload")
    return Workload(model=model, sample=sample, loss_fn=loss_fn, optimizer=optimizer, **step)
