"""``BalancedDataParallel``: ``torch.nn.DataParallel`` with per-device chunk sizes.

- :class:`BalancedDataParallel`: ``torch.nn.DataParallel`` whose scatter gives each device its own chunk size.
- :class:`SplitInputs`: What :func:`split_inputs` returns: one entry per device that gets samples.
- :func:`split_inputs`: Split a call's arguments into per-device calls with the given chunk sizes.
- :func:`narrow_scatter`: A scatter that splits without moving anything (views, autograd-friendly).
- :func:`find_batch_size`: ``(size along dim, path)`` of the first tensor in ``args`` then ``kwargs``, or ``None``.
- :func:`gpu0_split`: The old ``gpu0_bsz`` reading: card 0 gets ``min(gpu0_bsz, B)``, the rest share evenly.
- :func:`weighted_reduce`: Mean of per-chunk losses weighted by the chunk sizes, as a differentiable tensor op.

Design notes: docs/concepts/design-notes.md, "dptune/parallel.py".
"""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import nn

from dptune import _torch_private
from dptune.step import tree as _tree
from dptune.errors import UsageError
from dptune.split import even_split, scale_split, validate_chunk_sizes

__all__ = [
    "BalancedDataParallel", "SplitInputs", "split_inputs", "narrow_scatter", "find_batch_size",
    "gpu0_split", "weighted_reduce",
]

#: ``scatter_fn(tensor, device_ids, chunk_sizes, dim) -> tuple of chunks``
ScatterFn = Callable[[torch.Tensor, Sequence[int], Sequence[int], int], Sequence[torch.Tensor]]


# ---- pure helpers -----------------------------------------------------------------------

def gpu0_split(gpu0_bsz: int, batch_size: int, n_devices: int) -> list[int]:
    """The old ``gpu0_bsz`` reading: card 0 gets ``min(gpu0_bsz, B)``, the rest share evenly.

    The samples left after card 0 are split over the other ``n_devices - 1`` cards as evenly
    as integers allow; earlier cards get the extra samples. With one device, it gets all.
    """
    if isinstance(gpu0_bsz, bool) or not isinstance(gpu0_bsz, int) or gpu0_bsz < 0:
        raise UsageError(f"gpu0_bsz must be a non-negative int, got {gpu0_bsz!r}")
    if n_devices < 1:
        raise UsageError("gpu0_split needs at least one device")
    if batch_size < 0:
        raise UsageError(f"batch size must be >= 0, got {batch_size}")
    if n_devices == 1:
        return [batch_size]
    first = min(gpu0_bsz, batch_size)
    rest = batch_size - first
    base, extra = divmod(rest, n_devices - 1)
    return [first] + [base + (1 if i < extra else 0) for i in range(n_devices - 1)]


def weighted_reduce(losses: torch.Tensor, weights: Sequence[int]) -> torch.Tensor:
    """Mean of per-chunk losses weighted by the chunk sizes, as a differentiable tensor op.

    When each replica returns the mean loss over its own chunk, this equals the mean loss
    over the whole batch.
    A 0-dim ``losses`` (one replica, or no split) is returned as it is.
    """
    if not isinstance(losses, torch.Tensor):
        raise UsageError(f"reduce expects the tensor of per-replica losses, got {type(losses).__name__}")
    if losses.dim() == 0:
        return losses
    w = list(weights)
    if losses.dim() != 1 or losses.numel() != len(w):
        raise UsageError(
            f"reduce got losses of shape {tuple(losses.shape)} for {len(w)} replicas "
            f"(chunk sizes {w}); pass the vector the wrapper returned, one loss per replica")
    total = sum(w)
    if total <= 0:
        raise UsageError(f"chunk sizes {w} sum to 0; nothing to weight")
    wt = torch.tensor(w, dtype=losses.dtype if losses.is_floating_point() else torch.float32,
                      device=losses.device)
    return (losses * wt).sum() / total


