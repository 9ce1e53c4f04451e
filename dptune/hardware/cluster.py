"""Simulated clusters without torch: the spec (``'4x24GB'``, ``'2xA100-80GB,2x40GB'``,
``'4x24GB,used=0:6GB'``), the card table (total memory and compute capability of common cards)
and :class:`Cluster`, the parsed spec.

This module imports nothing heavy (no torch): the tuner, the command line, the DDP planner
and the Hugging Face integration parse a spec through it before anything is simulated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

import dptune.hardware.speeds as timing
from dptune.hardware.cards import ALIASES, CARDS, DEFAULT_CAPABILITY
from dptune.types import Device
from dptune.errors import SpecError
from dptune.units import MiB, format_bytes, parse_bytes

__all__ = ["Cluster", "CARD_TYPES", "CARD_CAPABILITY", "DEFAULT_CAPABILITY", "DEFAULT_CLUSTER",
           "DEFAULT_CONTEXT_BYTES", "parse_cluster"]

DEFAULT_CLUSTER = "4x24GB"
DEFAULT_CONTEXT_BYTES = 384 * MiB     # a CUDA context with torch's kernels loaded

# Views of the one card table (dptune.hardware.cards): total memory and compute capability.
CARD_TYPES: dict[str, int] = {name: card.total_memory for name, card in CARDS.items()}
CARD_CAPABILITY: dict[str, tuple[int, int]] = {name: card.capability for name, card in CARDS.items()}
_ALIASES = ALIASES
_LARGE_WORKSPACE_MAJORS = (9, 10, 11, 12)   # torch's 32 MiB cuBLAS workspace: Hopper, Blackwell
CUBLASLT_WORKSPACE_BYTES = 1 * MiB      # torch's default CUBLASLT_WORKSPACE_SIZE (1024 KiB)

_SPEC_HELP = (
    "accepted forms: '4x24GB', '2x80GB,2x40GB', '8xA100-80GB', '4xV100-16GB', 'RTX4090', "
    "with optional items 'used=0:6GB' (memory taken on card 0 by other processes; repeatable) "
    "and 'context=384MiB' (CUDA context per card) and 'cc=8.6' (compute capability of the cards "
    "given by size only; default 8.0), and the speed options 'tflops=150' or 'tflops=1:150', "
    "'bandwidth=900GB/s' or 'bandwidth=1:900GB/s', 'link=pcie4|pcie3|pcie5|nvlink|25GB/s', 'host=20us' "
    "(dptune.hardware.speeds). Known cards: " + ", ".join(CARD_TYPES))


def _norm_card(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).upper()


_CARD_LOOKUP = {_norm_card(k): k for k in CARD_TYPES}
_CARD_LOOKUP.update({_norm_card(a): k for a, k in _ALIASES.items()})


@dataclass(frozen=True)
class Cluster:
    """Virtual cards: names, total memory, memory taken by others, per-card context cost."""

    names: tuple[str, ...]
    total_bytes: tuple[int, ...]
    used_bytes: tuple[int, ...]
    context_bytes: int = DEFAULT_CONTEXT_BYTES
    spec: str = ""
    capabilities: tuple[tuple[int, int], ...] = ()   # per card; () = from the card table
    assumed_capability: bool = False                  # some card's capability is the default

    def __post_init__(self) -> None:
        if not self.capabilities:
            caps = tuple(CARD_CAPABILITY.get(n) for n in self.names)
            object.__setattr__(self, "capabilities",
                               tuple(c if c is not None else DEFAULT_CAPABILITY for c in caps))
            object.__setattr__(self, "assumed_capability", None in caps)
        if not (len(self.names) == len(self.total_bytes) == len(self.used_bytes)
                == len(self.capabilities)):
            raise SpecError("cluster fields have different lengths")
        if not self.names:
            raise SpecError("a cluster needs at least one card; " + _SPEC_HELP)

    @property
    def devices(self) -> list[Device]:
        return [Device(index=i, name=n, total_bytes=t, used_bytes=u, context_bytes=self.context_bytes)
                for i, (n, t, u) in enumerate(zip(self.names, self.total_bytes, self.used_bytes))]

    def __len__(self) -> int:
        return len(self.names)

    def workspace_bytes(self, card: int) -> int:
        """The cuBLAS workspace torch allocates per (handle, stream) on this card, by its
        compute capability as torch chooses it (``parseChosenWorkspaceSize`` in
        ``CublasHandlePool.cpp``): 32 MiB on Hopper and Blackwell (major 9 to 12), else
        ``:4096:2:16:8``, 8 MiB + 128 KiB. A card given by size with ``cc=9.0`` is a Hopper
        card here too. ``CUBLAS_WORKSPACE_CONFIG`` is not read."""
        major = self.capabilities[card][0]
        return 32 * MiB if major in _LARGE_WORKSPACE_MAJORS else 4096 * 1024 * 2 + 16 * 1024 * 8

    def workspaces_bytes(self, card: int) -> tuple[int, int, int]:
        """The workspaces a card that runs training steps keeps allocated (torch's
        ``CublasHandlePool.cpp``): cuBLAS's, one per (handle, stream) with a handle per
        thread, so one for the thread that runs the forward and one for the autograd
        engine's thread of the card, which runs the backward; and cuBLASLt's of the
        forward's handle (``CUBLASLT_WORKSPACE_SIZE``, 1 MiB by default), which a linear
        layer with a bias takes (``addmm`` through cuBLASLt). All three were allocated, and
        kept, by MLP's first step on an H200 (benchmarks/memory_gap.py)."""
        ws = self.workspace_bytes(card)
        return ws, ws, CUBLASLT_WORKSPACE_BYTES

    def describe(self) -> str:
        return self.spec or ",".join(self.names)

    def describe_capability(self) -> str:
        """``'sm 8.0 assumed'`` where a card's capability is not known from its name, else ''."""
        if not self.assumed_capability:
            return ""
        caps = sorted({f"{a}.{b}" for n, (a, b) in zip(self.names, self.capabilities)
                       if n not in CARD_CAPABILITY})
        return f"sm {'/'.join(caps)} assumed"

    @classmethod
    def uniform(cls, n: int, total_bytes: int, name: Optional[str] = None,
                context_bytes: int = DEFAULT_CONTEXT_BYTES,
                capability: Optional[tuple[int, int]] = None) -> "Cluster":
        name = name or format_bytes(total_bytes, precision=0).replace(" ", "")
        caps = (tuple(capability),) * n if capability is not None else ()
        return cls(names=(name,) * n, total_bytes=(total_bytes,) * n, used_bytes=(0,) * n,
                   context_bytes=context_bytes, spec=f"{n}x{name}", capabilities=caps)  # type: ignore[arg-type]


