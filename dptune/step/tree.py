"""One walker over nested batches and outputs, with ``torch.nn.parallel``'s container rules.

DataParallel moves a batch to the cards with ``scatter`` and brings the replicas' outputs
back with ``gather`` (``torch/nn/parallel/scatter_gather.py``). dptune's wrapper, the
simulated cluster and the real-GPU backend all walk the same structures, so they share this
module and follow torch's rules exactly:

- :func:`scatter`: a tensor is split into one chunk per card; a namedtuple gives one
  namedtuple of its type per card, any other non-empty tuple plain tuples, a non-empty list
  lists, a non-empty dict one ``type(d)`` of the same keys per card; every other value
  (numbers, strings, empty containers, dataclasses, ...) is given whole to every card.
- :func:`gather`: tensors are concatenated (0-dim ones stacked), ``None`` stays ``None``, a
  dict (such as a HF ``ModelOutput``) gives ``type(d)`` over its keys, a namedtuple its type,
  a list or tuple (or another sized iterable, such as a HF ``DynamicCache``) its type over
  the zipped elements. torch fails on anything else (numbers,
  dataclasses that are not dicts) or returns garbage (a string becomes ``"<map object>"``);
  this raises instead, with a message naming where in the output it is.
- :func:`tensors` and :func:`map_tensors`: every tensor at any depth of tuples, lists, dicts
  and dataclasses, with its path (``args[0]``, ``kwargs['mask']``, ``.past_key_values[0][1]``);
  used for device moves, loss defaults and bookkeeping.

No torch at import time: tensors are recognised through ``torch.Tensor`` imported lazily.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

from dptune.errors import DptuneError, UsageError, UserCodeError

__all__ = ["is_namedtuple", "tensors", "leaves", "map_tensors", "scatter", "gather"]


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def is_namedtuple(obj: Any) -> bool:
    """As ``torch.nn.parallel.scatter_gather._is_namedtuple``."""
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_other_sequence(obj: Any) -> bool:
    """A sized iterable that torch's gather rebuilds as ``type(obj)(elements)``, such as a HF
    ``DynamicCache`` (an iterable of per-layer ``(key, value)``); strings are not."""
    return (hasattr(obj, "__iter__") and hasattr(obj, "__len__")
            and not isinstance(obj, (str, bytes, bytearray, dict, list, tuple, _tensor_type())))


def leaves(obj: Any) -> Iterator[Any]:
    """Every tensor in ``obj``, as :func:`tensors` walks it but without the paths (for the
    bookkeeping of every op, where the paths would cost time)."""
    return _leaves(obj, _tensor_type())


def _leaves(obj: Any, tensor: type) -> Iterator[Any]:
    if isinstance(obj, tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _leaves(x, tensor)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _leaves(x, tensor)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), tensor)
    elif _is_other_sequence(obj):
        for x in obj:
            yield from _leaves(x, tensor)


def tensors(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Depth-first ``(path, tensor)`` for every tensor in ``obj`` (tuples, lists, dicts,
    dataclasses; a dict that is also a dataclass, like a HF ``ModelOutput``, is walked as a
    dict)."""
    tensor = _tensor_type()
    if isinstance(obj, tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}[{k!r}]")
    elif is_namedtuple(obj):
        for f, v in zip(obj._fields, obj):
            yield from tensors(v, f"{path}.{f}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]")
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name), f"{path}.{f.name}")
    elif _is_other_sequence(obj):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]")


