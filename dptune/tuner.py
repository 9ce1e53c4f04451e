"""The tuner: probe a few splits, fit each card's memory, solve, verify.

:class:`Tuner` is the front door of dptune's Python API::

    tuner = Tuner(model, sample, batch_size=256, simulate="4x24GB")
    result = tuner.fit()          # a dptune.result.TuneResult
    model = result.model          # BalancedDataParallel with the chosen split

The search (``objective="balance"``): probe the even split, then a second split that
changes every card's chunk; fit each card's peak as ``intercept + slope * chunk`` from the two
points; solve for the integer split that minimises the largest share of budget
(:func:`dptune.solver.solve_balance`); verify it with one more probe. When the verified
peaks miss the prediction by more than ``tolerance`` (a fraction of the budget), or a probe
runs out of memory, refit each card on the two points nearest the last split (a secant step)
with out-of-memory chunks as caps, and try again, up to ``max_probes`` probes. Only a split
that a probe measured within every budget is returned.

``objective="max_batch"`` also needs card 0's cost per sample of the *whole* batch (the
gathered outputs and the loss live there): a probe at a second batch size gives it. The
answer is the largest batch with a split that fits every budget, verified by a probe; the
even split's largest batch is found the same way (a probe with purpose ``"even-max"``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from dptune import solver
from dptune.advice import unread_outputs_advice
from dptune.backends.base import Backend, Device, ProbeResult
from dptune.errors import BackendUnavailableError, NoFeasibleSplitError, UsageError
from dptune.result import Fit, SplitFigures, TuneResult, imbalance
from dptune.split import even_split, scale_split
from dptune.units import format_bytes, parse_bytes
from dptune.workload import Workload, has_batchnorm, model_name

__all__ = ["Tuner", "select_backend"]

OBJECTIVES = {"balance": "balance", "max_batch": "max_batch", "max-batch": "max_batch"}
#: Share of card 0's peak taken by gathered outputs above which the report gives advice.
OUTPUTS_ADVICE_SHARE = 0.15
#: Fraction of the donor card's chunk moved by the second probe.
SECOND_SPLIT_SHARE = 0.25


def _notice(message: str, verbose: bool) -> None:
    if verbose:
        print(f"dptune: {message}", file=sys.stderr)


def select_backend(workload: Workload, *, device_ids: Optional[Sequence[int]] = None,
                   simulate: Any = None, verbose: bool = True,
                   notes: Optional[list[str]] = None) -> Backend:
    """Build the backend for a workload: real GPUs when present, else the simulated cluster.

    ``simulate`` (a spec string such as ``"4x24GB"`` or a ``Cluster``) forces the simulated
    cluster. ``device_ids`` picks real GPUs and raises :class:`BackendUnavailableError` when
    they are not all visible here.
    """
    import torch

    if simulate is not None:
        if device_ids is not None:
            raise UsageError("device_ids picks real GPUs; with simulate= the cards come from the "
                             "cluster spec (e.g. simulate='2x24GB'), so give one or the other")
        from dptune.backends.simulated import SimulatedBackend

        return SimulatedBackend(workload, simulate)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_ids is not None:
        ids = list(device_ids)
        missing = [d for d in ids if not (0 <= d < have)]
        if missing:
            seen = f"{have} CUDA GPU(s) visible" if have else "no CUDA GPU visible"
            raise BackendUnavailableError(
                f"GPU(s) {missing} asked for in device_ids are not here ({seen}); "
                "pass simulate='4x24GB' (or another cluster spec) to tune on simulated cards")
    if have > 0:
        from dptune.backends.cuda import CudaBackend

        return CudaBackend(workload, device_ids=device_ids)
    from dptune.backends.simulated import DEFAULT_CLUSTER, SimulatedBackend

    msg = (f"no CUDA GPU here; tuning on the simulated cluster {DEFAULT_CLUSTER} "
           "(pass simulate= to choose the cards)")
    _notice(msg, verbose)
    if notes is not None:
        notes.append(msg)
    return SimulatedBackend(workload, DEFAULT_CLUSTER)


class Tuner:
    """Find the per-card split of a DataParallel batch that balances memory, or the largest batch.

    - ``model``, ``sample``, ``loss_fn``, ``optimizer``: the training step, as in
      :class:`dptune.workload.Workload` (``model`` may be a zero-argument factory).
    - ``batch_size``: the total batch. With ``objective="balance"`` it is kept and split;
      with ``objective="max_batch"`` (or ``"max-batch"``) it is only the starting point of
      the search: the answer may be larger or smaller.
    - ``device_ids``: real GPUs to use (default: all visible).
    - ``simulate``: a cluster spec such as ``"4x24GB"`` or a ``Cluster``: tune on simulated
      cards. ``None``: real GPUs when there are any, else the simulated ``"4x24GB"`` (with a
      one-line notice on stderr when ``verbose``).
    - ``headroom``: memory left free on every card (bytes or a string such as ``"1GiB"``);
      each card's budget is its memory minus what others use minus this.
    - ``max_probes``: the most training steps run (each one is a probe); ``tolerance``: the
      largest miss between a prediction and a probe for the fit to be trusted, as a fraction
      of the card's budget (or of its peak, where that is smaller).
    - ``backend``: an already-built backend (:class:`dptune.backends.base.Backend`); skips
      the selection above and is not closed by the tuner.
    - ``verbose``: a progress bar and notices on stderr; ``False`` prints nothing.
    - ``amp`` (``None``, ``"bf16"``, ``"fp16"``), ``accumulate``, ``clip_grad_norm``, ``step``:
      the training step's settings, as in :class:`dptune.workload.Workload`; the result
      records them (``result.settings``).
    """

    def __init__(self, model: Any, sample: Callable[[int], Any], batch_size: int = 256,
                 loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                 optimizer: Optional[Callable[[Iterable[Any]], Any]] = None, *,
                 device_ids: Optional[Sequence[int]] = None, simulate: Any = None,
                 objective: str = "balance", headroom: Union[int, str] = "1GiB",
                 verbose: bool = True, max_probes: int = 12, tolerance: float = 0.02,
                 backend: Optional[Backend] = None, amp: Optional[str] = None,
                 accumulate: int = 1, clip_grad_norm: Optional[float] = None,
                 step: Optional[Callable[[Any, Any, Any], None]] = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if objective not in OBJECTIVES:
            raise UsageError(f"objective must be 'balance' or 'max_batch', got {objective!r}")
        try:
            self.headroom_bytes = parse_bytes(headroom)
        except ValueError as e:
            raise UsageError(f"headroom: {e}") from None
        if isinstance(max_probes, bool) or not isinstance(max_probes, int) or max_probes < 3:
            raise UsageError(f"max_probes must be an int >= 3, got {max_probes!r}")
        if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 1):
            raise UsageError(f"tolerance must be a fraction of the budget in (0, 1), got {tolerance!r}")
        if device_ids is not None:
            device_ids = list(device_ids)
            if not device_ids or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                     for d in device_ids):
                raise UsageError(f"device_ids must be a non-empty list of GPU indices, got {device_ids!r}")
        self.workload = Workload(model=model, sample=sample, loss_fn=loss_fn, optimizer=optimizer,
                                 amp=amp, accumulate=accumulate, clip_grad_norm=clip_grad_norm,
                                 step=step)
        self.batch_size = batch_size
        self.objective = OBJECTIVES[objective]
        self.device_ids = device_ids
        self.simulate = simulate
        self.verbose = bool(verbose)
        self.max_probes = max_probes
        self.tolerance = float(tolerance)
        self.backend = backend

    def fit(self) -> TuneResult:
        """Run the search and return a :class:`TuneResult` (``result.model`` is wrapped).

        Raises :class:`NoFeasibleSplitError` when no split fits every budget, with
        ``shortfall_bytes`` set where known.
        """
        start = time.perf_counter()
        notes: list[str] = []
        owned = self.backend is None
        backend = self.backend
        if backend is None:
            backend = select_backend(self.workload, device_ids=self.device_ids,
                                     simulate=self.simulate, verbose=self.verbose, notes=notes)
        try:
            result = _Search(self, backend, notes).run()
        finally:
            if owned:
                backend.close()
        result.model = self._wrap(backend, result.chunk_sizes, result.notes)
        result.seconds = time.perf_counter() - start
        return result

    # ---- the wrapped model ------------------------------------------------------------
    def _wrap(self, backend: Backend, chunk_sizes: list[int], notes: list[str]) -> Any:
        """The user's model in a ``BalancedDataParallel`` with the split found.

        On real cards the model is moved to ``device_ids[0]`` (where DataParallel needs its
        parameters). On the simulated cluster it is wrapped for the cards that exist here (a
        plain pass-through on a CPU-only machine), and a model given as a factory is not
        built at all: it may be far larger than this machine's memory.
        """
        import warnings

        import torch

        from dptune.parallel import BalancedDataParallel

        if getattr(backend, "kind", "") == "cuda":
            ids = [d.index for d in backend.devices]
            model = self.workload.model() if self.workload.is_factory else self.workload.model
            assert isinstance(model, torch.nn.Module)
            return BalancedDataParallel(model.to(torch.device("cuda", ids[0])), device_ids=ids,
                                        chunk_sizes=chunk_sizes)
        module = self.workload.model
        if not isinstance(module, torch.nn.Module):
            notes.append("the model was given as a factory and simulated, so result.model is None; "
                         "wrap the real model with BalancedDataParallel(model, chunk_sizes=...) "
                         "or BalancedDataParallel.from_report(model, report_dir)")
            return None
        n = len(chunk_sizes)
        if torch.cuda.is_available() and torch.cuda.device_count() >= n:
            first = next(module.parameters(), None)
            if first is not None and first.device == torch.device("cuda", 0):
                return BalancedDataParallel(module, device_ids=list(range(n)),
                                            chunk_sizes=chunk_sizes)
        with warnings.catch_warnings():   # the pass-through is expected after a simulation
            warnings.simplefilter("ignore", UserWarning)
            return BalancedDataParallel(module, chunk_sizes=chunk_sizes)

    def _has_batchnorm(self, backend: Backend) -> bool:
        flag = getattr(backend, "has_batchnorm", None)
        if flag is not None:
            return bool(flag)
        import torch

        model = self.workload.model
        if isinstance(model, torch.nn.Module):
            return has_batchnorm(model)
        try:
            with torch.device("meta"):
                return has_batchnorm(model())
        except Exception:  # the backend will run the factory and report its errors
            return False


def _settings(workload: Workload, backend: Backend) -> Any:
    """The workload's step settings; gradient checkpointing as the backend found the model."""
    settings = workload.settings
    ckpt = getattr(backend, "gradient_checkpointing", None)
    if isinstance(ckpt, bool) and ckpt != settings.gradient_checkpointing:
        settings = dataclasses.replace(settings, gradient_checkpointing=ckpt)
    return settings


