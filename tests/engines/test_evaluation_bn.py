"""federation.evaluation_bn: recomputed: each client's own BN statistics recomputed over its training split before
evaluation (BN recalibration), without touching the stored state that training goes on from."""

import copy

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fednorm.data.domain import normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method
from fednorm.methods.external import ExternalBN, reestimate_bn_statistics
from fednorm.models import DigitCNN
from fednorm.runs.config import ConfigWarning
from fednorm.runs.runner import build_engine, build_federation_data

from ..conftest import tiny_run_config


def _engine(clients, method, recompute):
    torch.manual_seed(3)
    return InProcessEngine(DigitCNN(width=0.125), clients, resolve_method(method),
                           LocalTraining(batch_size=4, lr=0.05),
                           Federation(seed=0, channels_last=False, recompute_bn_statistics=recompute), normalize_batch)


def _clone(states):
    return {c: {k: v.clone() for k, v in s.items()} for c, s in states.items()}


@pytest.mark.parametrize("method", ["fedbn", "silobn"])
def test_recomputed_statistics_are_the_population_statistics_of_the_clients_training_split(tiny_clients, method):
    eng = _engine(tiny_clients, method, recompute=True)
    eng.run_round()
    assert eng.recomputes_bn_statistics
    stored = _clone(eng.local_states)
    evals = {e.client: e for e in eng.evaluate(("test",))}
    # evaluation-only: the stored local states (what the next round trains from) are unchanged
    for name, state in stored.items():
        for key, value in state.items():
            assert torch.equal(eng.local_states[name][key], value), (name, key)
    # the working model holds the last evaluated client's model: its first BN layer's running statistics are the
    # mean and biased variance over all of that client's training images of the layer's input
    last = tiny_clients[-1]
    reference = DigitCNN(width=0.125)
    reference.load_state_dict({**eng.global_state, **stored[last.name]})
    reference.eval()
    first_bn = next(m for m in reference.modules() if isinstance(m, _BatchNorm))
    inputs = []
    handle = first_bn.register_forward_pre_hook(lambda module, args: inputs.append(args[0].double()))
    with torch.no_grad():
        reference(eng.prepare(last.train.x))
    handle.remove()
    x = inputs[0]
    mean = x.mean((0, 2, 3))
    var = x.var((0, 2, 3), correction=0)
    working_bn = next(m for m in eng.model.modules() if isinstance(m, _BatchNorm))
    torch.testing.assert_close(working_bn.running_mean.double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(working_bn.running_var.double(), var, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(working_bn.running_mean, stored[last.name][_bn_key(reference, first_bn)])
    # each client is scored with its model, its statistics recomputed on its own training split
    for client in tiny_clients:
        model = DigitCNN(width=0.125)
        model.load_state_dict({**eng.global_state, **stored[client.name]})
        model = reestimate_bn_statistics(model, client.train, eng.prepare,
                                         ExternalBN(batch_size=eng.federation.eval_batch_size, momentum=None))
        with torch.no_grad():
            predicted = model(eng.prepare(client.test.x)).argmax(1)
        assert evals[client.name].accuracy == pytest.approx((predicted == client.test.y).float().mean().item())


def _bn_key(model, layer):
    name = next(n for n, m in model.named_modules() if m is layer)
    return f"{name}.running_mean"


def test_recomputing_changes_the_scores_not_the_training(tiny_clients):
    """Two runs that differ only in the option train the same models; their evaluations differ."""
    stored, recomputed = _engine(tiny_clients, "fedbn", False), _engine(tiny_clients, "fedbn", True)
    for eng in (stored, recomputed):
        eng.run_round()
        eng.evaluate(("test",))
        eng.run_round()
    for key, value in stored.global_state.items():
        assert torch.equal(recomputed.global_state[key], value), key
    for name in stored.local_states:
        for key, value in stored.local_states[name].items():
            assert torch.equal(recomputed.local_states[name][key], value), (name, key)
    losses = [(a.loss, b.loss) for a, b in zip(stored.evaluate(("test",)), recomputed.evaluate(("test",)))]
    assert all(a != b for a, b in losses)


def test_methods_sharing_their_statistics_are_evaluated_as_they_are(tiny_clients):
    """FedAvg has no per-client statistics: the option leaves its evaluation exactly as it is."""
    plain, option = _engine(tiny_clients, "fedavg", False), _engine(tiny_clients, "fedavg", True)
    assert not option.recomputes_bn_statistics
    for eng in (plain, option):
        eng.run_round()
    for a, b in zip(plain.evaluate(("test",)), option.evaluate(("test",))):
        assert (a.client, a.accuracy, a.loss) == (b.client, b.accuracy, b.loss)


def test_the_run_config_passes_the_option_and_checks_it_applies():
    config = tiny_run_config("methods=[fedbn, silobn]", "federation.evaluation_bn=recomputed")
    clients = build_federation_data(config, None)
    assert all(build_engine(config, m, 0, clients).recomputes_bn_statistics for m in config.methods)
    default = tiny_run_config("methods=[fedbn]")
    assert default.federation.evaluation_bn == "stored"
    assert not build_engine(default, default.methods[0], 0, clients).recomputes_bn_statistics
    with pytest.raises(ValueError, match="no method here keeps any"):
        tiny_run_config("methods=[fedavg, fedavg_gn]", "federation.evaluation_bn=recomputed")
    with pytest.raises(ValueError, match="bn_mode: batch keeps none"):
        tiny_run_config("methods=[fedbn]", "model.name=densenet121", "model.bn_mode=batch",
                        "federation.evaluation_bn=recomputed")
    with pytest.warns(ConfigWarning, match="fedavg share theirs"):
        tiny_run_config("methods=[fedbn, fedavg]", "federation.evaluation_bn=recomputed")
