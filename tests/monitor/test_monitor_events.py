"""The monitor on fake cards (tests/support/fake_cards.py, the CUDA runtime protocol with a
memory model): drift past the plan's bucket, another process taking memory, fragmentation,
out-of-memory forensics, the peaks the user's code reads, the interval, the rate limit.

The plan's figures are what a planner measures: each bucket's peak is a probe of the same
memory model at the bucket's length (:func:`fake_cards.probe_peak`), not a formula copied
from the monitor."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dptune.lengths.plan import BucketPlan, LengthPlan
from dptune.monitor import EventKind, MemoryMonitor, MonitorWarning, load_run
from dptune.units import MiB

from fake_cards import GiB, FakeCards, probe_peak, train_step

EDGES = (128, 256)
CHUNKS = (4, 4)                       # a DataParallel split of 8 over two cards


def length_plan(total: int = 24 * GiB, headroom: int = 256 * MiB) -> LengthPlan:
    buckets = tuple(BucketPlan(lo=lo, length=edge, samples=100, chunk_sizes=CHUNKS,
                               peak_bytes=tuple(probe_peak(c, edge) for c in CHUNKS),
                               binding_card=0, certified=True)
                    for lo, edge in zip((0,) + EDGES[:-1], EDGES))
    budget = total - 500 * MiB - headroom
    return LengthPlan(buckets=buckets, devices=("Fake 24GB",) * 2, budget_bytes=(budget, budget),
                      headroom_bytes=headroom)


def run(monitor: MemoryMonitor, cards: FakeCards, lengths, batch: int = 8, before=None) -> None:
    """A DataParallel-shaped loop: each card runs its chunk of every batch."""
    for k, length in enumerate(lengths, start=1):
        if before is not None:
            before(k)
        with monitor.step(batch_size=batch, length=length):
            for d, c in enumerate(CHUNKS):
                train_step(cards, d, c * batch // sum(CHUNKS), length, setup=not cards.allocated[d])


def kinds(monitor: MemoryMonitor, kind: EventKind) -> list[tuple[int, int]]:
    return [(e.step, e.card) for e in monitor.events if e.kind is kind]


def quiet_monitor(*args, **kwargs) -> MemoryMonitor:
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # the monitor warns nothing at its start on cards
        return MemoryMonitor(*args, **kwargs)


# ---- drift ---------------------------------------------------------------------------------

@pytest.mark.parametrize("reset_peaks", [False, True])
def test_drift_fires_at_the_step_the_length_grows_past_the_plan_and_not_before(reset_peaks, tmp_path):
    cards = FakeCards()
    mon = quiet_monitor(length_plan(), runtime=cards, run_dir=tmp_path, reset_peaks=reset_peaks)
    lengths = [64, 100, 128, 200, 256, 320, 320, 128]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(mon, cards, lengths)
    mon.close()
    drift = kinds(mon, EventKind.DRIFT)
    # step 6 is the first past the longest bucket (<= 256), on both cards; steps 1-5 each
    # stay within their bucket's probe. Steps 7 and 8 reserve nothing new (the cache holds
    # step 6's memory): their reserved peak is step 6's, not compared again with their shape.
    expected = [(6, 0), (6, 1)]
    assert drift == expected
    assert kinds(mon, EventKind.OFF_PLAN) == [(6, 0), (6, 1)]
    ev = next(e for e in mon.events if e.kind is EventKind.DRIFT)
    plan = length_plan()
    assert ev.predicted_bytes == plan.buckets[-1].peak_bytes[0]
    assert ev.measured_bytes == probe_peak(4, 320) > ev.predicted_bytes + mon.margin
    assert (ev.batch_size, ev.length) == (8, 320)
    lines = [str(w.message) for w in caught if issubclass(w.category, MonitorWarning)]
    drift_lines = [s for s in lines if "over the plan's" in s]
    assert len(drift_lines) == 2       # one per card
    assert "card 1, step 6, batch 8 x length 320" in drift_lines[1]
    assert "past the plan's longest bucket (<= 256)" in drift_lines[1]
    assert "Do:" in drift_lines[1]
    # every event is in the record, the warned and the quiet ones
    rec = load_run(tmp_path)
    assert [(e.step, e.card) for e in rec.events if e.kind is EventKind.DRIFT] == expected


def test_a_step_within_its_bucket_is_compared_with_that_bucket():
    """Length 100 belongs to the bucket <= 128; a model whose memory grew (another layer)
    drifts there, and the row holds that bucket's prediction."""
    cards = FakeCards()
    mon = quiet_monitor(length_plan(), runtime=cards)
    run(mon, cards, [100])
    assert mon.events == []
    cards.alloc(0, 1 * GiB)               # the model grew by 1 GiB on card 0 only
    with pytest.warns(MonitorWarning, match="card 0, step 2, batch 8 x length 100: reserved peak"):
        run(mon, cards, [100])
    assert kinds(mon, EventKind.DRIFT) == [(2, 0)]
    assert mon.last[0]["predicted_peak_bytes"] == length_plan().buckets[0].peak_bytes[0]