@dataclass
class _Options:
    """The ``key=value`` items of a spec read so far."""

    used: dict[int, int] = field(default_factory=dict)   # card -> bytes used by others
    context: int = DEFAULT_CONTEXT_BYTES
    cc: Optional[tuple[int, int]] = None


def _read_option(spec: str, item: str, key: str, value: str, opts: _Options) -> None:
    """Read one ``key=value`` item of ``spec`` into ``opts``."""
    key = key.strip().lower()
    try:
        if key == "used":
            card_text, colon, size = value.partition(":")
            if not colon:
                raise ValueError("missing ':'")
            card_index = int(card_text)
            opts.used[card_index] = opts.used.get(card_index, 0) + parse_bytes(size, gb_is_gib=True)
        elif key == "context":
            opts.context = parse_bytes(value, gb_is_gib=True)
        elif key in ("cc", "sm"):
            major, dot, minor = value.strip().partition(".")
            opts.cc = (int(major), int(minor or 0))
        elif key in timing.SPEED_OPTIONS:
            timing.check_speed_option(key, value)
        else:
            raise ValueError(f"unknown option {key!r}")
    except ValueError as e:
        raise SpecError(f"bad item {item!r} in cluster spec {spec!r} ({e}); " + _SPEC_HELP) from None


def _read_cards(spec: str, item: str) -> tuple[str, int, int]:
    """``(name, total bytes, count)`` of a card item of ``spec`` (``'4x24GB'``, ``'A100'``)."""
    m = re.fullmatch(r"(?:(\d+)\s*[xX×]\s*)?(.+)", item)
    count = int(m.group(1)) if m and m.group(1) else 1
    card = m.group(2).strip() if m else item
    if count < 1:
        raise SpecError(f"card count must be >= 1 in {item!r}; " + _SPEC_HELP)
    known = _CARD_LOOKUP.get(_norm_card(card))
    if known is not None:
        return known, CARD_TYPES[known], count
    try:
        total = parse_bytes(card, gb_is_gib=True)
    except ValueError:
        raise SpecError(f"unknown card {card!r} in cluster spec {spec!r}; " + _SPEC_HELP) from None
    if total <= 0:
        raise SpecError(f"card size must be > 0 in {item!r}; " + _SPEC_HELP)
    return card.replace(" ", ""), total, count


