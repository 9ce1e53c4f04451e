"""The command line's inputs: argparse's types for the flags (each bad value one line,
naming the flag), and the checks argparse cannot make alone, made before any probing: output
paths (too long for the file system, a folder holding something else), the size of a
simulated cluster, the card the outputs are gathered on; and the budget level's flags
(``--budget-level``, ``--allocator``, ``--nccl-bytes``: :func:`level_arguments`, shared by
``search`` and ``plan``, checked by :func:`check_level_flags`).

The bounds, and why:

- :data:`MAX_SIMULATED_CARDS`: every probe simulates each card (a DDP plan, each rank), so
  the time grows with their number, faster than linearly: measured on two busy CPU cores
  with a one-layer model, a search on 1024 cards took 27 s for 4 probes and on 4096 cards
  141 s; a plan for 1000 ranks 7 s, for 10000 ranks more than 5 minutes. DataParallel
  drives the cards of one machine, rarely more than 16.
- :data:`MAX_HEADROOM_BYTES`: no card holds a petabyte; a larger ``--headroom`` is a typo.
- :data:`dptune.step.workload.MAX_ACCUMULATE`: see there.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Optional, Union

from dptune.budget import DEFAULT_LEVEL
from dptune.errors import OutputError, UsageError
from dptune.split import MAX_BATCH_SIZE
from dptune.units import format_bytes, parse_bytes
from dptune.step.workload import ACCUMULATE_BOUND, MAX_ACCUMULATE

if TYPE_CHECKING:  # pragma: no cover
    from dptune.settings import Budget

__all__ = ["MAX_SIMULATED_CARDS", "MAX_HEADROOM_BYTES", "REPORT_TEMP_ROOM", "check_out",
           "check_plan_out", "check_cards", "shorten",
           # argparse types
           "card_or_auto", "positive_int", "positive_float", "batch_size_arg", "byte_size",
           "headroom_arg", "accumulate_arg", "out_path", "device_ids_arg", "budget_level_arg",
           "allocator_arg", "nccl_bytes_arg", "level_arguments", "check_level_flags",
           "budget_of", "check_nccl_bytes"]

#: The most cards ``--simulate`` takes (``search`` and ``plan``); see the module docstring.
MAX_SIMULATED_CARDS = 1024

#: The largest ``--headroom``: 1 PiB, more than any card holds.
MAX_HEADROOM_BYTES = 2**50

#: A report folder is written under a temporary name beside it first, ``.NAME.xxxxxxxx.tmp``:
#: that many characters longer than its own name.
REPORT_TEMP_ROOM = 14

#: A plan written as ``NAME.json`` goes through ``NAME.json.tmpPID`` (a pid has <= 7 digits).
PLAN_TEMP_ROOM = 11

#: What a plan folder holds (``DDPPlan.save``).
PLAN_FILES = ("plan.json", "summary.md", "report.html")


# ---- argparse types ------------------------------------------------------------------------

def card_or_auto(text: str) -> Union[int, str]:
    """``--output-device``: a card index or ``auto``."""
    if text == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a card index (0, 1, ...) or 'auto'")
    return k


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def batch_size_arg(text: str) -> int:
    """``--batch-size``: at most :data:`dptune.split.MAX_BATCH_SIZE`."""
    value = positive_int(text)
    if value > MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text} is beyond what any cluster holds (at most {MAX_BATCH_SIZE:,} samples); give "
            "the total batch over all cards, e.g. 256")
    return value


def global_batch_arg(text: str) -> int:
    """``--global-batch``: at most :data:`dptune.split.MAX_BATCH_SIZE`, as ``--batch-size``
    (a larger one is a typo; its micro-batch counts alone would take minutes to list)."""
    value = positive_int(text)
    if value > MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text} is beyond what any cluster trains in one optimizer step (at most "
            f"{MAX_BATCH_SIZE:,} samples); give the samples per optimizer step, e.g. 4096")
    return value


def byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def headroom_arg(text: str) -> int:
    """``--headroom``: a byte size up to :data:`MAX_HEADROOM_BYTES`."""
    value = byte_size(text)
    if value > MAX_HEADROOM_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text} is more than any card holds (at most {format_bytes(MAX_HEADROOM_BYTES)}); "
            "give the memory to keep free on each card, e.g. 1GiB or 512MiB")
    return value


def budget_level_arg(text: str) -> str:
    """``--budget-level``: ``allocated`` or ``reserved`` (:class:`dptune.budget.BudgetLevel`)."""
    if text not in ("allocated", "reserved"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a budget level: give 'reserved' (the caching allocator's reserved "
            "peak plus NCCL, the default) or 'allocated' (the allocator's allocated peak)")
    return text


def allocator_arg(text: str) -> str:
    """``--allocator``: caching-allocator options in ``PYTORCH_CUDA_ALLOC_CONF`` syntax,
    checked here (the text is kept: the tuner parses it again)."""
    from dptune.backends.simulated.allocator_config import AllocatorConfig

    try:
        AllocatorConfig.parse(text)
    except (UsageError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def nccl_bytes_arg(text: str) -> int:
    """``--nccl-bytes``: NCCL's buffers per card, a byte size up to :data:`MAX_HEADROOM_BYTES`."""
    value = byte_size(text)
    if value > MAX_HEADROOM_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text} is more than any card holds (at most {format_bytes(MAX_HEADROOM_BYTES)}); "
            "give NCCL's buffers per card, e.g. 1600MB (what NCCL_DEBUG=INFO or NVML shows)")
    return value


