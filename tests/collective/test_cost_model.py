"""The all-reduce cost model: its predictions, its choice, and fitting it to measurements."""

import pytest

from elasticdl_strategy.collective import cost_model
from elasticdl_strategy.collective.cost_model import DIRECT_SEND_BYTES, PathCosts, choose, fit, predict

COSTS = PathCosts(overhead_s=20e-6, latency_s=30e-6, s_per_byte=0.2e-9, reduce_s_per_byte=0.3e-9)


def test_predictions_follow_the_algorithms_message_and_byte_counts():
    s = 1 << 20
    o, lat, b, g = COSTS.overhead_s, COSTS.latency_s, COSTS.s_per_byte, COSTS.reduce_s_per_byte
    assert predict("direct", s, 4, COSTS) == pytest.approx(3 * (2 * o + s * b + s * g) + lat)
    assert predict("ring", s, 4, COSTS) == pytest.approx(6 * (2 * o + lat + s * b / 4) + 3 * s * g / 4)
    assert predict("recursive_doubling", s, 8, COSTS) == pytest.approx(3 * (2 * o + lat + s * b + s * g))
    folded = 2 * (2 * (2 * o + lat + s * b + s * g)) / 2 + 2 * (2 * o + lat + s * b) + s * g  # N = 5: 2 steps + fold
    assert predict("recursive_doubling", s, 5, COSTS) == pytest.approx(folded)
    assert predict("ring", s, 1, COSTS) == 0.0
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'tree'"):
        predict("tree", s, 4, COSTS)


def test_small_arrays_take_few_rounds_large_ones_the_ring_and_direct_stays_within_its_buffer_bound():
    assert choose(4096, 2, COSTS) in ("direct", "recursive_doubling")
    assert choose(4096, 1024, COSTS) == "recursive_doubling"  # 10 rounds, not 1023 messages or 2046 steps
    assert choose(256 << 20, 1024, COSTS) == "ring"
    assert choose(64 << 20, 2, COSTS) == "ring"
    for n in (2, 3, 8, 64):
        limit = DIRECT_SEND_BYTES // (n - 1)
        assert choose(limit + 4, n, COSTS) != "direct"


def test_fitting_recovers_the_costs_that_made_the_samples():
    samples = [
        (a, s, n, predict(a, s, n, COSTS))
        for a in cost_model.ALGORITHMS
        for s in (4096, 1 << 16, 1 << 20, 1 << 24)
        for n in (2, 4)
    ]
    fitted = fit(samples)
    for name in ("overhead_s", "latency_s", "s_per_byte", "reduce_s_per_byte"):
        assert getattr(fitted, name) == pytest.approx(getattr(COSTS, name), rel=1e-6), name
    with pytest.raises(ValueError, match="at least 4 samples"):
        fit(samples[:3])


def test_a_hierarchical_all_reduce_moves_the_slow_links_bytes_once_per_host():
    slow = PathCosts(overhead_s=20e-6, latency_s=100e-6, s_per_byte=8e-9, reduce_s_per_byte=0.3e-9)  # ~1 Gb/s
    flat = predict("ring", 64 << 20, 4, slow)
    two_hosts = cost_model.predict_hierarchical(64 << 20, hosts=2, per_host=2, local=COSTS, between=slow)
    assert flat / two_hosts > 1.3  # 1.5 times fewer bytes cross the slow link, less the local steps