def map_tensors(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``obj`` rebuilt with ``fn(t)`` for every tensor ``t``, containers keeping their types."""
    tensor = _tensor_type()
    if isinstance(obj, tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return _rebuild_dict(obj, [(k, map_tensors(fn, v)) for k, v in obj.items()])
    if is_namedtuple(obj):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, list):
        return [map_tensors(fn, v) for v in obj]
    if isinstance(obj, tuple):
        return _rebuild_tuple(obj, [map_tensors(fn, v) for v in obj])
    if _is_dataclass_instance(obj):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        try:
            return dataclasses.replace(obj, **changes)
        except (TypeError, ValueError):
            return obj
    return obj


def _rebuild_dict(like: dict, items: list) -> dict:
    try:
        return type(like)(items)
    except TypeError:   # a dict subclass whose constructor takes something else
        return dict(items)


def _rebuild_tuple(like: tuple, items: list) -> tuple:
    if type(like) is tuple:
        return tuple(items)
    try:
        return type(like)(items)
    except TypeError:
        return tuple(items)


def scatter(obj: Any, n: int, split: Callable[[Any, str], Sequence[Any]], path: str = "") -> list:
    """``obj`` for each of ``n`` cards, as ``torch.nn.parallel.scatter`` builds it.

    ``split(tensor, path)`` returns the tensor's ``n`` chunks (and raises for one that
    cannot be split, naming ``path``).
    """
    if isinstance(obj, _tensor_type()):
        chunks = list(split(obj, path))
        if len(chunks) != n:
            raise RuntimeError(f"scatter of {path or 'a tensor'} gave {len(chunks)} chunks for {n} cards")
        return chunks
    if is_namedtuple(obj):
        parts = [scatter(v, n, split, f"{path}.{f}") for f, v in zip(obj._fields, obj)]
        return [type(obj)(*(p[d] for p in parts)) for d in range(n)]
    if isinstance(obj, tuple) and len(obj) > 0:
        parts = [scatter(v, n, split, f"{path}[{i}]") for i, v in enumerate(obj)]
        return [tuple(p[d] for p in parts) for d in range(n)]
    if isinstance(obj, list) and len(obj) > 0:
        parts = [scatter(v, n, split, f"{path}[{i}]") for i, v in enumerate(obj)]
        return [[p[d] for p in parts] for d in range(n)]
    if isinstance(obj, dict) and len(obj) > 0:
        by_key = [(k, scatter(v, n, split, f"{path}[{k!r}]")) for k, v in obj.items()]
        return [_rebuild_dict(obj, [(k, p[d]) for k, p in by_key]) for d in range(n)]
    return [obj for _ in range(n)]


def gather(outputs: Sequence[Any], cat: Callable[[list, str], Any], path: str = "") -> Any:
    """The replicas' ``outputs`` combined as ``torch.nn.parallel.gather`` combines them.

    ``cat(tensors, path)`` concatenates one tensor per replica (stacking 0-dim ones).
    Raises :class:`UsageError` for an output torch cannot gather, naming where it is.
    """
    out = outputs[0]
    if isinstance(out, _tensor_type()):
        return cat(list(outputs), path)
    if out is None:
        return None
    if isinstance(out, dict):
        if not all(len(out) == len(d) for d in outputs):
            raise UsageError(f"the replicas' outputs{path} are dicts with different numbers of "
                             "keys, which DataParallel cannot gather; return the same keys from every replica")
        return _rebuild_dict(out, [(k, gather([d[k] for d in outputs], cat, f"{path}[{k!r}]"))
                                   for k in out])
    if isinstance(out, (list, tuple)) and not all(len(o) == len(out) for o in outputs):
        raise UsageError(f"the replicas' outputs{path} have different lengths, which DataParallel "
                         "cannot gather; return the same structure from every replica")
    if is_namedtuple(out):
        return type(out)._make(gather(list(x), cat, f"{path}.{f}")
                               for f, x in zip(out._fields, zip(*outputs)))
    if isinstance(out, (list, tuple)):
        items = [gather(list(x), cat, f"{path}[{i}]") for i, x in enumerate(zip(*outputs))]
        if isinstance(out, tuple):
            return _rebuild_tuple(out, items)
        return items if type(out) is list else type(out)(items)
    if _is_other_sequence(out):
        if not all(len(o) == len(out) for o in outputs):
            raise UsageError(f"the replicas' outputs{path} have different lengths, which "
                             "DataParallel cannot gather; return the same structure from every replica")
        # lazily, as torch's map(gather_map, ...): a cache's constructor copies each layer's
        # gathered keys and values (torch.cat onto an empty tensor), so each layer's gathered
        # parts are freed before the next layer is gathered
        parts = (gather(list(x), cat, f"{path}[{i}]") for i, x in enumerate(zip(*outputs)))
        try:
            return type(out)(parts)
        except DptuneError:
            raise
        except Exception as e:
            where = f"output{path}" if path else "output"
            hint = (" (a cache: pass use_cache=False, or set model.config.use_cache = False, "
                    "for training)" if "Cache" in type(out).__name__ else "")
            raise UserCodeError(
                f"the model's {where} is a {type(out).__name__}, which DataParallel's gather "
                f"rebuilds as {type(out).__name__}(gathered parts) from every replica's, and that "
                f"raised {type(e).__name__}: {e}. torch.nn.DataParallel fails the same way on "
                f"GPUs; do not return it from forward in training{hint}") from e
    if isinstance(out, str):
        # torch's gather_map returns type(out)(map(...)), for a string the text "<map object
        # ...>" (sentence-transformers' output['modality']); it holds no tensor memory
        return type(out)(map(tuple, zip(*outputs)))
    where = f"output{path}" if path else "output"
    raise UsageError(
        f"the model's {where} is a {type(out).__name__}, which DataParallel cannot gather "
        "(torch.nn.parallel.gather takes tensors, None, dicts, namedtuples, lists, tuples and "
        "other sized iterables); "
        "return one of those from forward (e.g. a dict, or a HF ModelOutput)")