class _Search:
    """One run of the search against one backend (internal)."""

    def __init__(self, tuner: Tuner, backend: Backend, notes: list[str]):
        self.t = tuner
        self.backend = backend
        self.notes = notes
        self.devices: list[Device] = list(backend.devices)
        self.n = len(self.devices)
        if self.n == 0:
            raise BackendUnavailableError("the backend has no devices")
        self.budgets = [d.budget_bytes(tuner.headroom_bytes) for d in self.devices]
        self.available = [d.available_bytes for d in self.devices]
        self.B = tuner.batch_size
        self.bn = tuner._has_batchnorm(backend)
        self.m = 2 if self.bn else 1
        self.tol = tuner.tolerance
        self.probes: list[ProbeResult] = []
        self.cache: dict[tuple[int, ...], ProbeResult] = {}
        # per card: (chunk, batch, peak, bound); bound: the card ran out of memory there, so the
        # peak is a lower bound (its memory), used only paired with a measured point
        self.points: list[list[tuple[int, int, int, bool]]] = [[] for _ in range(self.n)]
        self.g0: Optional[float] = None   # card 0's bytes per sample of the whole batch
        self.solid: set[int] = set()        # cards whose last fit rests on two measured points
        self._used_bound = False
        # per card: chunks that ran out of memory, with the batch they were at
        self.ooms: list[list[tuple[int, int]]] = [[] for _ in range(self.n)]
        self.pred: dict[tuple[int, ...], list[float]] = {}
        self.bar: Any = None

    # ---- probing ----------------------------------------------------------------------
    @property
    def left(self) -> int:
        return self.t.max_probes - len(self.probes)

    def probe(self, split: Sequence[int], purpose: str) -> ProbeResult:
        key = tuple(int(c) for c in split)
        if key in self.cache:
            return self.cache[key]
        if any(0 < c < self.m for c in key):  # pragma: no cover - guarded by callers
            raise AssertionError(f"split {key} gives a card 1 sample with BatchNorm")
        r = self.backend.probe(list(key))
        if len(r.peak_bytes) != self.n or tuple(r.chunk_sizes) != key:
            raise RuntimeError(f"backend returned a probe for {r.chunk_sizes} with "
                               f"{len(r.peak_bytes)} peaks; asked for {key}")
        r = dataclasses.replace(r, purpose=purpose)
        self.probes.append(r)
        self.cache[key] = r
        b = sum(key)
        if r.feasible:
            for i, (c, p) in enumerate(zip(key, r.peak_bytes)):
                if i == 0 or c > 0:
                    self.points[i].append((c, b, int(p), False))
        else:
            # the card that ran out needed more than it had: a lower bound, used as a point
            # (a secant through it moves the next split off that card)
            d = int(r.oom_device)  # type: ignore[arg-type]
            self.ooms[d].append((key[d], b))
            if d == 0 or key[d] > 0:
                self.points[d].append((key[d], b, max(int(r.peak_bytes[d]), self.available[d] + 1),
                                       True))
        if self.bar is not None:
            self.bar.update(1)
        return r

    def within_budget(self, r: ProbeResult) -> bool:
        return r.feasible and all(p <= b for i, (p, b, c) in enumerate(
            zip(r.peak_bytes, self.budgets, r.chunk_sizes)) if i == 0 or c > 0)

    def measured_max_share(self, r: ProbeResult) -> float:
        return max(solver.shares_of(r.peak_bytes, self.budgets, r.chunk_sizes))

    def error(self, r: ProbeResult) -> float:
        """Largest miss of the prediction for this probe, as a share of each card's budget, or
        of its peak where that is smaller (a small model on a large card needs the finer scale)."""
        pred = self.pred.get(tuple(r.chunk_sizes))
        if pred is None or not r.feasible:
            return math.inf
        out = 0.0
        for i, (p, q, b, c) in enumerate(zip(r.peak_bytes, pred, self.budgets, r.chunk_sizes)):
            if i == 0 or c > 0:
                scale = min(b, max(p, q))
                out = max(out, abs(p - q) / scale if scale > 0 else math.inf)
        return out

    # ---- caps and fits ----------------------------------------------------------------
    def caps(self, batch_size: int) -> list[Optional[int]]:
        """Largest chunk per card, from out-of-memory probes (card 0: at batches >= theirs)."""
        out: list[Optional[int]] = []
        for i in range(self.n):
            cs = [c for c, b in self.ooms[i] if i > 0 or b <= batch_size or self.t.objective == "max_batch"]
            out.append(min(cs) - 1 if cs else None)
        return out

    def fits(self, target: Sequence[int], batch_size: int, batch_term: bool
             ) -> Optional[list[Fit]]:
        """One fit per card near ``target`` (a split at ``batch_size``); ``None`` if too few points.

        Each card is fitted on two points near the target chunk (a secant): the nearest
        measured point and the nearest other one (possibly an out-of-memory bound). Without
        ``batch_term`` card 0 uses only points at ``batch_size`` (its batch term is then in
        the intercept). With ``batch_term`` card 0's cost per sample of the whole batch is
        estimated once, from its first measured points at two batch sizes, and kept; the
        other cards' memory does not depend on the batch. A card with a single chunk
        measured borrows the median slope of the others.
        """
        if batch_term and self.g0 is None:
            real = self._dedup([p for p in self.points[0] if not p[3]], None)
            if len({p[1] for p in real}) >= 2 and len(real) >= 3:
                try:
                    self.g0 = max(0.0, solver.fit_affine([p[:3] for p in real],
                                                         batch_term=True).batch_slope_bytes)
                except ValueError:
                    pass
        g = self.g0 if batch_term and self.g0 is not None else 0.0
        fits: list[Optional[Fit]] = [None] * self.n
        self.solid = set()
        for i in range(self.n):
            pts = self.points[i]
            if i == 0:
                if g or (batch_term and self.n == 1):
                    pts = [(c, b, int(m - g * b), bd) for c, b, m, bd in pts]
                elif len({p[0] for p in pts if p[1] == batch_size and not p[3]}) >= 1:
                    pts = [p for p in pts if p[1] == batch_size]
            pts = self._dedup(pts, None)
            fit_i = fits[i] = self._secant(pts, target[i], batch_size, g if i == 0 else 0.0)
            if i == 0 and not batch_term and not any(p[1] == batch_size and not p[3]
                                                     for p in self.points[0]):
                fits[0] = self._card0_from_smaller(batch_size) or fits[0]
            elif fit_i is not None and fit_i.points >= 2 and not self._used_bound:
                self.solid.add(i)
        slopes = sorted(f.slope_bytes for f in fits if f is not None)
        if not slopes:
            return None
        med = slopes[len(slopes) // 2]
        others = [f for i, f in enumerate(fits) if i > 0 and f is not None]
        out: list[Fit] = []
        for i, f in enumerate(fits):
            if f is None:
                pts = sorted(self.points[i], key=lambda p: (p[3], abs(p[0] - target[i]),
                                                             abs(p[1] - batch_size)))
                if pts:
                    c, b, m, _ = pts[0]
                    gi = g if i == 0 else 0.0
                    f = Fit(intercept_bytes=m - med * c - gi * b, slope_bytes=med,
                            batch_slope_bytes=gi, points=1)
                elif i > 0 and others:
                    f = dataclasses.replace(others[len(others) // 2], points=0, max_error_bytes=0.0)
                else:
                    return None
            out.append(f)
        return out

    def _card0_from_smaller(self, batch_size: int) -> Optional[Fit]:
        """Card 0 measured only at a smaller batch: its slope from there, its intercept lifted
        (card 0's memory only grows with the batch) to every out-of-memory bound at this batch."""
        for b in sorted({p[1] for p in self.points[0] if not p[3] and p[1] < batch_size},
                        reverse=True):
            real = self._dedup([p for p in self.points[0] if p[1] == b and not p[3]], None)
            if len({p[0] for p in real}) < 2:
                continue
            f = self._secant(real, 0, b, 0.0)
            if f is None:
                continue
            lift = max([f.intercept_bytes] + [m - f.slope_bytes * c for c, bb, m, bd in
                                              self.points[0] if bd and bb == batch_size])
            return dataclasses.replace(f, intercept_bytes=lift)
        return None

    def _secant(self, pts: list[tuple[int, int, int, bool]], tc: int, tb: int, g: float
                ) -> Optional[Fit]:
        """Fit through the two measured points nearest ``tc``; an out-of-memory bound replaces
        the second point where it shows that fit too low (the card needed more there)."""
        def near(p: tuple[int, int, int, bool]) -> tuple:
            return (abs(p[0] - tc), abs(p[1] - tb), -p[0])

        real = sorted((p for p in pts if not p[3]), key=near)
        if not real:
            return None
        first = real[0]
        second = next((p for p in real if p[0] != first[0]), None)
        fit = None
        if second is not None:
            fit = solver.fit_affine([(first[0], first[2]), (second[0], second[2])])
        bounds = sorted((p for p in pts if p[3] and p[0] != first[0]
                         and (fit is None or fit.predict(p[0], 0) < p[2])), key=near)
        self._used_bound = bool(bounds)
        if bounds:
            fit = solver.fit_affine([(first[0], first[2]), (bounds[0][0], bounds[0][2])])
        if fit is None:
            return None
        return dataclasses.replace(fit, batch_slope_bytes=g)

    @staticmethod
    def _dedup(points: list[tuple[int, int, int, bool]], batch_size: Optional[int]
               ) -> list[tuple[int, int, int, bool]]:
        seen: dict[tuple[int, int], tuple[int, int, int, bool]] = {}
        for p in points:
            if batch_size is None or p[1] == batch_size:
                seen[(p[0], p[1])] = p
        return list(seen.values())

    # ---- proposals --------------------------------------------------------------------
    def fix_batchnorm(self, split: list[int]) -> list[int]:
        """No card gets exactly 1 sample when the model has BatchNorm."""
        if self.m < 2:
            return split
        split = list(split)
        for j in range(len(split)):
            if split[j] == 1:
                others = [k for k in range(len(split)) if k != j and split[k] > 0]
                if not others:
                    break
                k = max(others, key=lambda k: (split[k], -k))
                split[j] = 0
                split[k] += 1
        return split

    def shift(self, base: Sequence[int], r: Optional[ProbeResult]) -> list[int]:
        """A split with every card changed: the heaviest card (or the one that ran out of
        memory) gives a share of its samples, in equal parts, to every other card."""
        n = self.n
        base = list(base)
        if r is not None and not r.feasible:
            donor = int(r.oom_device)  # type: ignore[arg-type]
        elif r is not None:
            s = solver.shares_of(r.peak_bytes, self.budgets, r.chunk_sizes)
            donor = max(range(n), key=lambda i: (s[i], -i))
        else:
            donor = 0
        if base[donor] == 0:  # nothing to give: the fullest card gives instead
            donor = max(range(n), key=lambda i: (base[i], -i))
        receivers = [i for i in range(n) if i != donor]
        streak = 0  # the donor ran out of memory this many times in a row: move more each time
        for q in reversed(self.probes):
            if q.feasible or q.oom_device != donor or q.batch_size != sum(base):
                break
            streak += 1
        share = min(1.0, SECOND_SPLIT_SHARE * 2 ** max(0, streak - 1))
        k = max(1, round(share * base[donor] / max(1, len(receivers))))
        k = min(k, base[donor] // max(1, len(receivers)))
        out = list(base)
        if k >= 1:
            for i in receivers:
                give = k if out[i] > 0 else max(k, self.m)
                if out[donor] - give < 0:
                    continue
                out[i] += give
                out[donor] -= give
        else:  # fewer samples than receivers: one each to the lightest
            s = solver.shares_of(r.peak_bytes, self.budgets, r.chunk_sizes) if r is not None \
                and r.feasible else [0.0] * n
            for i in sorted(receivers, key=lambda i: (s[i], i)):
                give = 1 if out[i] > 0 else self.m
                if out[donor] >= give:
                    out[i] += give
                    out[donor] -= give
        return self.fix_batchnorm(out)

    # ---- the search -------------------------------------------------------------------
    def run(self) -> TuneResult:
        if self.bn and self.B < 2:
            raise UsageError("batch_size=1 cannot be trained through BatchNorm "
                             "(it needs more than 1 sample per card); use batch_size >= 2")
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.t.max_probes, desc="probing", unit="probe", file=sys.stderr,
                        disable=not self.t.verbose, leave=True)
        try:
            if self.t.objective == "balance":
                res = self.run_balance()
            else:
                res = self.run_max_batch()
        finally:
            if self.bar is not None:
                self.bar.total = len(self.probes)
                self.bar.refresh()
                self.bar.close()
        return res

    def first_probes(self, batch_size: int) -> Optional[ProbeResult]:
        """The even split and a second split at this batch; returns the even probe (or None)."""
        even = even_split(batch_size, self.n)
        er: Optional[ProbeResult] = None
        if any(0 < c < self.m for c in even):
            self.notes.append(f"the even split {even} gives a card a single sample, which "
                              "BatchNorm cannot train on; it was not probed")
        else:
            er = self.probe(even, "even")
        if self.n == 1 and self.t.objective == "max_batch" and self.left > 0:
            other = batch_size // 2 if batch_size // 2 >= self.m else 2 * batch_size
            self.probe([other], "fit")
        elif self.n > 1 and self.left > 0:
            second = self.shift(even, er)
            if second != even and sum(second) == batch_size:
                self.probe(second, "fit")
        return er

    def _no_fit_proposal(self, batch_size: int) -> Optional[list[int]]:
        """A next split when the points do not yet give fits: move more off the heavy card."""
        at_b = [r for r in self.probes if r.batch_size == batch_size]
        if not at_b:
            return None
        last = at_b[-1]
        if not last.feasible and last.chunk_sizes[int(last.oom_device)] == 0:  # type: ignore[arg-type]
            return None
        prop = self.shift(last.chunk_sizes, last)
        return None if tuple(prop) in self.cache else prop

    def run_balance(self) -> TuneResult:
        B = self.B
        er = self.first_probes(B)
        accepted: Optional[ProbeResult] = None
        target = list(self.probes[-1].chunk_sizes) if self.probes else even_split(B, self.n)
        confirmed = False   # the last verify matched its prediction
        attempt = 0
        while True:
            self.check_card0_alone(B)
            fits = self.fits(target, B, batch_term=False)
            if fits is None and not any(r.feasible for r in self.probes) and B // 2 >= self.m \
                    and len(self.probes) >= 3 and self.left > 1:
                # everything ran out of memory: measure the cards at half the batch
                half = self.fix_batchnorm(scale_split(self.probes[-1].chunk_sizes, B // 2))
                r = self.probe(half, "fit")
                other = self.shift(half, r)
                if other != half and self.left > 1:
                    self.probe(other, "fit")
                fits = self.fits(target, B, batch_term=False)
            if fits is None:
                prop = self._no_fit_proposal(B)
                if prop is None or self.left <= 0:
                    break
                pred_over = False
            else:
                prop = solver.solve_balance(fits, self.budgets, B, min_chunk_nonzero=self.m,
                                            caps=self.caps(B), strict=False)
                self.pred[tuple(prop)] = solver.predict(fits, prop, B)
                pred_over = solver.max_share(fits, self.budgets, prop, B) > 1.0
                if pred_over and confirmed:
                    raise self.shortfall(fits, prop, B)
            key = tuple(prop)
            if key in self.cache:
                r = self.cache[key]
                if self.within_budget(r):
                    accepted = r
                break
            if self.left <= 0:
                break
            attempt += 1
            r = self.probe(prop, "verify" if attempt == 1 else "refine")
            target = list(prop)
            err = self.error(r)
            if self.within_budget(r) and err <= self.tol:
                accepted = r
                break
            if fits is not None and pred_over:
                if r.feasible and err <= self.tol:
                    raise self.shortfall_measured(r, B)
                if not r.feasible and self._oom_expected(r, fits):
                    raise self.shortfall(fits, prop, B)
            confirmed = r.feasible and err <= self.tol
        best = self.best_within(B)  # the lowest largest share measured (the accepted split
        if best is None:            # unless an earlier probe measured better)
            raise self.no_split(B)
        if accepted is None:
            self.notes.append(f"the fit did not settle within {self.t.max_probes} probes; "
                              "the best split measured within budget is returned")
        even_fig = self.figures(er, even_split(B, self.n))
        return self.result(best, even_fig)

    def run_max_batch(self) -> TuneResult:
        B = self.B
        er = self.first_probes(B)
        while not any(r.feasible for r in self.probes) and self.left > 1 and B > self.m:
            B = max(self.m, B // 2)  # the hint runs out of memory everywhere: halve it
            er = self.first_probes(B)
        fits0 = self.fits(list(self.probes[-1].chunk_sizes) if self.probes else even_split(B, self.n),
                          B, batch_term=False)
        reserve = 1  # keep a probe for the even split's largest batch
        accepted: Optional[ProbeResult] = None
        tb, target = B, list(self.probes[-1].chunk_sizes) if self.probes else even_split(B, self.n)
        if fits0 is not None and self.left > reserve:
            # a probe at another batch gives card 0's cost per sample of the whole batch; a
            # smaller batch is safe where this one fits (a larger one may run out of memory)
            b2 = B // 2 if B // 2 >= self.m else 2 * B
            s2 = solver.solve_balance(fits0, self.budgets, b2, min_chunk_nonzero=self.m,
                                      caps=self.caps(b2), strict=False)
            self.pred[tuple(s2)] = solver.predict(fits0, s2, b2)
            self.probe(s2, "fit")
            tb, target = b2, list(s2)
        attempt = 0
        confirmed = False
        while self.left > reserve:
            fits = self.fits(target, tb, batch_term=True)
            if fits is None:
                prop = self._no_fit_proposal(tb)
                if prop is None:
                    break
                pb = tb
                pred_over = False
            else:
                try:
                    pb, prop = solver.solve_max_batch(fits, self.budgets, min_chunk_nonzero=self.m,
                                                      caps=self.caps(tb))
                    pred_over = False
                except NoFeasibleSplitError:
                    if confirmed or self.best_within(None) is not None:
                        break  # the fit has gone astray; keep what was measured
                    pb = self.m
                    prop = solver.solve_balance(fits, self.budgets, pb, min_chunk_nonzero=self.m,
                                                caps=self.caps(pb), strict=False)
                    pred_over = True
                self.pred[tuple(prop)] = solver.predict(fits, prop, pb)
            key = tuple(prop)
            if key in self.cache:
                r = self.cache[key]
                if self.within_budget(r):
                    accepted = r
                break
            attempt += 1
            r = self.probe(prop, "verify" if attempt == 1 else "refine")
            tb, target = pb, list(prop)
            err = self.error(r)
            if self.within_budget(r) and err <= self.tol:
                accepted = r
                break
            if pred_over and r.feasible and err <= self.tol:
                raise self.shortfall_measured(r, pb)
            confirmed = r.feasible and err <= self.tol
        best = self.best_within(None)  # the largest batch measured within budget
        if best is None:
            raise self.no_split(B)
        if accepted is None:
            self.notes.append(f"the fit did not settle within {self.t.max_probes} probes; "
                              "the largest batch measured within budget is returned")
        even_fig = self.even_max(best)
        if even_fig is not None and even_fig.feasible and even_fig.batch_size > best.batch_size:
            best = self.cache[tuple(even_fig.chunk_sizes)]  # the even split did better: say so
            self.notes.append("the even split fitted a larger batch than the balanced search")
        if even_fig is None:
            even_fig = self.figures(er, even_split(B, self.n))
            self.notes.append("the even split's largest batch could not be verified by a probe; "
                              f"the even split at batch size {B} is shown instead")
        # is the next batch out of reach? measured where a probe is left, else predicted
        while True:
            fits = self.fits(list(best.chunk_sizes), best.batch_size, batch_term=True)
            if fits is None:
                break
            nxt = best.batch_size + 1
            split = solver.solve_balance(fits, self.budgets, nxt, min_chunk_nonzero=self.m,
                                         caps=self.caps(nxt), strict=False)
            peaks = solver.predict(fits, split, nxt)
            worst = max((p - b, i) for i, (p, b) in enumerate(zip(peaks, self.budgets))
                        if i == 0 or split[i] > 0)
            if worst[0] > 0:
                self.notes.append(f"batch size {nxt} is predicted not to fit: card {worst[1]} "
                                  f"would be {format_bytes(worst[0])} over its budget")
                break
            if tuple(split) in self.cache or self.left <= 0:
                self.notes.append(f"batch size {nxt} is predicted to fit as {split}, but was "
                                  "not verified; the largest verified batch is returned")
                break
            self.pred[tuple(split)] = peaks
            r = self.probe(split, "refine")
            if not self.within_budget(r):
                self.notes.append(f"batch size {nxt} was measured not to fit ({split})")
                break
            best = r
        return self.result(best, even_fig)

    def even_max(self, best: ProbeResult) -> Optional[SplitFigures]:
        """The largest batch the even split fits, verified by a probe (``"even-max"``)."""
        limit: Optional[int] = None
        for _ in range(self.t.max_probes):
            fits = self.fits(even_split(best.batch_size, self.n), best.batch_size, batch_term=True)
            if fits is None:
                break
            be = solver.max_even_batch(fits, self.budgets, min_chunk_nonzero=self.m,
                                       caps=self.caps(best.batch_size), limit=limit)
            if be < 1:
                break
            split = even_split(be, self.n)
            key = tuple(split)
            if key not in self.cache:
                if self.left <= 0:
                    break
                self.pred[key] = solver.predict(fits, split, be)
                self.probe(split, "even-max")
            r = self.cache[key]
            if self.within_budget(r):
                return self.figures(r, split)
            limit = be - 1
        # the largest even split measured within budget, if any
        evens = [r for r in self.probes if list(r.chunk_sizes) == even_split(r.batch_size, self.n)
                 and self.within_budget(r)]
        if evens:
            r = max(evens, key=lambda r: r.batch_size)
            return self.figures(r, list(r.chunk_sizes))
        return None

    # ---- checks and errors ------------------------------------------------------------
    def _oom_expected(self, r: ProbeResult, fits: list[Fit]) -> bool:
        """The card that ran out was predicted to, by a fit on two measured points."""
        d = int(r.oom_device)  # type: ignore[arg-type]
        pred = self.pred.get(tuple(r.chunk_sizes))
        if pred is None:
            return False
        if d in self.solid and pred[d] >= self.available[d] * (1 - self.tol):
            return True
        # or a card fitted on two measured points is predicted well over its budget
        return any(i in self.solid and (i == 0 or r.chunk_sizes[i] > 0)
                   and pred[i] > self.budgets[i] * (1 + self.tol) for i in range(self.n))

    def check_card0_alone(self, batch_size: int) -> None:
        """Card 0 ran out of memory with no samples: nothing can fit at this batch."""
        for c, b in self.ooms[0]:
            if c == 0 and b <= batch_size:
                raise solver.infeasible_error(
                    0, None, batch_size,
                    "card 0 runs out of memory with no samples at all (master weights, "
                    "gradients, optimizer state and the gathered outputs of the whole batch)")

    def best_within(self, batch_size: Optional[int]) -> Optional[ProbeResult]:
        ok = [r for r in self.probes if self.within_budget(r)
              and (batch_size is None or r.batch_size == batch_size)]
        if not ok:
            return None
        # largest batch, then lowest largest share; ties go to the later probe
        order = {id(r): k for k, r in enumerate(self.probes)}
        return min(ok, key=lambda r: (-r.batch_size, self.measured_max_share(r), -order[id(r)]))

    def shortfall(self, fits: list[Fit], split: Sequence[int], batch_size: int
                  ) -> NoFeasibleSplitError:
        peaks = solver.predict(fits, split, batch_size)
        over = max((p - b, i) for i, (p, b) in enumerate(zip(peaks, self.budgets))
                   if i == 0 or split[i] > 0)
        return solver.infeasible_error(over[1], over[0], batch_size,
                                       f"predicted for the best split {list(split)}")

    def shortfall_measured(self, r: ProbeResult, batch_size: int) -> NoFeasibleSplitError:
        over = max((p - b, i) for i, (p, b, c) in enumerate(
            zip(r.peak_bytes, self.budgets, r.chunk_sizes)) if i == 0 or c > 0)
        return solver.infeasible_error(over[1], over[0], batch_size,
                                       f"measured for the best split {list(r.chunk_sizes)}")

    def no_split(self, batch_size: int) -> NoFeasibleSplitError:
        measured = [r for r in self.probes if r.feasible and (
            self.t.objective == "max_batch" or r.batch_size == batch_size)]
        if measured:
            r = min(measured, key=lambda r: max(
                p - b for i, (p, b, c) in enumerate(zip(r.peak_bytes, self.budgets, r.chunk_sizes))
                if i == 0 or c > 0))
            return self.shortfall_measured(r, r.batch_size)
        oom = self.probes[-1] if self.probes else None
        card = None if oom is None else oom.oom_device
        return solver.infeasible_error(card, None, batch_size,
                                       f"every one of {len(self.probes)} probes ran out of memory")

    # ---- the result -------------------------------------------------------------------
    def figures(self, r: Optional[ProbeResult], split: list[int]) -> SplitFigures:
        if r is None:
            return SplitFigures(chunk_sizes=tuple(split), peak_bytes=tuple([0] * self.n),
                                imbalance=math.inf, feasible=False)
        return SplitFigures(chunk_sizes=tuple(r.chunk_sizes), peak_bytes=tuple(r.peak_bytes),
                            imbalance=imbalance(r.peak_bytes, self.budgets, r.chunk_sizes),
                            feasible=self.within_budget(r), oom_device=r.oom_device,
                            breakdown=r.breakdown)

    def result(self, best: ProbeResult, even: SplitFigures) -> TuneResult:
        batch_term = self.t.objective == "max_batch"
        fits = self.fits(list(best.chunk_sizes), best.batch_size, batch_term=batch_term)
        if fits is None:  # a single card, or a single split measured
            fits = [Fit(intercept_bytes=float(p), slope_bytes=0.0, points=1) for p in best.peak_bytes]
        res = TuneResult(
            objective=self.t.objective, backend=str(getattr(self.backend, "kind", "unknown")),
            cluster=self.backend.describe(), model_name=model_name(self.t.workload.model),
            devices=list(self.devices), headroom_bytes=self.t.headroom_bytes,
            budget_bytes=list(self.budgets), chunk_sizes=list(best.chunk_sizes),
            peak_bytes=list(best.peak_bytes), even=even, probes=list(self.probes), fits=fits,
            breakdown=list(best.breakdown) if best.breakdown is not None else None,
            requested_batch_size=self.t.batch_size, advice=[], notes=list(self.notes),
            settings=_settings(self.t.workload, self.backend))
        if self.bn:
            res.notes.append("the model has BatchNorm: every card gets 0 or at least 2 samples")
        res.advice.extend(self.advice(best, even, fits))
        return res

    def advice(self, best: ProbeResult, even: SplitFigures, fits: list[Fit]) -> list[str]:
        out = []
        bd = even.breakdown if even.breakdown is not None else best.breakdown
        peaks = even.peak_bytes if even.breakdown is not None else best.peak_bytes
        unread = unread_outputs_advice(best.unread_outputs, best.peak_bytes[0])
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
        s = solver.shares_of(best.peak_bytes, self.budgets, best.chunk_sizes)
        used_others = [s[i] for i in range(1, self.n) if best.chunk_sizes[i] > 0]
        if self.n > 1 and best.chunk_sizes[0] == 0 and used_others \
                and s[0] > max(used_others) * (1 + self.tol):
            fixed = fits[0].predict(0, best.batch_size)
            out.append(
                f"no split can balance these cards: card 0 is the heaviest even with no samples "
                f"(it holds {format_bytes(fixed)} for the master weights, gradients, optimizer "
                f"state and the whole batch's outputs: {s[0]:.0%} of its budget, while the "
                f"others reach at most {max(used_others):.0%}); the split given is the best "
                "possible, not a balanced one. Returning only the loss from forward, a larger "
                "card 0, or a smaller optimizer state would help")
        return out
