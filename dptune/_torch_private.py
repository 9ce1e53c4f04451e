"""The only module of dptune that touches private torch API; each use says why.

- ``Scatter`` (``torch.nn.parallel._functions``): the autograd-aware scatter that takes
  per-device ``chunk_sizes``. DataParallel's public ``scatter`` always splits evenly; an uneven
  split needs the same function with sizes, and re-implementing it would lose its stream
  handling and its gradient path (Gather back to the source device).
- ``FakeTensorMode`` (``torch._subclasses``): tensors with real shapes, dtypes and storages but
  no data, so the simulated backend can run a model of any size on the CPU.
- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): sees every op below autograd, so
  the simulated backend can charge each new storage to the virtual card that makes it.
- The attention kernels' aten ops (``aten._scaled_dot_product_flash_attention``,
  ``_efficient_attention``, ``_cudnn_attention``, ``_safe_softmax``) and
  ``torch._C._get_sdp_priority_order``: the simulator runs the kernel a CUDA card would choose
  (through its meta kernel) so that the backward keeps that kernel's tensors; there is no
  public way to call a given kernel, nor to read the order ``sdpa_kernel`` may have set.
- ``Module._replicate_for_data_parallel``: the simulator's replicas are module copies made
  as ``torch.nn.parallel.replicate`` makes them (parameters as plain attributes), so that
  code re-running a replica's forward later (activation checkpointing) uses that card's
  weights; ``replicate`` itself only broadcasts between real CUDA devices.
- ``ShapeEnv`` (``torch.fx.experimental.symbolic_shapes``): with one, ``FakeTensorMode`` gives
  data-dependent sizes (``nonzero``, boolean masks, ``.item()``) as unbacked symbols with a
  value range instead of refusing them; the simulator charges their largest possible size.
- ``_disable_current_modes`` (``torch.utils._python_dispatch``): a model factory is built on
  plain meta tensors outside the fake mode, so that it may convert them (``.to(bfloat16)``).
- ``Tensor._indices`` / ``_values``: the storages of a sparse tensor (``nn.Embedding(sparse=True)``
  gradients), which has none of its own, uncoalesced as autograd makes them.
- ``TorchFunctionMode`` (``torch.overrides``): sees ``F.scaled_dot_product_attention`` above
  autograd, where the kernel is chosen.
- ``torch.overrides._get_current_function_mode_stack``: autograd does not run the backward
  under the forward's torch-function modes, so an activation checkpoint's recomputation must
  enter them again (the Trainer integration captures them when the forward runs).
- ``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``: the allocator's history
  of every allocation with its stack, which the training monitor saves (opt-in) when a step
  runs out of memory (:mod:`dptune.monitor.forensics`); torch has no public API for it. The
  signature changed (torch < 2.1: ``enabled: bool``; later: ``enabled="all"``), so it is
  looked up and called either way (:func:`record_memory_history`).

- The private aten ops ``aten._grouped_mm`` (a mixture of experts' expert layers) and
  ``aten._pack_padded_sequence`` (``pack_padded_sequence``): their fake kernels act unlike
  CUDA's, so the simulator recognizes them by identity (:func:`private_op`; ``None`` on a
  torch without the op).
- The file names of torch's own modules (``torch/nn/modules/rnn.py``, the fake and meta
  kernels' files): whether an error was raised inside one of them (:func:`torch_file`,
  :func:`fake_kernel_files`), where torch gives no exception type of its own.

Everything is imported lazily: importing this module imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dispatch_mode_base", "fake_tensor_mode", "function_mode_active", "function_mode_base",
           "function_mode_stack", "new_shape_env", "no_dispatch_modes", "no_function_modes", "sparse_parts", "upper_bound",
           "replica_module", "safe_softmax", "scatter_chunks", "sdp_priority_order", "sdpa_cudnn",
           "sdpa_efficient", "sdpa_flash", "include_dispatch_key", "exclude_dispatch_key",
           "PythonKernels", "amp_as_if_cuda", "fake_process_group_store", "register_fake_backend",
           "storage_resize_hook", "dtensor_meta_aside", "private_op", "torch_file", "fake_kernel_files",
           "record_memory_history", "dump_memory_snapshot"]


def scatter_chunks(tensor: Any, device_ids: list, chunk_sizes: list, dim: int) -> tuple:
    """Split ``tensor`` along ``dim`` into ``chunk_sizes`` pieces on ``device_ids``.

    Autograd-aware: the backward gathers the gradient back to the input's device. Every
    chunk size must be positive (the CUDA scatter rejects empty chunks): leave devices that
    get nothing out of ``device_ids``.
    """
    from torch.nn.parallel._functions import Scatter

    # Scatter.forward(ctx, target_gpus, chunk_sizes, dim, input)
    return Scatter.apply(list(device_ids), list(chunk_sizes), dim, tensor)


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A new ``FakeTensorMode``."""
    from torch._subclasses import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake(t: Any) -> bool:
    from torch._subclasses import FakeTensor

    return isinstance(t, FakeTensor)