def level_arguments(p: argparse.ArgumentParser) -> None:
    """``--budget-level``, ``--allocator`` and ``--nccl-bytes`` (``search`` and ``plan``)."""
    g = p.add_argument_group("budget level (what is checked against each card's budget)")
    g.add_argument("--budget-level", type=budget_level_arg, default=DEFAULT_LEVEL.value,
                   metavar="reserved|allocated",
                   help="reserved (the default): the caching allocator's reserved peak plus "
                        "NCCL's buffers, what runs out on a card (on simulated cards predicted by "
                        "a model of the allocator, checked on one H200); allocated: the "
                        "allocator's allocated peak (max_memory_allocated), the headroom "
                        "covering the rest")
    g.add_argument("--allocator", type=allocator_arg, default=None, metavar="CONF",
                   help="the caching allocator's options for the reserved level, in "
                        "PYTORCH_CUDA_ALLOC_CONF syntax, e.g. "
                        "'expandable_segments:True,max_split_size_mb:128' (default: "
                        "PYTORCH_CUDA_ALLOC_CONF, read only at --budget-level reserved, the "
                        "default)")
    g.add_argument("--nccl-bytes", type=nccl_bytes_arg, default=None, metavar="SIZE",
                   help="NCCL's buffers per card at the reserved level, e.g. 1600MB (default: "
                        "1.6 GB per card on runs of more than one card, 0 on one card)")


def check_level_flags(args: argparse.Namespace) -> None:
    """``--allocator`` and ``--nccl-bytes`` only mean something at the reserved level."""
    if args.budget_level != "reserved":
        given = [f for f, v in (("--allocator", args.allocator), ("--nccl-bytes", args.nccl_bytes))
                 if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise UsageError(f"{' and '.join(given)} {verb} only at --budget-level reserved (the "
                             f"default); drop --budget-level {args.budget_level} or "
                             f"{' and '.join(given)}")


def budget_of(args: argparse.Namespace) -> "Budget":
    """The budget the flags ask for (``--budget-level``, ``--headroom``, ``--allocator``,
    ``--nccl-bytes``), checked and built once."""
    from dptune.settings import Budget

    check_level_flags(args)
    return Budget.at(level=args.budget_level, headroom=args.headroom, allocator=args.allocator,
                     nccl_bytes=args.nccl_bytes)


def check_nccl_bytes(nccl_bytes: Optional[int], simulate: Optional[str],
                     headroom: Optional[int] = None) -> None:
    """``--nccl-bytes`` at least a simulated card's whole budget (its memory less the CUDA
    context, others' use and the headroom, ``None``: the reserved level's default): NCCL's
    buffers alone would fill it, so no batch could fit. Named before any probing, with the
    flag (it ended in "try a smaller batch", or an internal error, once)."""
    if nccl_bytes is None or simulate is None:
        return
    from dptune import parse_cluster
    from dptune.budget import DEFAULT_HEADROOM, BudgetLevel

    room = DEFAULT_HEADROOM[BudgetLevel.RESERVED] if headroom is None else headroom
    for d in parse_cluster(simulate).devices:
        budget = d.budget_bytes(room)
        if nccl_bytes >= budget:
            raise UsageError(f"--nccl-bytes {format_bytes(nccl_bytes)} is at least card "
                             f"{d.index}'s whole budget ({format_bytes(max(budget, 0))}: its "
                             "memory less the CUDA context, others' use and the headroom), so "
                             "no batch fits beside NCCL's buffers; give NCCL's buffers per card, "
                             "e.g. 1600MB (what NCCL_DEBUG=INFO or NVML shows)")


def accumulate_arg(text: str) -> int:
    """``--accumulate``: 1 to :data:`dptune.step.workload.MAX_ACCUMULATE` micro-batches."""
    value = positive_int(text)
    if value > MAX_ACCUMULATE:
        raise argparse.ArgumentTypeError(f"{text}: {ACCUMULATE_BOUND}")
    return value


def out_path(text: str) -> str:
    """``--out``: not empty (an empty one fell back to the default folder, silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is no path; give a folder, or leave --out "
                                         "out for the default folder under reports/")
    return text


def device_ids_arg(text: str) -> list[int]:
    """``--devices``: distinct GPU indices, e.g. ``0,1,2,3``."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(
            f"expected distinct GPU indices separated by commas, e.g. 0,1,2,3, got {text!r}")
    return ids