def test_every_n_steps_reads_the_cards_and_compares_with_the_intervals_largest_prediction():
    cards = FakeCards()
    mon = quiet_monitor(length_plan(), runtime=cards, every=3)
    run(mon, cards, [256, 64, 64, 64, 64, 64])
    assert [r["step"] for r in mon.rows] == [3, 3, 6, 6]
    first, second = mon.rows[0], mon.rows[2]
    assert first["predicted_peak_bytes"] == length_plan().buckets[1].peak_bytes[0]  # step 1's 256
    assert second["predicted_peak_bytes"] == length_plan().buckets[0].peak_bytes[0]
    assert mon.events == []
    assert cards.stats_calls == 2 + 4     # one read per card at the start, then 2 readings x 2 cards


# ---- headroom ------------------------------------------------------------------------------

@pytest.mark.parametrize("nvml", [True, False])
def test_another_process_taking_memory_warns_of_the_headroom(nvml):
    cards = FakeCards(nvml=nvml)
    mon = quiet_monitor(runtime=cards)
    # the step's reserved peak is the state plus 4 x 128 tokens: take all but 188 MiB of it
    peak = probe_peak(4, 128)
    take = cards.capacity(1) - peak - 188 * MiB

    def other_process(k):
        if k == 5:
            cards.take(1, take)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(mon, cards, [128] * 7, before=other_process)
        cards.take(1, -take)                                        # the other process ends ...
        run(mon, cards, [128], before=None)
        cards.take(1, take)                                         # ... and comes back
        run(mon, cards, [128], before=None)
    assert kinds(mon, EventKind.HEADROOM) == [(5, 1), (9, 1)]   # when it starts, not each step it lasts
    assert mon.last[1]["headroom_bytes"] == 188 * MiB
    assert mon.last[0]["headroom_bytes"] > 20 * GiB
    lines = [str(w.message) for w in caught if "left on the" in str(w.message)]
    # the second is recorded, not warned: within quiet_steps of the first on that card
    assert len(lines) == 1 and "card 1, step 5" in lines[0] and "188.0 MiB left" in lines[0]
    assert ("NVML sees" in lines[0]) is nvml
    assert "was 500.0 MiB when the monitor started" in lines[0]


# ---- fragmentation -------------------------------------------------------------------------