def dispatch_mode_base() -> type:
    """The ``TorchDispatchMode`` base class."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def function_mode_base() -> type:
    """The ``TorchFunctionMode`` base class."""
    from torch.overrides import TorchFunctionMode

    return TorchFunctionMode


def function_mode_active() -> bool:
    """Whether any torch-function mode is active on this thread (the autograd engine runs
    backward nodes with none: the simulator enters its mode again around each node)."""
    import torch

    return bool(torch._C._len_torch_function_stack())


def function_mode_stack() -> list:
    """The torch-function modes active now, outermost first."""
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def sdp_priority_order() -> list:
    """The order torch tries attention kernels in (``torch.nn.attention.SDPBackend`` values)."""
    import torch

    get = getattr(torch._C, "_get_sdp_priority_order", None)
    return list(get()) if get is not None else [1, 2, 0, 3]


def sdpa_flash(q: Any, k: Any, v: Any, dropout_p: float, is_causal: bool, scale: float) -> Any:
    """The output of the flash-attention kernel (it saves q, k, v, output, logsumexp)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale)[0]


def sdpa_efficient(q: Any, k: Any, v: Any, bias: Any, compute_lse: bool, dropout_p: float,
                   is_causal: bool, scale: Any) -> Any:
    """The output of the memory-efficient kernel (saves q, k, v, bias, output, logsumexp)."""
    import torch

    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, compute_lse, dropout_p, is_causal, scale=scale)[0]


def sdpa_cudnn(q: Any, k: Any, v: Any, bias: Any, compute_lse: bool, dropout_p: float,
               is_causal: bool, scale: Any) -> Any:
    """The output of the cuDNN attention kernel (saves q, k, v, bias, output, logsumexp)."""
    import torch

    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, compute_lse, dropout_p, is_causal, False, scale=scale)[0]


def safe_softmax(x: Any, dim: int) -> Any:
    """``aten._safe_softmax``: the softmax of the math attention path (rows of -inf give 0)."""
    import torch

    return torch.ops.aten._safe_softmax(x, dim)



def replica_module(module: Any, tensors: dict) -> Any:
    """A replica of ``module`` as ``torch.nn.parallel.replicate`` makes one for a device.

    ``tensors`` maps ``id()`` of each of the module's parameters and buffers to the tensor the
    replica uses in its place (one that is missing keeps the module's own). Submodules are
    shallow copies (``_replicate_for_data_parallel``) sharing hooks and attributes.
    """
    mods = list(module.modules())
    copies = {id(m): m._replicate_for_data_parallel() for m in mods}
    for m in mods:
        r = copies[id(m)]
        for key, child in m._modules.items():
            if child is None:
                r._modules[key] = None
            else:
                setattr(r, key, copies[id(child)])
        for key, p in m._parameters.items():
            if p is None:
                r._parameters[key] = None
            else:
                setattr(r, key, tensors.get(id(p), p))
        for key, b in m._buffers.items():
            if b is None:
                r._buffers[key] = None
            else:
                setattr(r, key, tensors.get(id(b), b))
    return copies[id(module)]


# --------------------------------------------------------------------------------------------
# CUDA autocast on the simulated cluster (see dptune/backends/simulated/autocast.py)
# --------------------------------------------------------------------------------------------
# - ``torch.library.Library(...)._destroy()``: removes the Python kernels registered for the
#   simulated step, so the real ``AutocastCUDA`` kernels are back afterwards (a Library is
#   otherwise only dropped when garbage-collected, which is not a point in time).
# - ``torch._C._IncludeDispatchKeyGuard`` / ``_ExcludeDispatchKeyGuard``: the simulated cards
#   are fake CPU tensors, which do not carry the ``AutocastCUDA`` key; including it in the
#   thread's key set routes their ops through the CUDA autocast kernels while
#   ``torch.autocast("cuda")`` is on, and a kernel excludes it again before redispatching, as
#   the C++ autocast wrappers do.
# - ``torch.cuda.amp.common.amp_definitely_not_available`` and ``torch.cuda.is_bf16_supported``:
#   ``torch.autocast("cuda")`` and ``GradScaler("cuda")`` consult them and disable themselves on
#   a machine without CUDA; while a simulated step runs they say "available".
# - ``GradScaler._maybe_opt_step``: reads ``found_inf.item()``, a value a fake tensor does not
#   have; on the simulated cluster no gradient is ever inf, so it steps.
# - ``torch.utils.checkpoint._infer_device_type``: a checkpointed region records the autocast
#   state of its inputs' device and restores it when it recomputes; the simulated cards' fake
#   tensors say "cpu", so it says "cuda" (the device they stand for) while a simulated step runs.

