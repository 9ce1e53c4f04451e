"""The simulated backend: :class:`SimulatedBackend` (the probe interface of
:mod:`dptune.backends.base`) and :func:`estimate_memory`, over the ledger of
:mod:`dptune.backends.simulated.ledger` (whose docstring says what is modelled and what is not)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn

from dptune.step import tree as _tree
from dptune._torch_private import fake_tensor_mode, new_shape_env
from dptune.backends.base import Capabilities, ModelFacts, ProbeResult
from dptune.hardware.cluster import DEFAULT_CLUSTER, Cluster, parse_cluster
from dptune.backends.simulated.allocator import Event
from dptune.backends.simulated.allocator_config import AllocatorConfig
from dptune.backends.simulated.balance_map import balance_map
from dptune.backends.simulated.even_line import even_line
from dptune.backends.simulated.look import look_past
from dptune.backends.simulated.reserved import (ReservedFigures, ReservedModel, TraceRecorder, canonical_traces,
                                                level_settings)
from dptune.hardware.speeds import cluster_speeds
from dptune.backends.simulated import sdpa as _sdpa
from dptune.backends.simulated.autocast import cuda_autocast
from dptune.backends.simulated.device_rules import HOST, device_mode
from dptune.backends.simulated.dataparallel import _first_batch_size, _SimulatedDataParallel
from dptune.backends.simulated.dispatch import _FunctionModes, _make_accountant
from dptune.backends.simulated.errors import _user_error, _ValueReadingError
from dptune.backends.simulated.fake_model import _eager, _fake_module, warmed_optimizer
from dptune.backends.simulated.ledger import _Ledger
from dptune.backends.simulated.sharing import ReplicaPlan, plan_replicas, with_card0_mirrored
from dptune.errors import DptuneError, InternalError, UsageError, UserCodeError
from dptune.split import validate_chunk_sizes
from dptune.types import BackendKind, BalanceMap, EvenLine, WindowCheck
from dptune.step.workload import (StepOutcome, StepRuntime, Workload, batch_to_args, gradient_checkpointing,
                             has_batchnorm, run_step)

__all__ = ["SimulatedBackend", "MemoryEstimate", "estimate_memory"]

_PHASES = {  # step phase -> (category of what it allocates on card 0, where, for errors)
    "forward": ("activations", "in the forward"),
    "loss": ("outputs", "in the loss on virtual card 0"),
    "backward": ("activations", "in the backward"),
    "clip": ("other", "in clip_grad_norm_ on virtual card 0"),
    "optimizer": ("optimizer", "in optimizer.step() on virtual card 0"),
    "step": ("activations", "in the step function"),
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-card peak of one simulated training step, at the three levels the tuner's probes
    have (bytes, one entry per card).

    - ``peak_bytes[i]`` (also ``allocated_bytes``): the allocated peak, comparable with
      ``torch.cuda.max_memory_allocated(i)`` over a step;
    - ``reserved_bytes[i]``: the caching allocator's reserved peak
      (``torch.cuda.max_memory_reserved(i)``), from the allocator model's replay of the step;
    - ``total_bytes[i]``: the card's total use at that peak, the reserved peak plus the CUDA
      context and NCCL's buffers (what ``nvidia-smi`` shows; the budget level ``reserved``,
      the default, checks it).

    ``reserved_bytes`` and ``total_bytes`` are ``None`` where no allocator model ran (a
    :class:`SimulatedBackend` built without ``reserved=``). ``breakdown[i]`` maps a category
    (weights, gradients, optimizer, activations, inputs, outputs, other) to the bytes it held
    at card i's allocated peak.
    """

    chunk_sizes: tuple[int, ...]
    peak_bytes: list[int]
    breakdown: list[dict[str, int]]
    baseline_bytes: list[int]          # live before the step: weights, buffers, optimizer state
    cluster: Cluster
    seconds: float = 0.0
    notes: tuple[str, ...] = ()        # what was modelled how (attention kernels, bounds...)
    # gathered output entries the loss never read, with their bytes on card 0
    unread_outputs: Optional[tuple[tuple[str, int], ...]] = None
    reserved_bytes: Optional[list[int]] = None   # max_memory_reserved per card (allocator model)
    total_bytes: Optional[list[int]] = None      # reserved + CUDA context + NCCL per card

    @property
    def allocated_bytes(self) -> list[int]:
        """The allocated peak per card (``peak_bytes``)."""
        return self.peak_bytes

    @property
    def oom_devices(self) -> list[int]:
        """Cards whose peak exceeds what the allocator can use on them."""
        return [i for i, (p, d) in enumerate(zip(self.peak_bytes, self.cluster.devices))
                if p > d.available_bytes]


