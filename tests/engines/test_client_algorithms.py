"""Client algorithms through the engine: SCAFFOLD's control variates (Karimireddy et al. 2020, Alg. 1)."""

import copy

import pytest
import torch

from fednorm.data.domain import normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine, derive_seed
from fednorm.methods import LocalTraining, resolve_method, train_locally
from fednorm.methods.client_algorithms import ClientContext
from fednorm.models import DigitCNN

from ..conftest import assert_control_variate_is_the_gradient_at

TRAIN = LocalTraining(batch_size=8, lr=0.05)


def engine(clients, method, **fed):
    torch.manual_seed(5)
    return InProcessEngine(DigitCNN(width=0.125), clients, method, TRAIN,
                           Federation(seed=1, channels_last=False, **fed), normalize_batch)


def test_scaffold_round_zero_is_fedavg_and_sets_control_variates_by_option_two(tiny_clients):
    avg = engine(tiny_clients, resolve_method("fedavg"))
    sc = engine(tiny_clients, resolve_method("scaffold"))
    x = {k: v.clone() for k, v in sc.global_state.items()}
    results = sc.run_round()
    avg.run_round()
    for k in sc.global_state:  # c = c_i = 0: no correction in the first round
        torch.testing.assert_close(sc.global_state[k], avg.global_state[k])
    # option II: c_i = (x - y_i) / (K lr); c = (|S|/N) mean_i c_i with |S| = N
    expected_c = {}
    for c in tiny_clients:
        model = copy.deepcopy(sc.model)
        model.load_state_dict(x)
        seed = derive_seed(1, 0, sc._index[c.name], 2)
        torch.manual_seed(seed)
        train_locally(model, c.train, TRAIN, generator=torch.Generator().manual_seed(seed), prepare=normalize_batch)
        y = dict(model.named_parameters())
        steps = results[c.name].num_steps
        for k in sc.shared_params:
            ci = (x[k] - y[k].detach()) / (steps * TRAIN.lr)
            torch.testing.assert_close(sc.algorithm_states[c.name][f"c_i.{k}"], ci, rtol=1e-4, atol=1e-6)
            expected_c[k] = expected_c.get(k, 0) + ci / len(tiny_clients)
    for k in sc.shared_params:
        torch.testing.assert_close(sc.algorithm_server_state[f"c.{k}"], expected_c[k], rtol=1e-4, atol=1e-6)