# ---- checks before any work ----------------------------------------------------------------

def shorten(text: str, width: int = 120) -> str:
    """``text`` quoted, its middle left out when longer than ``width``."""
    if len(text) <= width:
        return repr(text)
    return repr(text[:width // 2] + "..." + text[-20:])


def _limits(path: str) -> tuple[int, int]:
    """(longest name, longest path) on the file system ``path`` would be created on."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):   # no pathconf (Windows) or no answer
        return 255, 4096


def _check_lengths(path: str, flag: str, room: int) -> None:
    """A name or a path longer than the file system takes: one line, before any work.
    ``room``: characters the last name needs beyond its own (a temporary name beside it)."""
    name_max, path_max = _limits(path)
    parts = [p for p in path.split(os.sep) if p]
    for i, part in enumerate(parts):
        size = len(os.fsencode(part))
        extra = room if i == len(parts) - 1 else 0
        if size + extra > name_max:
            unit = "characters" if part.isascii() else "bytes"
            why = (f"more than the {name_max} this file system allows in one name" if not extra
                   else f"and it is first written under a name {extra} longer, more than the "
                        f"{name_max} this file system allows in one name")
            raise OutputError(f"{flag} {shorten(path)}: the name {shorten(part, 30)} has {size} "
                              f"{unit}, {why}; give a shorter name")
    size = len(os.fsencode(os.path.abspath(path))) + room
    if size >= path_max:
        raise OutputError(f"{flag} {shorten(path)}: the path has {size} bytes with its folder, "
                          f"more than the {path_max - 1} this system allows; give a shorter path")


def check_out(path: str, flag: str = "--out", *, room: int = 0, report: bool = False) -> None:
    """:func:`dptune.report.check_output_folder` for ``path``, with names too long for the
    file system and any other refusal of the system (its reason) as one line."""
    from dptune.report import check_output_folder

    _check_lengths(path, flag, room)
    try:
        check_output_folder(path, flag, report=report)
    except OSError as e:
        raise OutputError(f"{flag} {shorten(path)}: {e.strerror or type(e).__name__}; give a "
                          "folder you can write to") from None


def check_plan_out(path: str, flag: str = "--out") -> None:
    """``dptune plan --out``: a ``.json`` file that is new or a plan, or a folder that is new,
    empty or a plan's (never a search report's, whose summary.md it would overwrite).
    ``flag`` names the path in the message (``"the default folder"`` when --out was not given)."""
    with_out = "" if flag == "--out" else " with --out"
    if path.endswith(".json"):
        check_out(os.path.dirname(path) or ".", flag)
        _check_lengths(path, flag, PLAN_TEMP_ROOM)
        if os.path.lexists(path):
            from dptune.ddp.result import is_plan_path

            if not (os.path.isfile(path) and is_plan_path(path)):
                raise OutputError(f"{flag} {shorten(path)} already exists and is not a dptune "
                                  f"plan; give a new file name or a folder{with_out}")
        return
    check_out(path, flag)
    if os.path.isdir(path):
        foreign = sorted(n for n in os.listdir(path) if n not in PLAN_FILES)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise OutputError(f"{flag} {shorten(path)} already holds files that are not a dptune "
                              f"plan ({shown}); give a new or empty folder{with_out}")


def check_cards(simulate: Optional[str], devices: Optional[list[int]] = None,
                output_device: Union[int, str] = 0) -> Optional[int]:
    """The number of cards ``--simulate`` or ``--devices`` names (``None`` when neither:
    the tuner picks them), refusing more than :data:`MAX_SIMULATED_CARDS` simulated cards
    and an ``--output-device`` that is not one of them."""
    n: Optional[int] = None
    where = ""
    if simulate is not None:
        from dptune import parse_cluster

        n = len(parse_cluster(simulate))
        where = f"--simulate {shorten(simulate, 40)}"
        if n > MAX_SIMULATED_CARDS:
            raise UsageError(
                f"{where} has {n:,} cards, more than the {MAX_SIMULATED_CARDS} dptune simulates: "
                "every probe simulates each card, so the time grows with their number (minutes "
                f"per probe past a thousand); give at most {MAX_SIMULATED_CARDS} cards")
    elif devices:
        n, where = len(devices), f"--devices {','.join(map(str, devices))}"
    if n is not None and isinstance(output_device, int) and output_device >= n:
        what = ("there is only card 0; leave --output-device out" if n == 1 else
                f"the cards are 0..{n - 1}; give one of them or 'auto'")
        raise UsageError(f"--output-device {output_device} with {where}: {what}")
    return n