class SimulatedBackend:
    """The probe interface over a virtual cluster; see the module docstring.

    The fake model and optimizer are built once and reused by every probe. The user's
    model, its weights, buffers and the RNG state are left untouched.
    """

    kind = BackendKind.SIMULATED
    #: simulate one replica per class of like cards (:mod:`dptune.backends.simulated.sharing`);
    #: False: every replica (the oracle the tests compare with)
    _share_replicas = True
    #: card 0's replica taken from a like card's where their chunks and specs are equal
    #: (:func:`dptune.backends.simulated.sharing.with_card0_mirrored`)
    _mirror_card0 = True
    #: charge the scratch CUDA's kernels allocate inside an op (:mod:`dptune.backends.simulated.scratch`);
    #: False: none, as the CPU's kernels under FakeTensorMode (the references the tests run)
    _cuda_scratch = True
    #: after a step: for each card, the card whose replica stood for it (itself when simulated)
    last_replicas: tuple[int, ...] = ()
    #: after a step: the card whose replica also stood for card 0's, if one did
    last_mirror: Optional[int] = None
    #: ``probe(chunk_sizes, output_device=k)`` gathers the outputs on card k
    capabilities = Capabilities.simulated(output_device=True, op_observer=True)
    supports_output_device = True
    #: called with every op of a step (func, args, kwargs, out, card): the time estimate's counter
    op_observer: Optional[Callable[..., None]] = None

    def __init__(self, workload: Workload, cluster: Union[str, Cluster] = DEFAULT_CLUSTER, *,
                 batch_on_card0: bool = False, reserved: Optional[ReservedModel] = None):
        self.workload = workload
        self.reserved = reserved        # the allocator model: reserved and total use per card
        self._recorder: Optional[TraceRecorder] = None
        self._step_trace: list = []
        self.cluster = parse_cluster(cluster)
        self.devices = self.cluster.devices
        self.batch_on_card0 = batch_on_card0
        self._fake_mode = fake_tensor_mode(allow_non_fake_inputs=True)
        self._symbolic = False          # data-dependent sizes as symbols (after a value read)
        self._compiled = False          # the model was a torch.compile wrapper, run eagerly
        self._ledger: Optional[_Ledger] = None
        self._module: Optional[nn.Module] = None
        self._optimizer: Any = None
        self._params: list[nn.Parameter] = []
        self._setup_bytes: list[int] = []
        self._kernels: dict[tuple[str, tuple[int, int]], int] = {}   # attention kernel choices
        self._fn_mode: Any = None
        self.has_batchnorm: Optional[bool] = (
            has_batchnorm(workload.model) if isinstance(workload.model, nn.Module) else None)
        self.gradient_checkpointing: Optional[bool] = (
            gradient_checkpointing(workload.model) if isinstance(workload.model, nn.Module) else None)

    @property
    def model_facts(self) -> ModelFacts:
        """BatchNorm and gradient checkpointing in the model (known once it is built)."""
        return ModelFacts(self.has_batchnorm, self.gradient_checkpointing)

    def describe(self) -> str:
        cap = self.cluster.describe_capability()
        return f"{self.cluster.describe()} (simulated{', ' + cap if cap else ''})"

    # -- set-up ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _modes(self, ledger: _Ledger) -> Iterator[None]:
        rng = torch.get_rng_state()
        # torch logs every op that fails under fake mode; the error reaches the user anyway
        log = logging.getLogger("torch._subclasses.fake_tensor")
        level = log.level
        log.setLevel(logging.CRITICAL)
        ledger.scratch = self._cuda_scratch
        caps = self.cluster.capabilities
        asked = [HOST]                  # the card of the last capability asked for

        def capability_of(t: torch.Tensor) -> Optional[tuple[int, int]]:
            card = asked[0] = ledger.card_of(t)
            return None if card == HOST else caps[card]

        def chosen(kernel: str, cap: tuple[int, int]) -> None:
            # a simulated card counts for every card of its class
            plan, card = ledger.sharing, asked[0]
            times = plan.replicas_for(card) if plan is not None and card != HOST else 1
            self._kernels[(kernel, cap)] = self._kernels.get((kernel, cap), 0) + times

        try:
            self._fn_mode = _FunctionModes(device_mode(ledger), _sdpa.sdpa_mode(capability_of, chosen))
            with cuda_autocast(), self._fake_mode, _make_accountant(ledger), self._fn_mode:
                yield
        finally:
            torch.set_rng_state(rng)
            log.setLevel(level)

    def _setup(self) -> None:
        if self._ledger is not None:
            return
        ledger = _Ledger(len(self.cluster))
        if self.reserved is not None:
            ledger.on_event = self._recorder = TraceRecorder(len(self.cluster))
        with self._modes(ledger):
            with ledger.on(0, "weights"):
                module, self._compiled = _eager(_fake_module(self.workload.model))
            module.train(self.workload.model.training if isinstance(self.workload.model, nn.Module) else True)
            self.has_batchnorm = has_batchnorm(module)
            self.gradient_checkpointing = gradient_checkpointing(module)
            with ledger.on(0, "weights"):
                for t in list(module.parameters()) + list(module.buffers()):
                    ledger.charge(t, 0, "weights")
            params = [p for p in module.parameters() if p.requires_grad]
            optimizer = warmed_optimizer(self.workload.optimizer, ledger, params)
        self._ledger, self._module, self._optimizer, self._params = ledger, module, optimizer, params
        self._setup_bytes = list(ledger.live)

    # -- one step ----------------------------------------------------------------------
    def estimate(self, chunk_sizes: Sequence[int], output_device: int = 0) -> MemoryEstimate:
        """Simulate one training step with this split and return per-card peaks
        (``output_device``: the card the outputs are gathered on, as DataParallel's).

        A step that reads tensor values (``nonzero``, boolean masks, ``.item()``) is run again
        with symbolic data-dependent sizes (a ``ShapeEnv``, a few times slower, so only then),
        each charged at its largest possible value; the notes say which ops were bounded.
        With an allocator model (``reserved=``) the estimate has the reserved peaks and total
        use per card too.
        """
        return self._estimated(chunk_sizes, output_device)[0]

    def _estimated(self, chunk_sizes: Sequence[int], output_device: int
                   ) -> tuple[MemoryEstimate, Optional[ReservedFigures]]:
        """The estimate and, with an allocator model, its replay's figures (in the estimate)."""
        try:
            est = self._estimate(chunk_sizes, output_device)
        except _ValueReadingError:
            if self._symbolic:
                raise
            self.close()
            self._symbolic = True
            self._fake_mode = fake_tensor_mode(allow_non_fake_inputs=True, shape_env=new_shape_env())
            est = self._estimate(chunk_sizes, output_device)
        if self.reserved is None or self._recorder is None:
            return est, None
        fig = self.reserved.predict(self._recorder.events, self._step_trace, self.devices)
        est = dataclasses.replace(est, reserved_bytes=[s.reserved_peak for s in fig.stats],
                                  total_bytes=list(fig.total_bytes), seconds=est.seconds + fig.seconds)
        return est, fig

    def _estimate(self, chunk_sizes: Sequence[int], output_device: int) -> MemoryEstimate:
        sizes = validate_chunk_sizes(chunk_sizes, len(self.cluster))
        if not 0 <= output_device < len(self.cluster):
            raise UsageError(f"output_device={output_device}: the cluster has cards "
                             f"0..{len(self.cluster) - 1}")
        t0 = time.perf_counter()
        self._setup()
        ledger = self._ledger
        assert ledger is not None and self._module is not None
        ledger.observer = self.op_observer
        with self._modes(ledger):
            baseline = list(ledger.live)
            plan, outcome = self._shared_step(sizes, output_device)
        rep = range(len(sizes)) if plan is None else plan.rep
        self.last_replicas = tuple(rep)     # card i's figures are those of the card rep[i]
        self.last_mirror = None if plan is None else plan.mirror
        if self._recorder is not None and plan is not None:
            self._step_trace = [list(self._step_trace[r]) for r in rep]
        return MemoryEstimate(chunk_sizes=tuple(sizes), peak_bytes=[ledger.peak[r] for r in rep],
                              breakdown=[dict(ledger.peak_breakdown[r]) for r in rep],
                              baseline_bytes=baseline, cluster=self.cluster,
                              seconds=time.perf_counter() - t0, notes=self._notes(rep),
                              unread_outputs=outcome.unread_outputs)

    def _shared_step(self, sizes: list[int], output_device: int
                     ) -> tuple[Optional[ReplicaPlan], StepOutcome]:
        """The step with one replica per class (:meth:`_plan`), run again with every replica
        where the classes would not run alike, or with card 0's own where its replica would
        not run as the card's that stood for it (sharing.mirror); a user's error raised with
        card 0 mirrored is raised again by card 0's own replica, as every replica's
        simulation raises it."""
        plan = self._plan(sizes, output_device)
        failed = False
        try:
            outcome = self._measured_step(sizes, output_device, plan)
        except _ValueReadingError:
            raise
        except DptuneError:
            if plan is None or plan.mirror is None:
                raise
            failed = True
        if failed or (plan is not None and plan.unmirrored):
            # card 0's replica would not run as its class's: its own, now and from now on
            self._mirror_card0 = False
            plan = self._plan(sizes, output_device)
            outcome = self._measured_step(sizes, output_device, plan)
        if plan is not None and plan.diverged:
            # the cards of a class would not run alike: every replica, now and from now on
            self._share_replicas = False
            plan = None
            outcome = self._measured_step(sizes, output_device, None)
        return plan, outcome

    def _plan(self, sizes: list[int], output_device: int) -> Optional[ReplicaPlan]:
        """One card per class of like cards (:mod:`dptune.backends.simulated.sharing`), or
        ``None``: every card (nothing to share, or sharing is off)."""
        ledger = self._ledger
        if not self._share_replicas or len(sizes) < 2 or ledger is None:
            return None
        caps = self.cluster.capabilities
        # the card's speed too: a class stands for its cards in the time estimate as well
        speeds = cluster_speeds(self.cluster.names, self.cluster.spec)
        spec = [(self.cluster.workspace_bytes(c), caps[c], speeds[c]) for c in range(len(sizes))]
        keys = [(*spec[c], ledger.live[c], tuple(ledger.by_cat[c].values())) for c in range(len(sizes))]
        pinned = (0, output_device)
        plan = plan_replicas(sizes, keys, pinned)
        if self._mirror_card0 and not self.batch_on_card0:
            plan = with_card0_mirrored(plan, spec, pinned)
        return plan if plan.shares or plan.mirror is not None else None

    def _measured_step(self, sizes: list[int], output_device: int,
                       plan: Optional[ReplicaPlan]) -> StepOutcome:
        """One step with peaks reset before it and the allocator trace cut after it (the
        events of a step run before, with a plan that diverged, were cut already)."""
        ledger, module = self._ledger, self._module
        assert ledger is not None and module is not None
        self._kernels = {}
        ledger.bounded = {}
        restart = getattr(self.op_observer, "restart", None)
        if restart is not None:          # a step run again counts its ops once
            restart()
        mark = self._recorder.mark() if self._recorder is not None else None
        ledger.reset_peaks()
        ledger.sharing = plan
        ledger.mirror = None if plan is None or plan.mirror is None else (plan.mirror, 0)
        try:
            return self._step(sizes, output_device)
        except DptuneError:
            raise
        except Exception as e:   # user code is wrapped where it runs; this is dptune's
            raise InternalError(f"dptune's simulator failed in the simulated step "
                                f"(split {sizes}; {type(e).__name__}: {e}); this is a bug in "
                                "dptune, not in your model: please report it") from e
        finally:
            ledger.sharing, ledger.mirror = None, None
            if self._optimizer is not None:
                self._optimizer.zero_grad(set_to_none=True)
            for p in module.parameters():
                p.grad = None
            if self._recorder is not None and mark is not None:
                self._step_trace = self._recorder.cut(mark)

    def _notes(self, rep: Sequence[int] = ()) -> tuple[str, ...]:
        notes = []
        bound = self._bound_note(rep)
        if bound:
            notes.append(bound)
        if self._kernels:
            calls = ", ".join(f"{kernel} x{n} (sm {cap[0]}.{cap[1]})"
                              for (kernel, cap), n in sorted(self._kernels.items()))
            notes.append(f"attention (scaled_dot_product_attention) kernels as CUDA picks them: {calls}")
        if self._ledger is not None and self._ledger.bounded:
            notes.append("data-dependent sizes bounded by their largest possible value: " + "; ".join(
                f"{op} {how}" for op, how in sorted(self._ledger.bounded.items())))
        if self._compiled:
            notes.append("torch.compile: the model runs eagerly on the simulated cluster (compiled "
                         "kernels may keep fewer tensors)")
        cap = self.cluster.describe_capability()
        if cap:
            notes.append(f"compute capability: {cap} for cards given by size (set it with cc=)")
        return tuple(notes)

    def _bound_note(self, rep: Sequence[int]) -> str:
        """The cards whose peak a bound sets, not a measurement: cuDNN's convolution workspace
        (:mod:`dptune.backends.simulated.scratch`), charged while the convolution at the peak
        runs (``rep``: the card whose figures each card takes)."""
        ledger = self._ledger
        if ledger is None:
            return ""
        set_by = {card: ledger.peak_bound[r] for card, r in enumerate(rep) if ledger.peak_bound[r]}
        if not set_by:
            return ""
        from dptune.backends.simulated.scratch import CONV_WORKSPACE_BASE
        from dptune.units import format_bytes

        each = ", ".join(f"card {c}: {format_bytes(b)}" for c, b in set_by.items())
        return (f"a bound, not a measurement, sets the peak of {len(set_by)} card(s) ({each}): "
                f"cuDNN's convolution workspace, charged as {format_bytes(CONV_WORKSPACE_BASE)} "
                "plus the larger of the convolution's input and output (fitted on one H200; "
                "cuDNN picks the workspace), so the real peak may be lower by up to that")

    def _step(self, sizes: list[int], output_device: int = 0) -> StepOutcome:
        """One training step (:func:`dptune.step.workload.run_step`) through DataParallel over the
        virtual cards, with CUDA autocast emulated (:mod:`dptune.backends.simulated.autocast`)."""
        ledger, module, wl = self._ledger, self._module, self.workload
        assert ledger is not None and module is not None
        batch_size = sum(sizes)
        cards = tuple(i for i, c in enumerate(sizes) if c > 0)
        source = 0 if self.batch_on_card0 else HOST
        ws_keep = []   # cuBLAS/cuBLASLt workspaces, made by the warm-up step on each busy card
        plan = ledger.sharing
        for card in cards if plan is None else (c for c in cards if plan.weight[c]):
            with ledger.forced(card, "other"), ledger.unmirrored():
                ws_keep += [torch.empty(n, dtype=torch.uint8) for n in self.cluster.workspaces_bytes(card)]

        def next_batch() -> Any:
            with ledger.on(source, "inputs"), ledger.cuda_rules(False):
                try:
                    batch = wl.sample(batch_size)
                except DptuneError:
                    raise
                except Exception as e:
                    raise UserCodeError(f"sample({batch_size}) raised: {type(e).__name__}: {e}") from e
            found = _first_batch_size(batch_to_args(batch))
            if found is not None and found != batch_size:
                raise UsageError(f"sample({batch_size}) returned a batch of {found} samples; "
                                 "sample(n) must build a batch of n samples along dim 0")
            return batch

        @contextlib.contextmanager
        def phase(name: str) -> Iterator[None]:
            category, where = _PHASES[name]
            with ledger.on(0, category):
                try:
                    yield
                except DptuneError:
                    raise
                except Exception as e:
                    raise _user_error(e, where, sizes) from e

        def batch_for_loss(batch: Any) -> Any:
            # a loss function gets the batch on the output card, as the CUDA backend gives it
            if wl.loss_fn is None or source != HOST:
                return batch
            with ledger.forced(output_device, "inputs"):
                return _tree.map_tensors(lambda t: t.clone(), batch)

        single = len(self.cluster) == 1
        wrapper = _SimulatedDataParallel(module, ledger, sizes, source, single,
                                         output_device, self._fn_mode)
        try:
            with ledger.cuda_rules(True):
                outcome = run_step(wl, StepRuntime(model=wrapper, optimizer=self._optimizer,
                                                   next_batch=next_batch, batch_for_loss=batch_for_loss,
                                                   phase=phase))
        finally:
            wrapper.close()
        del ws_keep
        # on one card nothing is gathered, so unread outputs cost nothing extra
        return StepOutcome() if single else outcome

    # -- the probe interface -----------------------------------------------------------
    def probe(self, chunk_sizes: Sequence[int], output_device: int = 0) -> ProbeResult:
        est, fig = self._estimated(chunk_sizes, output_device)
        over = [(p - d.available_bytes) / d.available_bytes
                for p, d in zip(est.peak_bytes, self.devices)]
        worst = max(range(len(over)), key=lambda i: over[i])
        oom = worst if over[worst] > 0 else None
        extra: dict = {}
        if fig is not None:
            extra, oom = fig.probe_fields(), oom if oom is not None else fig.oom_card
        return ProbeResult(chunk_sizes=est.chunk_sizes, peak_bytes=tuple(est.peak_bytes),
                           oom_device=oom, breakdown=tuple(est.breakdown), seconds=est.seconds,
                           note="; ".join(("simulated",) + est.notes),
                           unread_outputs=est.unread_outputs, **extra)

    @contextlib.contextmanager
    def allocator_setting(self, config: AllocatorConfig) -> Iterator[None]:
        """Probes inside replay the step with the allocator configured as ``config`` (the
        reserved level's model; its fixed costs kept), the model's own outside. Needs an
        allocator model (``reserved=``)."""
        if self.reserved is None:
            raise InternalError("allocator_setting needs an allocator model (reserved=)")
        kept = self.reserved
        self.reserved = dataclasses.replace(kept, config=config)
        try:
            yield
        finally:
            self.reserved = kept

    def allocator_traces(self, card: int) -> list[list[Event]]:
        """Card ``card``'s allocator traces of the last probe, as the reserved level replays
        them: the set-up, the step as warm-up, the step measured (ids renamed in order of
        first use); empty without an allocator model (``reserved=``) or a probe."""
        if self._recorder is None or not self._step_trace:
            return []
        return [list(t) for t in canonical_traces([self._recorder.events[card], self._step_trace[card],
                                             self._step_trace[card]])]

    #: replays one card's look past its over point may run (a window longer than this is
    #: looked at only so far: :attr:`CardWindow.end` ``None``)
    LOOK_LIMIT = 2048

    def look_past(self, split: Sequence[int], over: Sequence[Optional[int]],
                  budgets: Sequence[int], min_chunk: int = 1) -> WindowCheck:
        """Past a largest-batch certificate's over points on this backend's allocator model
        (:func:`dptune.backends.simulated.look.look_past`, on this backend's own steps):
        ``over[i]`` the smallest chunk card ``i >= 1`` was measured over at, ``over[0]`` card
        0 looked at where not ``None`` (along the least it can take of every larger batch);
        ``budgets`` at the reserved level; ``min_chunk`` 2 under BatchNorm."""
        if self.reserved is None:
            raise InternalError("look_past needs an allocator model (reserved=)")
        return look_past(self._traces, split, over, budgets, self.reserved.config,
                         self.reserved.fixed.nccl_for(len(self.devices)), self.LOOK_LIMIT,
                         min_chunk)

    def balance_map(self, split: Sequence[int], level: float, budgets: Sequence[int],
                    min_chunk: int = 1, alike: Optional[Sequence[Hashable]] = None
                    ) -> Optional[BalanceMap]:
        """Every card's figure at every chunk of ``split``'s batch that could hold it at or
        below ``level`` of its ``budgets`` entry (the reserved level), on this backend's
        allocator model (:func:`dptune.backends.simulated.balance_map.balance_map`, on its
        own steps)."""
        if self.reserved is None:
            raise InternalError("balance_map needs an allocator model (reserved=)")
        return balance_map(self._traces, split, budgets, level, self.reserved.config,
                           self.reserved.fixed.nccl_for(len(self.devices)), min_chunk, alike)

    def even_line(self, lo: int, budgets: Sequence[int], min_chunk: int = 1,
                  upto: Optional[int] = None) -> Optional[EvenLine]:
        """The even split's largest batch past ``lo`` (an even batch known to fit) on this
        backend's allocator model (:func:`dptune.backends.simulated.even_line.even_line`, on
        its own steps); ``budgets`` at the reserved level; ``upto`` where the answer is
        expected at or below."""
        if self.reserved is None:
            raise InternalError("even_line needs an allocator model (reserved=)")
        return even_line(self._traces, lo, budgets, self.reserved.config,
                         self.reserved.fixed.nccl_for(len(self.devices)), min_chunk, upto=upto)

    def _traces(self, split: Sequence[int]) -> list[tuple[tuple[Event, ...], ...]]:
        """Every card's replay traces of one simulated step of ``split`` (set-up, the step as
        warm-up, the step measured; ids renamed in order of first use)."""
        self.estimate(split)
        assert self._recorder is not None
        return [canonical_traces([self._recorder.events[i], self._step_trace[i], self._step_trace[i]])
                for i in range(len(split))]

    def close(self) -> None:
        self._ledger = self._module = self._optimizer = None
        self._params = []