def narrow_scatter(tensor: torch.Tensor, device_ids: Sequence[Any], chunk_sizes: Sequence[int],
                   dim: int) -> tuple:
    """A scatter that splits without moving anything (views, autograd-friendly).

    Stands in for the CUDA scatter where no GPU is involved (tests, CPU debugging).
    """
    return tuple(tensor.split(list(chunk_sizes), dim=dim))


def _args_tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _tree.tensors(tuple(args), "args")
    yield from _tree.tensors(dict(kwargs), "kwargs")


def find_batch_size(args: Sequence[Any], kwargs: Optional[dict[str, Any]], dim: int = 0
                    ) -> Optional[tuple[int, str]]:
    """``(size along dim, path)`` of the first tensor in ``args`` then ``kwargs``, or ``None``."""
    for path, t in _args_tensors(args, kwargs or {}):
        if t.dim() == 0:
            raise UsageError(
                f"{path} is a 0-dim tensor, which cannot be split along dim {dim}; pass it as a "
                "Python number, or give it a batch dimension")
        if t.dim() <= dim:
            raise UsageError(
                f"{path} has shape {tuple(t.shape)}, which has no dim {dim} to split the batch "
                "along; give it a batch dimension")
        return t.size(dim), path
    return None


class SplitInputs(NamedTuple):
    """What :func:`split_inputs` returns: one entry per device that gets samples."""

    device_ids: list          # devices that run, in order
    chunk_sizes: list[int]    # their chunk sizes (all > 0)
    args: tuple               # one tuple of positional arguments per device
    kwargs: tuple             # one dict of keyword arguments per device


def split_inputs(args: Sequence[Any], kwargs: Optional[dict[str, Any]], chunk_sizes: Sequence[int],
                 dim: int, device_ids: Sequence[Any], scatter_fn: ScatterFn = narrow_scatter
                 ) -> SplitInputs:
    """Split a call's arguments into per-device calls with the given chunk sizes.

    The containers follow ``torch.nn.parallel.scatter`` (:func:`dptune.step.tree.scatter`): every
    tensor, at any depth of tuples, lists and dicts (namedtuples and dict types are kept), is
    split along ``dim`` with the same sizes by ``scatter_fn`` (the CUDA scatter in
    :class:`BalancedDataParallel`, :func:`narrow_scatter` on the CPU); every other value is
    given as it is to each device. Devices whose chunk is 0 are left out. Each tensor must
    have the batch's size along ``dim``; one that does not is named in the error, e.g.
    ``kwargs['mask']`` or ``args[1][0]``.
    """
    sizes = list(chunk_sizes)
    ids = list(device_ids)
    if len(sizes) != len(ids):
        raise UsageError(f"{len(sizes)} chunk sizes for {len(ids)} devices")
    kwargs = dict(kwargs or {})
    used = [i for i, c in enumerate(sizes) if c > 0]
    if not used:
        raise UsageError(f"chunk sizes {sizes} give no device a sample")
    used_ids = [ids[i] for i in used]
    used_sizes = [sizes[i] for i in used]
    batch = sum(used_sizes)
    n = len(used)

    def split(obj: torch.Tensor, path: str) -> list:
        if obj.dim() == 0 or obj.dim() <= dim:
            raise UsageError(
                f"{path} has shape {tuple(obj.shape)}, which has no dim {dim} to split the "
                f"batch of {batch} along; give it a batch dimension or pass it as a non-tensor")
        if obj.size(dim) != batch:
            raise UsageError(
                f"{path} has size {obj.size(dim)} along dim {dim} but the batch has {batch} "
                f"samples (the first tensor's size); every tensor argument is split into "
                f"chunks {used_sizes}, so each needs the batch size along dim {dim}")
        return list(scatter_fn(obj, used_ids, used_sizes, dim))

    split_args = [tuple(a) for a in _tree.scatter(tuple(args), n, split, "args")]
    split_kwargs = _tree.scatter(kwargs, n, split, "kwargs") if kwargs else [{} for _ in range(n)]
    return SplitInputs(used_ids, used_sizes, tuple(split_args), tuple(split_kwargs))