def test_scaffold_corrects_every_local_gradient_by_c_minus_c_i(tiny_clients):
    sc = engine(tiny_clients, resolve_method("scaffold"))
    sc.run_round()
    client = tiny_clients[1]
    correction = {k: sc.algorithm_server_state[f"c.{k}"] - sc.algorithm_states[client.name][f"c_i.{k}"]
                  for k in sc.shared_params}
    model = copy.deepcopy(sc.model)
    model.load_state_dict(sc.global_state)
    # by hand: SGD whose gradients get the correction added (through a hook on each parameter)
    params = dict(model.named_parameters())
    handles = [params[k].register_hook(lambda g, c=correction[k]: g + c) for k in sc.shared_params]
    seed = derive_seed(1, 1, sc._index[client.name], 2)
    torch.manual_seed(seed)
    train_locally(model, client.train, TRAIN, generator=torch.Generator().manual_seed(seed), prepare=normalize_batch)
    for h in handles:
        h.remove()
    # the same client step through the algorithm's hooks
    sc.load_client(client.name)
    ctx = ClientContext(client.name, TRAIN.lr, sc.shared_params, {k: sc.global_state[k] for k in sc.shared_keys},
                        sc.algorithm_server_state, copy.deepcopy(sc.algorithm_states[client.name]))
    torch.manual_seed(seed)
    train_locally(sc.model, client.train, TRAIN, generator=torch.Generator().manual_seed(seed),
                  prepare=normalize_batch, algorithm=sc.algorithm, context=ctx)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(sc.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def scaffold_step_by_hand(sc, client, round_index):
    """Karimireddy et al. Alg. 1 for one client, written out: local SGD whose every gradient gets c - c_i added,
    then option II, c_i+ = c_i - c + (x - y_i) / (K lr). Returns (y_i's state, c_i+)."""
    c = {k: sc.algorithm_server_state[f"c.{k}"] for k in sc.shared_params}
    ci = {k: sc.algorithm_states.get(client.name, {}).get(f"c_i.{k}", torch.zeros_like(c[k])) for k in c}
    x = {k: v.clone() for k, v in sc.global_state.items()}
    model = copy.deepcopy(sc.model)
    model.load_state_dict(x)
    params = dict(model.named_parameters())
    handles = [params[k].register_hook(lambda g, d=c[k] - ci[k]: g + d) for k in sc.shared_params]
    seed = derive_seed(1, round_index, sc._index[client.name], 2)
    torch.manual_seed(seed)
    result, _ = train_locally(model, client.train, TRAIN, generator=torch.Generator().manual_seed(seed),
                              prepare=normalize_batch)
    for h in handles:
        h.remove()
    new_ci = {k: ci[k] - c[k] + (x[k] - params[k].detach()) / (result.num_steps * TRAIN.lr) for k in c}
    return model.state_dict(), new_ci


def test_scaffold_with_sampled_clients_updates_c_by_the_sampled_share(tiny_clients):
    """Two rounds with 2 of N = 3 clients sampled: participants' c_i follow option II from their own c_i and the
    server's c, the others' c_i stay, c moves by (|S| / N) times the participants' mean change, and the model is
    the sample-weighted mean of the participants' corrected local models."""
    sc = engine(tiny_clients, resolve_method("scaffold"), fraction=0.67)
    seen = set()
    for r in (0, 1):
        participants = sc.sample_clients(r)
        assert len(participants) == 2
        seen |= {c.name for c in participants}
        old_c = {k: sc.algorithm_server_state[f"c.{k}"].clone() for k in sc.shared_params}
        old_ci = copy.deepcopy(sc.algorithm_states)
        by_hand = {c.name: scaffold_step_by_hand(sc, c, r) for c in participants}
        sc.run_round()
        n = torch.tensor([c.num_train for c in participants], dtype=torch.float64)
        weights = n / n.sum()
        for k in sc.shared_params:
            for c in participants:
                torch.testing.assert_close(sc.algorithm_states[c.name][f"c_i.{k}"], by_hand[c.name][1][k],
                                           rtol=1e-4, atol=1e-6)
            for c in tiny_clients:
                if c.name not in by_hand and c.name in old_ci:
                    assert torch.equal(sc.algorithm_states[c.name][f"c_i.{k}"], old_ci[c.name][f"c_i.{k}"])
            change = torch.stack([by_hand[c.name][1][k] - old_ci.get(c.name, {}).get(f"c_i.{k}", 0 * old_c[k])
                                  for c in participants]).mean(dim=0)
            torch.testing.assert_close(sc.algorithm_server_state[f"c.{k}"], old_c[k] + (2 / 3) * change,
                                       rtol=1e-4, atol=1e-6)
            mean = sum(w * by_hand[c.name][0][k].double() for w, c in zip(weights, participants)).float()
            torch.testing.assert_close(sc.global_state[k], mean, rtol=1e-5, atol=1e-6)
    assert seen == {c.name for c in tiny_clients}  # round 1 drew a client that round 0 did not


def test_scaffold_with_client_specific_bn_has_no_control_variate_for_bn(tiny_clients):
    sc = engine(tiny_clients, resolve_method("scaffold", policy="local_bn"))
    sc.run_round()
    keys = {k[2:] for k in sc.algorithm_server_state}
    assert keys == set(sc.shared_params) and not any(k in sc.local_keys for k in keys)
    assert all(k in keys for k in ("features.0.weight", "classifier.0.weight"))


def test_scaffold_option_one_uses_the_full_gradient_at_the_global_model(tiny_clients):
    sc = engine(tiny_clients[:1], resolve_method("scaffold", client={"scaffold_option": "I"}))
    x = {k: v.clone() for k, v in sc.global_state.items()}
    sc.run_round()
    data = tiny_clients[0].train
    assert_control_variate_is_the_gradient_at(
        sc, "c0", x, lambda model: torch.nn.functional.cross_entropy(model(normalize_batch(data.x)), data.y))


def test_scaffold_option_one_with_client_specific_bn_is_the_gradient_at_the_clients_round_start(tiny_clients):
    """Under UniFed's add-on x is the global model with the client's OWN BN state as the round starts, not the
    BN state its local steps reached; control variates cover the shared parameters only."""
    sc = engine(tiny_clients[:2], resolve_method("scaffold", policy="local_bn", client={"scaffold_option": "I"}))
    sc.run_round()
    start = {k: v.clone() for k, v in {**sc.global_state, **sc.local_states["c0"]}.items()}
    sc.run_round()
    assert any(not torch.equal(start[k], v) for k, v in sc.local_states["c0"].items())  # the local BN moved
    data = tiny_clients[0].train
    assert_control_variate_is_the_gradient_at(
        sc, "c0", start, lambda model: torch.nn.functional.cross_entropy(model(normalize_batch(data.x)), data.y))


def test_scaffold_option_one_in_batch_mode_is_the_mean_minibatch_gradient_and_moves_no_statistics(tiny_clients):
    """scaffold_gradient_bn: batch takes the gradient in train mode on consecutive chunks of the training batch
    size (24 images at batch 8: three chunks, each with its batch statistics), weighted by their sizes; the running
    statistics stay as the local steps left them, so round 1 trains exactly as option II's."""
    sc = engine(tiny_clients[:1], resolve_method("scaffold", client={"scaffold_option": "I",
                                                                     "scaffold_gradient_bn": "batch"}))
    two = engine(tiny_clients[:1], resolve_method("scaffold"))
    x = {k: v.clone() for k, v in sc.global_state.items()}
    sc.run_round()
    two.run_round()
    for k, v in two.global_state.items():
        assert torch.equal(sc.global_state[k], v), k
    data = tiny_clients[0].train
    assert len(data) == 24 and TRAIN.batch_size == 8

    def chunked_loss(model):
        return sum(torch.nn.functional.cross_entropy(model(normalize_batch(data.x[i:i + 8])), data.y[i:i + 8],
                                                     reduction="sum") for i in range(0, 24, 8)) / 24

    assert_control_variate_is_the_gradient_at(sc, "c0", x, chunked_loss, train=True)
    with pytest.raises(ValueError, match="scaffold_gradient_bn"):
        resolve_method("scaffold", client={"scaffold_option": "I", "scaffold_gradient_bn": "train"})


def test_stateful_client_algorithms_are_refused_cross_device(tiny_clients):
    with pytest.raises(ValueError, match="scaffold"):
        engine(tiny_clients, resolve_method("scaffold"), stateless_clients=True)
