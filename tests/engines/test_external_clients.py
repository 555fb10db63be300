"""External clients (UniFed, FedBN App. G): never trained, evaluated from the global model under each mode."""

import torch

from fednorm.data.domain import ClientData, normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method
from fednorm.methods.external import ExternalBN, evaluate_external
from fednorm.models import DigitCNN

from ..conftest import make_split


def _engine(clients, method, external):
    torch.manual_seed(2)
    return InProcessEngine(DigitCNN(width=0.125), clients, resolve_method(method), LocalTraining(batch_size=8, lr=0.05),
                           Federation(seed=0, channels_last=False), normalize_batch, external_clients=external,
                           external_bn=ExternalBN(batch_size=8, momentum=0.5))


def test_external_clients_never_train_and_are_evaluated_in_every_mode(tiny_clients):
    outsider = ClientData("ext", "dx", make_split(10, seed=9, shift=120.0), make_split(24, seed=19, shift=120.0))
    eng = _engine(tiny_clients, "fedbn", [outsider])
    results = eng.run_round()
    assert "ext" not in results and "ext" not in eng.local_states
    evals = {e.client: e for e in eng.evaluate(("test",))}
    assert {"ext:global", "ext:test_time_bn", "ext:fedbn_average"} <= set(evals)
    # each mode equals the external module's function on the global model, with the internal BN states: the
    # configured test-time BN for test_time_bn, FedBN App. G's own protocol (the default) for fedbn_average
    model = eng.model
    model.load_state_dict(eng.global_state)
    states = [eng.local_states[c.name] for c in tiny_clients]
    for mode in ("global", "test_time_bn", "fedbn_average"):
        bn = ExternalBN(batch_size=8, momentum=0.5) if mode == "test_time_bn" else None
        expected = evaluate_external(model, outsider.test, eng.prepare, mode, bn, states)
        assert evals[f"ext:{mode}"].accuracy == expected.accuracy
        assert abs(evals[f"ext:{mode}"].loss - expected.loss) < 1e-6


def test_fedbn_average_of_a_method_with_shared_affine_uses_the_global_affine(tiny_clients):
    """SiloBN keeps only the BN statistics local (its affine is averaged like any parameter), FedAvg keeps
    nothing: for both, fedbn_average puts the global model's affine, with statistics from the external data."""
    outsider = ClientData("ext", "dx", make_split(10, seed=9, shift=120.0), make_split(24, seed=19, shift=120.0))
    for method in ("silobn", "fedavg"):
        eng = _engine(tiny_clients, method, [outsider])
        eng.run_round()
        assert not eng.bn_affine_is_local
        got = next(e for e in eng.evaluate(("test",)) if e.client == "ext:fedbn_average")
        model = eng.model
        model.load_state_dict(eng.global_state)
        expected = evaluate_external(model, outsider.test, eng.prepare, "fedbn_average", None, [eng.global_state])
        assert got.accuracy == expected.accuracy and abs(got.loss - expected.loss) < 1e-6
    assert _engine(tiny_clients, "fedbn", [outsider]).bn_affine_is_local


