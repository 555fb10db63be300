import pytest
import torch

from fednorm.methods.aggregation import UpdateError, WeightedMean, accumulator_dtype, all_finite, client_weights


def test_client_weights():
    assert client_weights([10, 30], "samples") == [0.25, 0.75]
    assert client_weights([10, 30], "uniform") == [0.5, 0.5]
    with pytest.raises(ValueError, match="weighting"):
        client_weights([1], "median")


def test_weighted_mean_of_floats_and_max_of_counters():
    ref = {"w": torch.zeros(2), "n": torch.tensor(0, dtype=torch.long)}
    agg = WeightedMean(ref)
    agg.add({"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(7)}, 0.25)
    agg.add({"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}, 0.75)
    out = agg.result()
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 5.0]))
    assert out["n"].dtype == torch.long and int(out["n"]) == 7
    assert out["w"].dtype == torch.float32


def test_bad_updates_are_rejected_with_the_client_named():
    ref = {"w": torch.zeros(2)}
    with pytest.raises(UpdateError, match="client 'a'.*non-finite"):
        WeightedMean(ref).add({"w": torch.tensor([float("nan"), 0.0])}, 1.0, "a")
    with pytest.raises(UpdateError, match="shape"):
        WeightedMean(ref).add({"w": torch.zeros(3)}, 1.0, "b")
    with pytest.raises(UpdateError, match="missing"):
        WeightedMean(ref).add({"v": torch.zeros(2)}, 1.0, "c")


def test_all_finite_is_exact_even_where_the_fast_sum_overflows():
    big = torch.full((1000,), 3e38)  # finite, but its float32 sum overflows: the element-wise check decides
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(1000)
        x[517] = bad
        assert not all_finite(x)
    mixed = torch.tensor([float("inf"), -float("inf")])  # the sum is NaN; still caught
    assert not all_finite(mixed)
    assert not all_finite(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))


def test_weighted_mean_accumulates_in_the_entries_precision():
    assert accumulator_dtype(torch.float32) == torch.float32
    assert accumulator_dtype(torch.float64) == torch.float64  # FBN's float64 exactness tests stay exact
    assert accumulator_dtype(torch.bfloat16) == torch.float32
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(1000, generator=g, dtype=torch.float64)} for _ in range(7)]
    weights = [0.1, 0.2, 0.05, 0.15, 0.3, 0.1, 0.1]
    mean = WeightedMean(states[0])
    for s, w in zip(states, weights):
        mean.add(s, w)
    want = sum(w * s["w"] for s, w in zip(states, weights))
    torch.testing.assert_close(mean.result()["w"], want, rtol=0, atol=1e-15)
    mean32 = WeightedMean({"w": states[0]["w"].float()})
    for s, w in zip(states, weights):
        mean32.add({"w": s["w"].float()}, w)
    out = mean32.result()["w"]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
