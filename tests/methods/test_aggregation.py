import pytest
import torch

from fednorm.methods.aggregation import UpdateError, WeightedMean, client_weights


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
