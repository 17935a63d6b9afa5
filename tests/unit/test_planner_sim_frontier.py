"""The frontier's reactive-with-overshoot schedule and its Pareto front (pure functions; the simulator runs
them in tests/integration/test_planner_simulate.py, the benchmark in test_bench_planner_frontier.py)."""

from __future__ import annotations

from dynamo.planner.sim.frontier import PhaseNeed, overshoot_script, pareto_front, reactive_script

# Decode grows at 120 s and shrinks at 420 s; prefill grows at 300 s.
NEEDS = [
    PhaseNeed(0, 120, 1, 1),
    PhaseNeed(120, 300, 1, 3),
    PhaseNeed(300, 420, 2, 3),
    PhaseNeed(420, 600, 1, 1),
]


def test_overshoot_adds_extra_replicas_to_the_pool_that_grew_for_the_hold() -> None:
    fleet = overshoot_script(NEEDS, extra=2, hold_s=60.0)
    assert fleet(100.0) == (1, 1)
    assert fleet(122.0) == (1, 1)  # not seen yet: 5 s to react
    assert fleet(125.0) == (1, 5) and fleet(184.9) == (1, 5)  # decode's need 3, plus 2 for 60 s
    assert fleet(185.0) == (1, 3)
    assert fleet(310.0) == (4, 3)  # prefill grew (1 -> 2): its extra; decode's need did not grow
    assert fleet(419.0) == (2, 3)  # the hold ended at 365 s
    assert fleet(421.0) == (1, 1)  # a phase that needs less shrinks the fleet when it begins


def test_the_hold_ends_with_the_phase_and_the_first_phase_grows_from_the_initial_fleet() -> None:
    fleet = overshoot_script([PhaseNeed(0, 50, 1, 2), PhaseNeed(50, 100, 1, 2)], extra=1, hold_s=600.0)
    assert fleet(0.0) == (1, 1) and fleet(5.0) == (1, 3) and fleet(49.0) == (1, 3)
    assert fleet(60.0) == (1, 2)  # the second phase needs no more than the first: no extra
    big = overshoot_script([PhaseNeed(0, 50, 12, 12)], extra=1, hold_s=30.0, initial=(12, 12))
    assert big(10.0) == (12, 12)  # started at its need: nothing grew


def test_without_extra_it_is_the_reactive_fleet() -> None:
    plain, none = reactive_script(NEEDS), overshoot_script(NEEDS, extra=0, hold_s=60.0)
    assert all(plain(t) == none(t) for t in range(5, 600, 5))


def test_the_pareto_front_keeps_what_nothing_beats_cheapest_first() -> None:
    pts = [(50.0, 0.4), (60.0, 0.5), (55.0, 0.6), (60.0, 0.55), (70.0, 0.9), (40.0, 0.4)]
    assert pareto_front(pts, lambda p: p[0], lambda p: p[1]) == [(50.0, 0.4), (60.0, 0.5), (70.0, 0.9)]
    # Equal points (a hold cut short by the phase's end is the same fleet): the first one given stays.
    tied = [("hold 180", 50.9, 0.545), ("hold 240", 50.9, 0.545), ("reactive", 36.6, 0.4)]
    assert [p[0] for p in pareto_front(tied, lambda p: p[1], lambda p: p[2])] == ["reactive", "hold 180"]
    assert pareto_front([], lambda p: p, lambda p: p) == []
