"""The certificate benchmark's table at a level: a largest batch above the bisection's ``B*``
with its split measured within budget disproves the reference (the surface is not monotone),
and says so instead of "WRONG"; a smaller one is WRONG."""

from __future__ import annotations

from benchmarks.certificate_levels import level_table


def row(dptune: int, beyond: bool) -> dict:
    return dict(case="c", level="reserved", best=3071, even=2367, dptune=dptune,
                dptune_even=2367, split_fits=True, even_open=False, probes=12, certified=True,
                best_exact=dptune == 3071, even_exact=True, monotone=True, looked=None,
                looked_closed=False, oracle=None, oracle_upto=0, beyond=beyond)


def test_a_disproven_reference_is_named_and_a_short_answer_is_wrong() -> None:
    above, short, exact = (level_table([r]).splitlines()[-1]
                           for r in (row(3276, True), row(3000, False), row(3071, False)))
    assert "above B*, which its split disproves" in above and "WRONG" not in above
    assert "| WRONG |" in short
    assert "above B*" not in exact and "WRONG" not in exact