def _dispatch_key(name: str) -> Any:
    import torch

    return getattr(torch._C.DispatchKey, name)


def include_dispatch_key(name: str) -> Any:
    """A context manager that adds dispatch key ``name`` to this thread's included keys."""
    import torch

    return torch._C._IncludeDispatchKeyGuard(_dispatch_key(name))


def exclude_dispatch_key(name: str) -> Any:
    """A context manager that adds dispatch key ``name`` to this thread's excluded keys."""
    import torch

    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_dispatch_key(name)))


class PythonKernels:
    """Python kernels for ``aten`` ops at one dispatch key, removed by :meth:`close`."""

    def __init__(self, kernels: Any, dispatch_key: str):
        import warnings

        import torch

        self._lib: Any = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():   # "Overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            for name, fn in kernels.items():
                self._lib.impl(name, fn, dispatch_key)

    def close(self) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


class amp_as_if_cuda:
    """While active: ``torch.autocast("cuda")`` and ``GradScaler("cuda")`` do not disable
    themselves for want of CUDA, ``GradScaler.step`` steps without reading ``found_inf``, and
    ``torch.utils.checkpoint`` recomputes under the CUDA autocast state of the forward.
    Also calls ``on_clear_cache`` whenever ``torch.clear_autocast_cache()`` runs."""

    def __init__(self, on_clear_cache: Any):
        self._on_clear = on_clear_cache
        self._saved: list = []

    def __enter__(self) -> "amp_as_if_cuda":
        import torch
        import torch.amp.grad_scaler as gs
        import torch.cuda.amp.common as common
        import torch.utils.checkpoint as ckpt

        clear = torch.clear_autocast_cache
        on_clear = self._on_clear

        def clear_autocast_cache() -> None:
            clear()
            on_clear()

        def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
            return optimizer.step(*args, **kwargs)

        patches = [(common, "amp_definitely_not_available", lambda: False),
                   (torch.cuda, "is_bf16_supported", lambda *a, **k: True),
                   (torch, "clear_autocast_cache", clear_autocast_cache),
                   (gs.GradScaler, "_maybe_opt_step", maybe_opt_step),
                   (ckpt, "_infer_device_type", lambda *args: "cuda")]
        for obj, name, new in patches:
            self._saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, new)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._saved:
            obj, name, old = self._saved.pop()
            setattr(obj, name, old)


def new_shape_env() -> Any:
    """A fresh ``ShapeEnv`` for a ``FakeTensorMode`` (data-dependent sizes become symbols)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv()


def upper_bound(value: Any) -> Any:
    """The largest value a possibly symbolic int can take (an ``int``), or ``None`` if unbounded."""
    import torch

    if not isinstance(value, torch.SymInt):
        return int(value)
    node = value.node
    bound = node.shape_env.bound_sympy(node.expr).upper
    if not getattr(bound, "is_finite", True):     # sympy's oo: no bound known
        return None
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def bound_size(value: Any, largest: int) -> None:
    """Tell the shape environment that a data-dependent size (an unbacked ``SymInt``) lies in
    ``[0, largest]``; a plain int is left alone."""
    import torch
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    if isinstance(value, torch.SymInt) and upper_bound(value) is None:
        _constrain_range_for_size(value, min=0, max=int(largest))


def no_dispatch_modes() -> Any:
    """A context manager with no torch-dispatch mode active (the fake mode included)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def no_function_modes() -> Any:
    """A context manager with no torch-function mode (and no subclass ``__torch_function__``)
    active: the simulator's dispatch runs below them, where they would only cost time."""
    import torch

    return torch._C.DisableTorchFunction()


def sparse_parts(t: Any) -> list:
    """The tensors holding a sparse COO tensor's memory: its indices and values."""
    try:
        return [t._indices(), t._values()]
    except (RuntimeError, NotImplementedError):
        return []