def estimate_memory(model: Union[nn.Module, Callable[[], nn.Module]], sample: Callable[[int], Any],
                    chunk_sizes: Sequence[int], cluster: Union[str, Cluster] = DEFAULT_CLUSTER, *,
                    loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                    optimizer: Optional[Callable[..., Any]] = None, amp: Optional[str] = None,
                    accumulate: int = 1, clip_grad_norm: Optional[float] = None,
                    step: Optional[Callable[[Any, Any, Any], None]] = None,
                    allocator: Any = None, nccl_bytes: Union[int, str, None] = None) -> MemoryEstimate:
    """Per-card peak memory (bytes) of one DataParallel training step on a simulated cluster,
    at the three levels the tuner's probes have (:class:`MemoryEstimate`): the allocated peak
    (``peak_bytes``), the reserved peak (``reserved_bytes``) and the total use with the CUDA
    context and NCCL (``total_bytes``), from the allocator model the tuner uses (``allocator``
    as ``PYTORCH_CUDA_ALLOC_CONF`` writes it, default the environment's; ``nccl_bytes``: NCCL's
    buffers per card, default its model's).

    ``model`` is an ``nn.Module`` or a zero-argument factory (built on the meta device);
    ``sample(batch_size)`` builds a batch; ``loss_fn(output, batch)`` the loss (default: the
    output's ``loss``, else its sum); ``optimizer`` a factory ``params -> Optimizer`` (default
    none). ``amp``, ``accumulate``, ``clip_grad_norm`` and ``step`` describe the training step
    as in :class:`dptune.step.workload.Workload`. ``chunk_sizes`` has one entry per card of
    ``cluster`` (a spec such as ``'4x24GB'`` or a :class:`Cluster`). Nothing of the model's
    size is allocated and the model, its weights and buffers are left untouched. See the
    module docstring for what is not modelled.
    """
    _, _, reserved = level_settings("reserved", None, allocator, nccl_bytes)
    backend = SimulatedBackend(Workload(model, sample, loss_fn, optimizer, amp=amp,
                                        accumulate=accumulate, clip_grad_norm=clip_grad_norm,
                                        step=step), cluster, reserved=reserved)
    try:
        return backend.estimate(chunk_sizes)
    finally:
        backend.close()