def test_bn_average_averages_what_each_client_holds_in_its_bn_layers(tiny_clients):
    """bn_average (FedWon Table 12's other reading) averages each client's BN weight, bias and running statistics
    as its model holds them: FedBN's all local, SiloBN's statistics local with the shared affine, FedAvg's the
    global model's (so bn_average is the global model). The prediction is the averaged model's, statistics and
    all: nothing is estimated on the external data."""
    outsider = ClientData("ext", "dx", make_split(10, seed=9, shift=120.0), make_split(24, seed=19, shift=120.0))
    for method in ("fedbn", "silobn", "fedavg"):
        torch.manual_seed(2)
        eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method(method),
                              LocalTraining(batch_size=8, lr=0.05), Federation(seed=0, channels_last=False),
                              normalize_batch, external_clients=[outsider], external_modes=("global", "bn_average"))
        eng.run_round()
        evals = {e.client: e for e in eng.evaluate(("test",))}
        bn_keys = [f"{name}.{entry}" for name, layer in eng.model.named_modules()
                   if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm)
                   for entry in ("weight", "bias", "running_mean", "running_var")]
        stats_keys = [k for k in bn_keys if k.endswith(("running_mean", "running_var"))]
        assert len(bn_keys) >= 8  # conv and FC BN layers of the digit CNN
        # each key's mean over the clients' models: local entries from their local states, the rest global
        model_of = [{**eng.global_state, **eng.local_states[c.name]} for c in tiny_clients] if method != "fedavg" \
            else [eng.global_state]
        averaged = {k: torch.stack([m[k] for m in model_of]).mean(0) for k in bn_keys}
        model = eng.model
        model.load_state_dict({**eng.global_state, **averaged})
        expected = evaluate_external(model, outsider.test, eng.prepare, "global")
        got = evals["ext:bn_average"]
        assert got.accuracy == expected.accuracy and abs(got.loss - expected.loss) < 1e-5, method
        if method == "fedbn":  # the clients' statistics differ: their average is not the global model's
            assert any(not torch.allclose(averaged[k], eng.global_state[k]) for k in stats_keys)
        if method == "fedavg":
            assert got.accuracy == evals["ext:global"].accuracy and got.loss == evals["ext:global"].loss
    assert eng.local_bn_keys(statistics=True) == []
    silobn = _engine(tiny_clients, "silobn", [outsider])
    assert silobn.local_bn_keys(statistics=False) == [] and silobn.local_bn_keys(statistics=True)
    assert all(k.endswith(("running_mean", "running_var")) for k in silobn.local_bn_keys(statistics=True))


def test_singleset_has_no_global_model_to_evaluate_external_clients_with(tiny_clients):
    """SingleSet never trains a global model (FedBN: no model to hand to a new client): no external rows, rather
    than scores of the untrained initial weights."""
    outsider = ClientData("ext", "dx", make_split(10, seed=9, shift=120.0), make_split(24, seed=19, shift=120.0))
    eng = _engine(tiny_clients, "singleset", [outsider])
    eng.run_round()
    evals = eng.evaluate(("test",))
    assert not any(e.client.startswith("ext") for e in evals)
    assert {e.client for e in evals} == {c.name for c in tiny_clients}


def test_models_without_batchnorm_get_only_the_global_mode(tiny_clients):
    outsider = ClientData("ext", "dx", make_split(10, seed=9), make_split(12, seed=19))
    torch.manual_seed(2)
    eng = InProcessEngine(DigitCNN(width=0.125, norm="gn"), tiny_clients, resolve_method("fedavg_gn"),
                          LocalTraining(batch_size=8), Federation(channels_last=False), normalize_batch,
                          external_clients=[outsider])
    names = [e.client for e in eng.evaluate(("test",)) if e.client.startswith("ext")]
    assert names == ["ext:global"]


def test_a_federation_with_external_clients_trains_exactly_as_one_without(tiny_clients):
    """An external client never contributes: not to the aggregation weights, not to SCAFFOLD's client count N in
    the server's control variate, not to client sampling. Two rounds with a sampled fraction give the same global
    state, client states and training scores with or without the outsider, and evaluating it changes nothing."""
    outsider = ClientData("ext", "dx", make_split(30, seed=9, shift=120.0), make_split(24, seed=19, shift=120.0))
    runs = []
    for external in ([], [outsider]):
        torch.manual_seed(2)
        eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("scaffold", policy="local_bn"),
                              LocalTraining(batch_size=8, lr=0.05), Federation(seed=0, channels_last=False,
                                                                               fraction=2 / 3),
                              normalize_batch, external_clients=external)
        losses = []
        for _ in range(2):
            losses.append({c: r.mean_loss for c, r in eng.run_round().items()})
            eng.evaluate(("test",))
        runs.append((eng, losses))
    (plain, plain_losses), (with_ext, ext_losses) = runs
    assert ext_losses == plain_losses
    for name, states in (("global", lambda e: e.global_state), ("server algorithm", lambda e: e.algorithm_server_state)):
        a, b = states(plain), states(with_ext)
        assert a.keys() == b.keys() and a, name
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    assert plain.local_states.keys() == with_ext.local_states.keys() == {c.name for c in tiny_clients}
    for c in tiny_clients:
        for k, v in plain.local_states[c.name].items():
            assert torch.equal(v, with_ext.local_states[c.name][k])
