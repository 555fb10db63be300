import pytest
from torch import nn

from fednorm.methods.policy import POLICIES, keeps_bn_state, keeps_bn_statistics, local_state_keys, shared_state_keys
from fednorm.models import DigitCNN


def bn_keys(model):
    keys = set()
    for prefix, m in model.named_modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            keys |= {f"{prefix}.{n}" for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    return keys


def layer_keys(model):
    """Every convolution's and linear layer's weight and bias, listed from the modules (not from the policy)."""
    return {f"{prefix}.{n}" for prefix, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))
            for n in ("weight", "bias") if getattr(m, n) is not None}


def test_fedbn_keeps_every_bn_tensor_local_and_nothing_else():
    model = DigitCNN(width=0.125)
    local = local_state_keys(model, "local_bn")
    assert local == bn_keys(model)
    assert len(local) == 5 * 5  # 3 BatchNorm2d + 2 BatchNorm1d, five tensors each
    shared = shared_state_keys(model, "local_bn")
    assert set(shared) == layer_keys(model)  # every convolution and linear layer, nothing of BN


def test_silobn_keeps_statistics_local_and_shares_affine():
    model = DigitCNN(width=0.125)
    local = local_state_keys(model, "local_bn_stats")
    assert local == {k for k in bn_keys(model) if k.rsplit(".", 1)[1] in ("running_mean", "running_var", "num_batches_tracked")}
    shared = set(shared_state_keys(model, "local_bn_stats"))
    # every convolution and linear layer, and the BN affine (averaged)
    assert shared == layer_keys(model) | {k for k in bn_keys(model) if k.endswith(("weight", "bias"))}


def test_fedavg_shares_everything_and_singleset_nothing():
    model = DigitCNN(width=0.125)
    assert local_state_keys(model, "shared") == frozenset()
    assert set(shared_state_keys(model, "shared")) == set(model.state_dict())
    assert local_state_keys(model, "local_all") == set(model.state_dict())


def test_selection_is_by_module_type_not_name():
    model = nn.Sequential()
    model.add_module("downsample", nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    model.add_module("bn_projection", nn.Linear(4, 4))  # a name containing "bn" that is not a BatchNorm
    local = local_state_keys(model, "local_bn")
    assert "downsample.1.weight" in local and "downsample.1.running_var" in local
    assert not any(k.startswith("bn_projection") for k in local)


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="local_bn"):
        local_state_keys(DigitCNN(width=0.125), "bn_local")


def test_group_norm_model_has_no_bn_state():
    model = DigitCNN(width=0.25, norm="gn")
    assert local_state_keys(model, "local_bn") == frozenset()
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_predicates_agree_with_the_keys_each_policy_keeps(policy):
    """keeps_bn_statistics: the client keeps its own running statistics; keeps_bn_state: the policy keeps BN state
    local and nothing else (what the config and engine checks rely on)."""
    model = DigitCNN(width=0.125)
    local = local_state_keys(model, policy)
    stats = {k for k in bn_keys(model) if k.endswith(("running_mean", "running_var"))}
    assert keeps_bn_statistics(policy) == (stats <= local)
    assert keeps_bn_state(policy) == (bool(local) and local <= bn_keys(model))


def test_predicates_reject_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown norm state policy"):
        keeps_bn_statistics("local_everything")