# ---- FSDP2 on the simulated cluster (dptune.backends.simulated.fsdp) ----------------------
# - ``torch.testing._internal.distributed.fake_pg``: importing it registers torch's "fake"
#   process-group backend (collectives that do nothing), and ``FakeStore`` initialises a
#   default group of any world size in one process; torch's own FSDP memory tools and
#   torchtitan's estimator use the same. There is no public fake backend.
# - ``torch.distributed._tools.fake_collectives``: fake (meta) kernels for the c10d
#   collectives, so FSDP2's all-gathers and reduce-scatters run on fake tensors.
# - ``torch.UntypedStorage.resize_`` is wrapped while a simulation runs: FSDP2 frees and
#   re-allocates its unsharded parameters by resizing their storages, which no dispatch mode
#   sees (torch's ``MemTracker`` wraps it the same way).
# - ``ShardingPropagator._propagate_tensor_meta_non_cached`` (``torch.distributed.tensor``):
#   a DTensor op first runs on fake tensors of the *global* shapes to learn its output's
#   metadata, under the fake mode it finds active, the simulator's; those storages exist on
#   no card, so the simulation runs it aside. There is no public hook (torch's own memory
#   tools see it too); a torch without it has nothing to set aside.

def fake_process_group_store() -> Any:
    """A ``FakeStore`` for ``init_process_group("fake", store=...)`` (registers the backend)."""
    import torch.distributed._tools.fake_collectives  # noqa: F401  (fake kernels of c10d ops)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def register_fake_backend() -> None:
    """Register the "fake" process-group backend and the collectives' fake kernels."""
    import torch.distributed._tools.fake_collectives  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


class storage_resize_hook:
    """While entered, ``callback(storage, old_nbytes)`` runs after every
    ``UntypedStorage.resize_`` (FSDP2's ``alloc_storage`` / ``free_storage``)."""

    def __init__(self, callback: Any):
        self.callback = callback
        self._orig: Any = None

    def __enter__(self) -> "storage_resize_hook":
        import torch

        orig = self._orig = torch.UntypedStorage.resize_
        callback = self.callback

        def resize_(st: Any, size: int) -> Any:
            old = st.nbytes()
            out = orig(st, size)
            callback(st, old)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.UntypedStorage.resize_ = self._orig  # type: ignore[method-assign]


class dtensor_meta_aside:
    """While entered, DTensor's sharding propagation (which runs each op it has not cached on
    fake tensors of the global shapes, for the output's metadata) runs inside ``aside()``, a
    context manager the caller gives (the simulator's: charge nothing to a card)."""

    def __init__(self, aside: Any):
        self.aside = aside
        self._orig: Any = None
        self._cls: Any = None

    def __enter__(self) -> "dtensor_meta_aside":
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:        # a torch without DTensor: no sharding propagation
            return self
        cls: Any = ShardingPropagator
        orig = getattr(cls, "_propagate_tensor_meta_non_cached", None)
        if orig is None:
            return self
        self._cls, self._orig = cls, orig
        aside = self.aside

        def propagate(prop: Any, op_schema: Any) -> Any:
            with aside():
                return orig(prop, op_schema)

        cls._propagate_tensor_meta_non_cached = propagate
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cls is not None:
            self._cls._propagate_tensor_meta_non_cached = self._orig
            self._cls = self._orig = None


def private_op(name: str) -> Any:
    """The default overload of the private aten op ``aten.<name>`` (``"_grouped_mm"``,
    ``"_pack_padded_sequence"``), or ``None`` where this torch has no such op."""
    import torch

    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, "default", None) if packet is not None else None


def torch_file(*parts: str) -> str:
    """The path of one of torch's own source files (``torch_file("nn", "modules", "rnn.py")``),
    to tell whether an exception was raised inside it."""
    import os

    import torch

    return os.path.join(os.path.dirname(torch.__file__), *parts)


def fake_kernel_files() -> tuple:
    """The paths of torch's fake and meta kernels (which stand in for CUDA's on fake tensors):
    the meta registrations, the references, the decompositions, the primitives and the fake
    implementations; a frame inside them is torch's kernel, not the user's code."""

    return tuple(torch_file(*p.split("/")) for p in ("_meta_registrations.py", "_refs", "_decomp",
                                                      "_prims", "_subclasses/fake_impls.py"))


def _memory_module() -> Any:
    import torch

    return getattr(torch.cuda, "memory", None)


def record_memory_history(max_entries: int) -> bool:
    """Start the CUDA allocator's history (the last ``max_entries`` events, with stacks);
    ``False`` when this torch has no such API (it is then not recorded)."""
    mod = _memory_module()
    start = getattr(mod, "_record_memory_history", None)
    if start is None:
        return False
    try:
        start(enabled="all", max_entries=max_entries)          # torch >= 2.1
    except TypeError:
        start(True, max_entries=max_entries)                   # older: enabled is a bool
    return True


def dump_memory_snapshot(path: str) -> bool:
    """Write the allocator's snapshot (with the recorded history) to ``path`` (a pickle for
    https://pytorch.org/memory_viz); ``False`` when this torch cannot."""
    mod = _memory_module()
    dump = getattr(mod, "_dump_snapshot", None)
    if dump is None:
        return False
    dump(path)
    return True