def _has_scalar_tensor(obj: Any) -> bool:
    return any(t.dim() == 0 for _, t in _tree.tensors(obj))


def _cuda_scatter(tensor: torch.Tensor, device_ids: Sequence[int], chunk_sizes: Sequence[int],
                  dim: int) -> tuple:
    return _torch_private.scatter_chunks(tensor, list(device_ids), list(chunk_sizes), dim)


#: ``reduce_fn(grads_per_device, destination) -> one summed tensor per parameter there``
ReduceFn = Callable[[list, Any], list]
BUCKET_BYTES = 10 * 1024 * 1024      # as torch's reduce_add_coalesced


def _cuda_reduce_onto(grads_per_device: list, destination: Any) -> list:
    """Sum each parameter's gradients over devices onto ``destination``, which ran no replica.

    NCCL's reduce wants one input on the destination, so each bucket of ``BUCKET_BYTES`` of
    the first device's gradients is copied there first: the card holds one bucket more than
    the result, never a full copy of the gradients.
    """
    from torch.cuda import comm

    first, others = grads_per_device[0], grads_per_device[1:]
    out: list = []
    start = 0
    while start < len(first):
        end, size = start, 0
        while end < len(first) and (end == start or size + first[end].nbytes <= BUCKET_BYTES):
            size += first[end].nbytes
            end += 1
        moved = [g.to(destination) for g in first[start:end]]
        if others:
            out += comm.reduce_add_coalesced([moved] + [g[start:end] for g in others], destination)
        else:
            out += moved
        start = end
    return out


class _JoinReplicas(torch.autograd.Function):
    """Tie detached per-device copies of the parameters to the masters for autograd.

    ``forward(ctx, reduce_fn, destination, n, *masters, *copies)`` returns the copies (as
    views, no new memory); the backward gives each master the sum of its copies' gradients,
    made by ``reduce_fn`` on ``destination``. A copy that got no gradient counts as zeros.
    """

    @staticmethod
    def forward(ctx: Any, reduce_fn: ReduceFn, destination: Any, n: int, *tensors: torch.Tensor
                ) -> tuple:
        ctx.reduce_fn, ctx.destination, ctx.n = reduce_fn, destination, n
        ctx.copy_meta = [(t.shape, t.dtype, t.device) for t in tensors[n:]]
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors[n:])

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
        n = ctx.n
        if all(g is None for g in grads):
            return (None,) * (3 + n + len(grads))
        filled = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                  for g, (shape, dtype, device) in zip(grads, ctx.copy_meta)]
        per_device = [filled[k:k + n] for k in range(0, len(filled), n)]
        reduced = ctx.reduce_fn(per_device, ctx.destination)
        return (None, None, None, *reduced) + (None,) * len(grads)


def join_replicas(module: nn.Module, replicas: Sequence[nn.Module], destination: Any,
                  reduce_fn: ReduceFn) -> list:
    """Give ``replicas`` (made with ``replicate(..., detach=True)``) autograd to ``module``.

    Each replica's parameter copies are replaced by views that :class:`_JoinReplicas` ties to
    the master parameters; their gradients are summed onto ``destination`` by ``reduce_fn``.
    Returns the replicas. Parameters that need no gradient are left detached.
    """
    masters = [p for p in module.parameters() if p.requires_grad]
    if not masters:
        return list(replicas)
    index = {id(p): j for j, p in enumerate(masters)}
    mods = list(module.modules())
    rep_mods = [list(r.modules()) for r in replicas]
    copies: list = []
    for rm in rep_mods:
        found: list = [None] * len(masters)
        for m, r in zip(mods, rm):
            for key, p in m._parameters.items():
                if p is not None and id(p) in index:
                    found[index[id(p)]] = getattr(r, key)
        copies.append(found)
    flat = [t for dev in copies for t in dev]
    joined = _JoinReplicas.apply(reduce_fn, destination, len(masters), *masters, *flat)
    n = len(masters)
    for k, rm in enumerate(rep_mods):
        for m, r in zip(mods, rm):
            for key, p in m._parameters.items():
                if p is not None and id(p) in index:
                    r._parameters.pop(key, None)
                    setattr(r, key, joined[k * n + index[id(p)]])
    return list(replicas)