@pytest.mark.parametrize("conf, advice", [(None, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
                                          ("expandable_segments:True", "already on")])
def test_rising_retries_advise_expandable_segments(monkeypatch, conf, advice):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    cards = FakeCards()
    cards.fragment(0)                     # retries before the monitor started do not count
    mon = quiet_monitor(runtime=cards)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(mon, cards, [64] * 5, before=lambda k: cards.fragment(0) if k == 3 else None)
    assert kinds(mon, EventKind.FRAGMENTATION) == [(3, 0)]
    line = next(str(w.message) for w in caught if "num_alloc_retries" in str(w.message))
    assert "rose from 1 to 2" in line and advice in line


# ---- out of memory -------------------------------------------------------------------------

def test_out_of_memory_writes_forensics_and_reraises_the_same_exception(tmp_path, monkeypatch):
    from dptune import _torch_private

    history, dumped = [], []
    monkeypatch.setattr(_torch_private, "record_memory_history", lambda n: history.append(n) or True)

    def dump(path):
        dumped.append(path)
        open(path, "wb").close()
        return True

    monkeypatch.setattr(_torch_private, "dump_memory_snapshot", dump)
    cards = FakeCards(others=[0, 19 * GiB])       # card 1 has ~4.5 GiB for this process
    mon = quiet_monitor(length_plan(), runtime=cards, run_dir=tmp_path, snapshot=True)
    assert history == [100_000]
    raised = []

    def step_raising(length):
        with mon.step(batch_size=8, length=length):
            for d in (0, 1):
                try:
                    train_step(cards, d, 4, length, setup=not cards.allocated[d])
                except torch.OutOfMemoryError as e:
                    raised.append(e)
                    raise

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_raising(128)
        with pytest.raises(torch.OutOfMemoryError) as info:
            step_raising(512)
    assert info.value is raised[0]                       # the same object, not a new one
    assert info.traceback[-1].name == "alloc"            # its traceback untouched
    assert info.value.__cause__ is None and info.value.__context__ is None
    forensics = json.loads((tmp_path / "oom.rank0.json").read_text())
    assert forensics["card"] == 1 and forensics["step"] == 2
    assert (forensics["batch_size"], forensics["length"]) == (8, 512)
    on_1 = forensics["cards"][1]
    assert on_1["predicted_peak_bytes"] == length_plan().buckets[-1].peak_bytes[1]
    assert "past the plan's longest bucket" in on_1["off_plan"]
    assert on_1["last_reading"]["step"] == 1 and on_1["at_error"]["num_ooms"] == 1
    assert forensics["snapshot"] == "oom.rank0.step2.pickle" and (tmp_path / forensics["snapshot"]).exists()
    assert kinds(mon, EventKind.OOM) == [(2, 1)]
    assert any("out of memory on card 1" in str(w.message) for w in caught)


def test_an_error_that_is_not_out_of_memory_goes_on_and_is_not_recorded():
    cards = FakeCards()
    mon = quiet_monitor(runtime=cards)
    err = ValueError("the user's bug")
    with pytest.raises(ValueError) as info:
        with mon.step(batch_size=8):
            raise err
    assert info.value is err and mon.events == [] and list(mon.rows) == []


def test_a_caught_out_of_memory_shows_as_num_ooms_rising():
    cards = FakeCards(others=[0, 19 * GiB])
    mon = quiet_monitor(runtime=cards)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mon.step(batch_size=8, length=512):
            try:
                train_step(cards, 1, 4, 512, setup=True)
            except torch.OutOfMemoryError:
                pass                       # e.g. a search for the largest batch that fits
    assert kinds(mon, EventKind.OOM) == [(1, 1)]


# ---- what the user's code reads ------------------------------------------------------------

def test_by_default_the_peaks_the_user_reads_are_left_alone():
    alone, watched = FakeCards(), FakeCards()
    lengths = [256, 64, 128]
    for length in lengths:                          # the same loop, unwatched
        for d, c in enumerate(CHUNKS):
            train_step(alone, d, c, length, setup=not alone.allocated[d])
    mon = quiet_monitor(runtime=watched)
    run(mon, watched, lengths)
    assert watched.resets == [0, 0]
    assert [watched.max_memory_allocated(d) for d in (0, 1)] == [alone.max_memory_allocated(d) for d in (0, 1)]
    assert [r["allocated_bytes.all.peak"] for r in mon.rows if r["card"] == 0] == [alone.peak[0]] * 3


def test_reset_peaks_gives_each_readings_peak_and_keeps_the_runs_aside():
    cards = FakeCards()
    mon = quiet_monitor(runtime=cards, reset_peaks=True)
    run(mon, cards, [256, 64, 128])
    assert cards.resets == [4, 4]                   # at the start, then after each reading
    per_step = [r["allocated_bytes.all.peak"] for r in mon.rows if r["card"] == 0]
    assert per_step[1] < per_step[2] < per_step[0]     # 64 < 128 < 256: each step's own
    # the reserved peak stays at what the cache holds since step 1
    assert [r["reserved_bytes.all.peak"] for r in mon.rows if r["card"] == 0] == [probe_peak(4, 256)] * 3
    assert mon.run_peaks()[0] == {"card": 0, "allocated_bytes.all.peak": per_step[0],
                                  "reserved_bytes.all.peak": probe_peak(4, 256)}


def test_warnings_are_rate_limited_and_every_event_is_recorded(tmp_path):
    cards = FakeCards()
    # the allocated peak, reset after each reading, is each step's own: compared every step
    mon = quiet_monitor(length_plan(), runtime=cards, run_dir=tmp_path, reset_peaks=True, quiet_steps=10,
                        level="allocated")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(mon, cards, [512] * 30)
        mon.close()
    drift = kinds(mon, EventKind.DRIFT)
    assert len(drift) == 60                      # every step, both cards
    lines = [str(w.message) for w in caught if "over the plan's" in str(w.message)]
    assert len(lines) == 6                       # steps 1, 11, 21 on each card
    assert any("were recorded without a warning" in str(w.message) for w in caught)
    assert len(load_run(tmp_path).events) == len(mon.events)


def test_bad_settings_are_one_line_usage_errors():
    from dptune.errors import UsageError

    with pytest.raises(UsageError, match="every=...") as info:
        MemoryMonitor(runtime=FakeCards(), every=0)
    assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="names cards torch cannot see"):
        MemoryMonitor(runtime=FakeCards(n=2), devices=[2])
    with pytest.raises(UsageError, match="takes a TuneResult"):
        MemoryMonitor(plan=object(), runtime=FakeCards())


def test_the_snapshot_api_is_found_on_old_and_new_torch_and_missing_is_false(monkeypatch):
    import types

    from dptune import _torch_private

    calls = []

    def new(enabled="all", max_entries=0):
        calls.append(("new", enabled, max_entries))

    def old(enabled, max_entries=0):        # torch < 2.1: enabled is a bool
        if not isinstance(enabled, bool):
            raise TypeError("enabled must be a bool")
        calls.append(("old", enabled, max_entries))

    for fn in (new, old):
        monkeypatch.setattr(_torch_private, "_memory_module",
                            lambda fn=fn: types.SimpleNamespace(_record_memory_history=fn))
        assert _torch_private.record_memory_history(7) is True
    assert calls == [("new", "all", 7), ("old", True, 7)]
    monkeypatch.setattr(_torch_private, "_memory_module", lambda: types.SimpleNamespace())
    assert _torch_private.record_memory_history(7) is False
    assert _torch_private.dump_memory_snapshot("x.pickle") is False