def _check_room(spec: str, names: list[str], totals: list[int], opts: _Options) -> None:
    """Every card keeps room after its CUDA context and what others use; the speed options
    fit the cards."""
    context = opts.context
    for idx, total in enumerate(totals):
        if context >= total:
            raise SpecError(f"context={format_bytes(context)} leaves nothing of card {idx}'s "
                            f"{format_bytes(total)}; the CUDA context takes a few hundred MiB "
                            "(default 384MiB): give a smaller context= or larger cards; " + _SPEC_HELP)
    for idx, b in opts.used.items():
        if not 0 <= idx < len(names):
            raise SpecError(f"used={idx}:... names card {idx}, but the cluster has cards "
                            f"0..{len(names) - 1}; " + _SPEC_HELP)
        if b + context >= totals[idx]:
            raise SpecError(f"card {idx} has {format_bytes(totals[idx])} in all, "
                            f"{format_bytes(b)} used by others leaves nothing; " + _SPEC_HELP)
    try:
        timing.ClusterSpeed.of(names, spec)
    except ValueError as e:
        raise SpecError(f"cluster spec {spec!r}: {e}; " + _SPEC_HELP) from None


def parse_cluster(spec: Union[str, Cluster]) -> Cluster:
    """Parse a cluster spec such as ``'4x24GB'``, ``'2xA100-80GB,2x40GB,used=0:6GB'``.

    Sizes in a spec are GPU marketing sizes: ``24GB`` is read as 24 GiB. Raises
    :class:`dptune.errors.SpecError` with the accepted forms when the spec is malformed.
    """
    if isinstance(spec, Cluster):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty cluster spec {spec!r}; " + _SPEC_HELP)
    names: list[str] = []
    totals: list[int] = []
    opts = _Options()
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            raise SpecError(f"empty item in cluster spec {spec!r}; " + _SPEC_HELP)
        key, eq, value = item.partition("=")
        if eq:
            _read_option(spec, item, key, value, opts)
            continue
        name, total, count = _read_cards(spec, item)
        names += [name] * count
        totals += [total] * count
    if not names:
        raise SpecError(f"cluster spec {spec!r} names no card; " + _SPEC_HELP)
    _check_room(spec, names, totals, opts)
    known_caps = [CARD_CAPABILITY.get(n) for n in names]
    caps = tuple(c if c is not None else (opts.cc or DEFAULT_CAPABILITY) for c in known_caps)
    return Cluster(names=tuple(names), total_bytes=tuple(totals),
                   used_bytes=tuple(opts.used.get(i, 0) for i in range(len(names))),
                   context_bytes=opts.context, spec=spec.replace(" ", ""), capabilities=caps,
                   assumed_capability=opts.cc is None and None in known_caps)