def _check_plan(plan: Any, chunk_sizes: Any, gpu0_bsz: Any, device_ids: Sequence[Any]) -> Any:
    """``plan=``: a length plan for as many cards as ``device_ids``, alone."""
    if plan is None:
        return None
    if chunk_sizes is not None or gpu0_bsz is not None:
        raise UsageError("give plan= or chunk_sizes=/gpu0_bsz=, not both: the plan sets each "
                         "batch's chunks from its length")
    if not hasattr(plan, "split_for_batch"):
        raise UsageError(f"plan must be a dptune.lengths.LengthPlan, got {type(plan).__name__}")
    if device_ids and len(plan.devices) != len(device_ids):
        raise UsageError(f"the plan is for {len(plan.devices)} cards but there are "
                         f"{len(device_ids)} devices (device_ids={list(device_ids)})")
    return plan


# ---- the wrapper ------------------------------------------------------------------------

class BalancedDataParallel(nn.DataParallel):
    """``torch.nn.DataParallel`` whose scatter gives each device its own chunk size.

    Args:
        module: the model; its parameters and buffers must be on ``cuda:{device_ids[0]}``.
        device_ids: CUDA devices (default: all visible), as for DataParallel.
        output_device: where outputs are gathered (default: ``device_ids[0]``).
        dim: the batch dimension of inputs and outputs.
        chunk_sizes: one non-negative int per device, e.g. ``[6, 10, 10, 10]``. Batches of
            another size get it scaled in proportion.
        gpu0_bsz: for users of the old class: card 0 gets ``min(gpu0_bsz, B)`` samples of a
            batch of ``B``, the other cards share the rest evenly. Not with ``chunk_sizes``.
        plan: a :class:`dptune.lengths.LengthPlan`: each batch's chunks are the plan's for
            its padded length (its bucket's split, scaled down for a smaller batch). Alone.

    With neither, batches are split evenly, as DataParallel does.

    Attributes:
        last_chunk_sizes: the split (one int per device) used for the last batch; ``None``
            before the first forward and when the wrapper passes through (no CUDA).
    """

    def __init__(self, module: nn.Module, device_ids: Optional[Sequence[Any]] = None,
                 output_device: Any = None, dim: int = 0, *,
                 chunk_sizes: Optional[Sequence[int]] = None, gpu0_bsz: Optional[int] = None,
                 plan: Any = None) -> None:
        if chunk_sizes is not None and gpu0_bsz is not None:
            raise UsageError(
                "give chunk_sizes or gpu0_bsz, not both: chunk_sizes=[...] sets every card's "
                "share; gpu0_bsz=n (the old class's argument) sets only card 0's")
        if gpu0_bsz is not None and (isinstance(gpu0_bsz, bool) or not isinstance(gpu0_bsz, int)
                                     or gpu0_bsz < 0):
            raise UsageError(f"gpu0_bsz must be a non-negative int, got {gpu0_bsz!r}")
        sizes = None
        if chunk_sizes is not None:
            try:
                sizes = validate_chunk_sizes(chunk_sizes)
            except ValueError as e:
                raise UsageError(str(e)) from None
        with warnings.catch_warnings():
            # DataParallel warns when cards differ in memory; balancing them is our point.
            warnings.filterwarnings("ignore", message=r"[\s\S]*imbalance between your GPUs")
            super().__init__(module, device_ids, output_device, dim)
        self.dim = dim  # DataParallel leaves it unset without CUDA
        self.gpu0_bsz = gpu0_bsz
        # a dptune.lengths.LengthPlan: each batch's chunks from its padded length
        self.plan = _check_plan(plan, chunk_sizes, gpu0_bsz, self.device_ids)
        self._chunk_sizes: Optional[list[int]] = None
        self.last_chunk_sizes: Optional[list[int]] = None
        self._last_used_sizes: Optional[list[int]] = None
        self._warned_scalar = False
        if sizes is not None:
            self.chunk_sizes = sizes
        if not self.device_ids and ((sizes is not None and len(sizes) > 1)
                                    or gpu0_bsz is not None):
            warnings.warn(
                "BalancedDataParallel: no CUDA device is available, so the module runs as it "
                f"is and the split ({self._split_text()}) is not used", stacklevel=2)

    # ---- the split --------------------------------------------------------------------
    @property
    def chunk_sizes(self) -> Optional[list[int]]:
        """The split given (one int per device), or ``None`` for the even/``gpu0_bsz`` split.

        Can be set to a new split (which clears ``gpu0_bsz``).
        """
        return None if self._chunk_sizes is None else list(self._chunk_sizes)

    @chunk_sizes.setter
    def chunk_sizes(self, value: Optional[Sequence[int]]) -> None:
        if value is None:
            self._chunk_sizes = None
            return
        try:
            sizes = validate_chunk_sizes(value)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.device_ids and len(sizes) != len(self.device_ids):
            raise UsageError(
                f"chunk_sizes {sizes} has {len(sizes)} entries but there are "
                f"{len(self.device_ids)} devices (device_ids={self.device_ids}); give one per "
                "device, 0 for a device that should get no samples")
        self._chunk_sizes = sizes
        self.gpu0_bsz = None

    def split_for(self, batch_size: int) -> list[int]:
        """The per-device split this wrapper uses for a batch of ``batch_size`` samples."""
        n = len(self.device_ids)
        if n == 0:
            return [batch_size]
        if self._chunk_sizes is not None:
            return scale_split(self._chunk_sizes, batch_size)
        if self.gpu0_bsz is not None:
            return gpu0_split(self.gpu0_bsz, batch_size, n)
        return even_split(batch_size, n)

    def _split_text(self) -> str:
        if self._chunk_sizes is not None:
            return f"chunk_sizes={self._chunk_sizes}"
        if self.gpu0_bsz is not None:
            return f"gpu0_bsz={self.gpu0_bsz}"
        return "chunk_sizes=even"

    def extra_repr(self) -> str:
        text = f"{self._split_text()}, device_ids={list(self.device_ids)}"
        if not self.device_ids:
            text += " (no CUDA: runs the module as it is)"
        elif getattr(self, "output_device", None) not in (None, self.device_ids[0]):
            text += f", output_device={self.output_device}"
        return text

    # ---- forward ----------------------------------------------------------------------
    def _check_module_device(self) -> None:
        src = self.src_device_obj
        named = chain(self.module.named_parameters(), self.module.named_buffers())
        for name, t in named:
            if t.device != src:
                raise UsageError(
                    f"BalancedDataParallel needs the module's parameters and buffers on {src} "
                    f"(device_ids[0]) but {name!r} is on {t.device}; move the model first with "
                    f"model.to('{src}'), or set CUDA_VISIBLE_DEVICES so that the card you want "
                    "first is device 0")

    def _scatter_tensor(self, tensor: torch.Tensor, device_ids: Sequence[int],
                        chunk_sizes: Sequence[int], dim: int) -> tuple:
        return _cuda_scatter(tensor, device_ids, chunk_sizes, dim)

    def _reduce_onto(self, grads_per_device: list, destination: Any) -> list:
        return _cuda_reduce_onto(grads_per_device, destination)

    def _parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any],
                        kwargs: Sequence[Any], device_ids: Sequence[int]) -> list:
        from torch.nn.parallel.parallel_apply import parallel_apply

        return parallel_apply(replicas, inputs, kwargs, list(device_ids))

    def _replicas(self, used_ids: list) -> list:
        """One replica per device in ``used_ids`` (the devices whose chunk is not empty).

        When device_ids[0] (where the module lives) gets samples, this is DataParallel's
        ``replicate``: its replica shares the module's storage. When it gets none, no replica
        runs there: the weights are broadcast from it to the other devices without autograd
        and joined back by :class:`_JoinReplicas`, whose backward sums the replicas' gradients
        onto it. (Through ``replicate`` onto device_ids[0] too, autograd would fill the unused
        replica's gradients with zeros there, one more copy of the gradients on that card.)
        """
        src = self.device_ids[0]
        if used_ids[0] == src:
            return list(self.replicate(self.module, used_ids))
        with torch.no_grad():   # DataParallel.replicate detaches when grad mode is off
            replicas = list(self.replicate(self.module, [src] + used_ids))[1:]
        if not torch.is_grad_enabled():
            return replicas
        return join_replicas(self.module, replicas, src, self._reduce_onto)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("BalancedDataParallel.forward"):
            if not self.device_ids:
                return self.module(*inputs, **kwargs)
            self._check_module_device()
            found = find_batch_size(inputs, kwargs, self.dim)
            if found is None:
                # nothing to split: run once on device_ids[0], as given
                sizes = None
                parts = SplitInputs([self.device_ids[0]], [0], (tuple(inputs),), (dict(kwargs),))
            else:
                batch_size, path = found
                if batch_size == 0:
                    raise UsageError(f"empty batch: {path} has size 0 along dim {self.dim}")
                sizes = (self.split_for(batch_size) if self.plan is None
                         else self.plan.split_for_batch(inputs, kwargs, batch_size))
                parts = split_inputs(inputs, kwargs, sizes, self.dim, self.device_ids,
                                     self._scatter_tensor)
            self.last_chunk_sizes = sizes
            self._last_used_sizes = list(parts.chunk_sizes) if found is not None else None

            if len(self.device_ids) == 1:
                return self.module(*parts.args[0], **parts.kwargs[0])

            used_replicas = self._replicas(list(parts.device_ids))
            outputs = self._parallel_apply(used_replicas, parts.args, parts.kwargs,
                                           parts.device_ids)
            self._note_outputs(outputs, parts.chunk_sizes)
            return self.gather(outputs, self.output_device)

    def _note_outputs(self, outputs: Sequence[Any], used_sizes: Sequence[int]) -> None:
        """Warn once when per-replica scalars come back from an uneven split."""
        if self._warned_scalar or len(outputs) < 2 or len(set(used_sizes)) < 2:
            return
        if _has_scalar_tensor(outputs[0]):
            self._warned_scalar = True
            warnings.warn(
                f"BalancedDataParallel: forward returned a scalar per replica and the chunks "
                f"were uneven ({list(used_sizes)}), so .mean() of the gathered vector weights "
                "samples unequally; use loss = model.reduce(loss) for the mean over the batch",
                UserWarning, stacklevel=3)

    # ---- losses -----------------------------------------------------------------------
    def reduce(self, losses: torch.Tensor) -> torch.Tensor:
        """Per-replica losses -> the batch's mean loss, weighted by the last batch's chunks.

        ``losses`` is the vector gathered from the replicas that ran (0-dim losses are
        returned as they are). Differentiable: call ``.backward()`` on the result.
        """
        if isinstance(losses, torch.Tensor) and losses.dim() == 0:
            return losses
        if self._last_used_sizes is None:
            if isinstance(losses, torch.Tensor) and losses.numel() == 1:
                return losses.reshape(())
            raise UsageError("reduce() needs a forward first: it weights the losses by the "
                             "chunk sizes of the last batch")
        return weighted_reduce(losses, self._last_used_sizes)

    # ---- from a report ----------------------------------------------------------------
    @classmethod
    def from_report(cls, model: nn.Module, path: str, *args: Any, **kwargs: Any) -> Any:
        """Moved: reading a report belongs to the result, which sits above this wrapper.

        Use ``dptune.load_result(path).wrap(model, ...)`` (same arguments: ``device_ids``,
        ``amp``, ``accumulate``, ``clip_grad_norm``, ``step``); this raises a
        :class:`~dptune.errors.UsageError` saying so.
        """
        raise UsageError(
            "BalancedDataParallel.from_report(model, path) is now "
            f"dptune.load_result({str(path)!r}).wrap(model) (same arguments after the path)")
