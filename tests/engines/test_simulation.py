import copy

import pytest
import torch

from fednorm.data.domain import ClientData, normalize_batch
from fednorm.engines.simulation import Federation, InProcessEngine, derive_seed
from fednorm.methods import LocalTraining, resolve_method, train_locally
from fednorm.models import DigitCNN

from ..conftest import batchnorm_keys, make_split

TRAIN = LocalTraining(batch_size=8, lr=0.05)


def engine(clients, method, *, model=None, seed=0, training=TRAIN, **fed):
    torch.manual_seed(123)
    model = model if model is not None else DigitCNN(width=0.125)
    return InProcessEngine(model, clients, resolve_method(method), training,
                           Federation(seed=seed, channels_last=False, **fed), normalize_batch)


def trained_alone(eng, client, round_index=0, optimizer_state=None):
    """What ``client`` computes in ``round_index`` from the engine's current state (and, given, the optimizer
    state it kept), recomputed by hand."""
    model = copy.deepcopy(eng.model)
    model.load_state_dict({**eng.global_state, **eng.local_states.get(client.name, {})})
    seed = derive_seed(eng.federation.seed, round_index, eng._index[client.name], 2)
    torch.manual_seed(seed)
    train_locally(model, client.train, eng.training, generator=torch.Generator().manual_seed(seed),
                  prepare=normalize_batch, optimizer_state=copy.deepcopy(optimizer_state))
    return model.state_dict()


def sample_weighted_mean(clients, states: dict, key: str) -> torch.Tensor:
    n = torch.tensor([c.num_train for c in clients], dtype=torch.float64)
    return sum(w * states[c.name][key].double() for w, c in zip(n / n.sum(), clients)).float()


# what each policy keeps on the client, named from the papers (not from the engine): FedBN every BatchNorm entry,
# SiloBN its running statistics (affine averaged), FedAvg nothing
BN_ENTRIES = {"fedavg": (), "fedbn": ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"),
              "silobn": ("running_mean", "running_var", "num_batches_tracked")}


def bn_keys(model: torch.nn.Module, entries) -> set[str]:
    return {k for k in batchnorm_keys(model) if k.rsplit(".", 1)[1] in entries}


@pytest.mark.parametrize("method", ["fedavg", "fedbn", "silobn"])
def test_round_averages_exactly_the_shared_state_and_keeps_the_rest_local(tiny_clients, method):
    """Two rounds: in round 1 each client starts from the averaged state plus its own local entries of round 0
    (``trained_alone`` loads them), never another client's; the server averages exactly the rest."""
    eng = engine(tiny_clients, method, weighting="samples")
    local = bn_keys(eng.model, BN_ENTRIES[method])
    assert set(eng.local_keys) == local
    assert set(eng.shared_keys) == set(eng.model.state_dict()) - local
    for round_index in (0, 1):
        expected = {c.name: trained_alone(eng, c, round_index) for c in tiny_clients}
        eng.run_round()
        for key in eng.shared_keys:
            values = [expected[c.name][key] for c in tiny_clients]
            if values[0].is_floating_point():
                torch.testing.assert_close(eng.global_state[key], sample_weighted_mean(tiny_clients, expected, key),
                                           rtol=1e-5, atol=1e-6)
            else:  # counters: never averaged as floats
                assert eng.global_state[key].dtype == torch.long
                assert int(eng.global_state[key]) == max(int(v) for v in values)
        for c in tiny_clients:
            assert set(eng.local_states.get(c.name, {})) == local
            for key in local:
                torch.testing.assert_close(eng.local_states[c.name][key], expected[c.name][key])
    if local:  # the clients' local entries really are their own (the domains differ in brightness)
        stats = [eng.local_states[c.name]["features.1.running_mean"] for c in tiny_clients]
        assert not torch.allclose(stats[0], stats[2])


def test_uniform_weighting_averages_clients_of_unequal_size_equally(tiny_clients):
    """federation.weighting=uniform (FedBN's code): 1/K per client whatever its size (24, 16 and 20 samples here),
    where FedAvg's default weighs by samples."""
    eng = engine(tiny_clients, "fedbn", weighting="uniform")
    expected = {c.name: trained_alone(eng, c) for c in tiny_clients}
    eng.run_round()
    weight = "features.0.weight"
    torch.testing.assert_close(eng.global_state[weight],
                               sum(expected[c.name][weight] for c in tiny_clients) / len(tiny_clients),
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(eng.global_state[weight], sample_weighted_mean(tiny_clients, expected, weight),
                              rtol=1e-5, atol=1e-6)


def test_fedbn_clients_evaluate_with_their_own_bn_and_fedavg_with_one_model(tiny_clients):
    eng = engine(tiny_clients, "fedbn")
    eng.run_round()
    running = [eng.local_states[c.name]["features.1.running_mean"] for c in tiny_clients]
    assert not torch.allclose(running[0], running[2])  # domains shifted in brightness
    eng.load_client("c2")
    torch.testing.assert_close(eng.model.features[1].running_mean, running[2])
    avg = engine(tiny_clients, "fedavg")
    avg.run_round()
    assert avg.local_states == {}


def test_evaluate_scores_each_fedbn_client_with_its_own_bn_not_the_global_model(tiny_clients):
    """evaluate(): client c's numbers are those of the global weights with c's own BN state, and differ from
    the global model's (whose BN statistics the server never touched)."""
    eng = engine(tiny_clients, "fedbn")
    eng.run_round()
    scored = {e.client: (e.accuracy, e.loss) for e in eng.evaluate(("test",))}
    global_only = []
    for c in tiny_clients:
        eng.load_client(c.name)
        assert scored[c.name] == pytest.approx(eng.evaluate_split(c.test), abs=1e-12)
        eng.model.load_state_dict(eng.global_state)
        global_only.append(eng.evaluate_split(c.test)[1])
    assert [scored[c.name][1] for c in tiny_clients] != pytest.approx(global_only, abs=1e-6)


@pytest.mark.parametrize("method, expected", [
    ("fedwon", {"agc_clip": 0.64, "agc_exclude_head": True, "weight_perturbation": 0.0}),
    ("harmofl", {"agc_clip": 0.0, "weight_perturbation": 0.05}),
])
def test_the_engine_hands_the_methods_agc_and_weight_perturbation_to_local_training(tiny_clients, monkeypatch,
                                                                                  method, expected):
    """FedWon's engine round clips (AGC lambda 0.64, head excluded), HarmoFL's perturbs (alpha 0.05): the settings
    reach every client's local training, not only the preset."""
    import fednorm.engines.client_step as step

    seen, real = [], step.train_locally

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in expected})
        return real(*args, **kwargs)

    monkeypatch.setattr(step, "train_locally", spy)
    norm = "ws" if method == "fedwon" else "bn"
    eng = InProcessEngine(DigitCNN(width=0.125, norm=norm), tiny_clients, resolve_method(method), TRAIN,
                          Federation(channels_last=False), normalize_batch)
    eng.run_round()
    assert seen == [expected] * len(tiny_clients)


def test_fedbn_with_one_client_equals_local_training(tiny_clients):
    one = [tiny_clients[0]]
    fedbn, single = engine(one, "fedbn"), engine(one, "singleset")
    model = copy.deepcopy(fedbn.model)
    for r in range(3):
        fedbn.run_round()
        single.run_round()
        seed = derive_seed(0, r, 0, 2)
        torch.manual_seed(seed)
        train_locally(model, one[0].train, TRAIN, generator=torch.Generator().manual_seed(seed), prepare=normalize_batch)
    fedbn.load_client("c0")
    single.load_client("c0")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fedbn.model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(single.model.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_singleset_with_several_clients_trains_each_on_its_own_data_alone(tiny_clients):
    """SingleSet (FedBN Table 11's 'Single'): every entry stays on the client, so over rounds each client's model is
    exactly what training alone on its own data gives, from the common initial model; nothing is averaged."""
    eng = engine(tiny_clients, "singleset")
    initial = copy.deepcopy(eng.model.state_dict())
    assert not eng.shared_keys and set(eng.local_keys) == set(initial)
    alone = {}
    for c in tiny_clients:
        model = copy.deepcopy(eng.model)
        model.load_state_dict(initial)
        for r in range(3):
            seed = derive_seed(0, r, eng._index[c.name], 2)
            torch.manual_seed(seed)
            train_locally(model, c.train, TRAIN, generator=torch.Generator().manual_seed(seed), prepare=normalize_batch)
        alone[c.name] = model.state_dict()
    for _ in range(3):
        eng.run_round()
    for c in tiny_clients:
        eng.load_client(c.name)
        for key, value in alone[c.name].items():
            torch.testing.assert_close(eng.model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    # the clients did end apart (a shared entry would have pulled them together)
    first, last = (alone[c.name]["features.0.weight"] for c in (tiny_clients[0], tiny_clients[-1]))
    assert not torch.allclose(first, last)


def test_fedavg_one_full_batch_step_on_identical_clients_equals_centralized_sgd():
    data = make_split(24, seed=7)
    clients = [ClientData(f"c{i}", "same", data, data) for i in range(3)]
    full = LocalTraining(batch_size=24, lr=0.1)
    eng = engine(clients, "fedavg", training=full)
    central = copy.deepcopy(eng.model)
    eng.run_round()
    pooled = ClientData("pooled", "same", type(data).concat([data] * 3), data)
    torch.manual_seed(0)
    train_locally(central, pooled.train, LocalTraining(batch_size=72, lr=0.1), generator=torch.Generator(),
                  prepare=normalize_batch)
    for key, value in central.state_dict().items():
        # running_var is excepted: BN stores the unbiased batch variance, n/(n-1), which depends on batch size
        if value.is_floating_point() and not key.endswith("running_var"):
            torch.testing.assert_close(eng.global_state[key], value, rtol=1e-4, atol=1e-6)


def test_fedavg_one_full_batch_step_on_different_clients_equals_centralized_sgd(tiny_clients):
    # Without batch-dependent layers (GroupNorm model) and sample weighting, one full-batch local step per
    # client averaged is exactly one full-batch gradient step on the union of the clients' data.
    model = DigitCNN(width=0.25, norm="gn")
    eng = engine(tiny_clients, "fedavg", model=model, weighting="samples",
                 training=LocalTraining(batch_size=1000, lr=0.1))
    central = copy.deepcopy(eng.model)
    eng.run_round()
    union = type(tiny_clients[0].train).concat([c.train for c in tiny_clients])
    train_locally(central, union, LocalTraining(batch_size=1000, lr=0.1), generator=torch.Generator(),
                  prepare=normalize_batch)
    for key, value in central.state_dict().items():
        torch.testing.assert_close(eng.global_state[key], value, rtol=1e-4, atol=1e-6)


def test_fedprox_reference_is_the_rounds_global_shared_parameters(tiny_clients, monkeypatch):
    """FedProx's w_ref in mu/2 ||w - w_ref||^2 is the global model the round started from (Li et al.), for the
    shared parameters only (FedBN + FedProx: the client's own BN affine is not pulled), and it stays that model
    while the client trains (a reference that followed the live weights would make the term vanish)."""
    seen = {}
    import fednorm.engines.client_step as sim

    real = sim.train_locally

    def spy(*args, **kwargs):
        reference = kwargs["prox_reference"]
        seen.setdefault("at_call", []).append({k: v.clone() for k, v in reference.items()})
        seen.setdefault("mu", []).append(kwargs["prox_mu"])
        out = real(*args, **kwargs)
        seen.setdefault("after", []).append({k: v.clone() for k, v in reference.items()})
        return out

    monkeypatch.setattr(sim, "train_locally", spy)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("fedbn", prox_mu=0.01), TRAIN,
                          Federation(channels_last=False), normalize_batch)
    for _ in range(2):
        start = {k: v.clone() for k, v in eng.global_state.items()}
        seen.clear()
        eng.run_round()
        params = {n for n, _ in eng.model.named_parameters()}
        assert seen["mu"] == [0.01] * len(tiny_clients)
        for at_call, after in zip(seen["at_call"], seen["after"]):
            assert set(at_call) == params - set(eng.local_keys)
            assert not any(k.startswith("features.1.") for k in at_call)
            for k in at_call:
                assert torch.equal(at_call[k], start[k])
                assert torch.equal(after[k], start[k])
        assert any(not torch.equal(eng.global_state[k], start[k]) for k in seen["at_call"][0])  # it trained


def test_same_seed_same_numbers_and_listing_order_changes_only_rounding(tiny_clients):
    """A client's random stream (batch order, dropout) derives from the run's seed, the round and the client's
    position in the federation's client list (the order of the config's domains, fixed for a run), so the same
    seed gives the same numbers and another seed other numbers. Given the same streams, listing the clients in
    another order changes the aggregate by float rounding only and no client's local state."""
    a = engine(tiny_clients, "fedbn", weighting="uniform")
    b = engine(tiny_clients, "fedbn", weighting="uniform")
    for _ in range(2):
        a.run_round()
        b.run_round()
    for k in a.global_state:
        assert torch.equal(a.global_state[k], b.global_state[k])
    first = engine(tiny_clients, "fedbn", weighting="uniform")
    first.run_round()
    # listed in reverse, each client draws the stream of its new position: its local training differs
    reversed_list = engine(list(reversed(tiny_clients)), "fedbn", weighting="uniform")
    reversed_list.run_round()
    assert not torch.equal(first.local_states["c0"]["features.1.running_mean"],
                           reversed_list.local_states["c0"]["features.1.running_mean"])
    # the same streams (positions as in ``first``) and the reversed listing: only the summation order differs
    reordered = engine(list(reversed(tiny_clients)), "fedbn", weighting="uniform")
    reordered._index = dict(first._index)
    reordered.run_round()
    for k in first.shared_keys:
        torch.testing.assert_close(first.global_state[k], reordered.global_state[k], rtol=1e-5, atol=1e-6)
    for name in first.local_states:
        for k, v in first.local_states[name].items():
            assert torch.equal(v, reordered.local_states[name][k])
    other = engine(tiny_clients, "fedbn", seed=1)
    other.run_round()
    a2 = engine(tiny_clients, "fedbn")
    a2.run_round()
    assert not torch.equal(other.global_state["features.0.weight"], a2.global_state["features.0.weight"])


@pytest.mark.parametrize("method", ["fedavg", "centralized_bn"])
def test_learning_rate_decay_reaches_every_clients_optimizer_each_round(tiny_clients, monkeypatch, method):
    """training.lr_decay_every (FBN Table 2: lr / (1 + t // every)): in round t every client, and centralized BN's
    one model on the merged batches, steps with that round's learning rate, and so does a persistent optimizer."""
    import fednorm.engines.client_step as client_step
    import fednorm.engines.simulation as simulation

    used = []

    def spy(real):
        def wrapped(model, data, cfg, **kwargs):
            used.append(cfg.lr)
            result, state = real(model, data, cfg, **kwargs)
            used.append(state["param_groups"][0]["lr"])
            return result, state
        return wrapped

    monkeypatch.setattr(client_step, "train_locally", spy(client_step.train_locally))
    monkeypatch.setattr(simulation, "train_locally", spy(simulation.train_locally))
    training = LocalTraining(batch_size=8, lr=0.06, momentum=0.9, lr_decay_every=2, steps=1)
    eng = engine(tiny_clients, method, training=training, persistent_optimizer=True)
    per_round = []
    for _ in range(5):
        used.clear()
        eng.run_round()
        assert len(set(used)) == 1, used
        per_round.append(used[0])
    assert per_round == pytest.approx([0.06, 0.06, 0.03, 0.03, 0.02])


def test_fednova_server_folds_in_each_clients_real_number_of_local_steps(tiny_clients):
    """FedNova normalizes each client's update by its local steps tau_i: the replies the server folds in carry
    the steps each client really ran (two epochs of ceil(n / B) batches: 24, 16 and 20 samples at B = 8), and the
    server knows the clients' optimizer (lr, momentum) that a_i depends on."""
    training = LocalTraining(batch_size=8, lr=0.05, momentum=0.5, epochs=2)
    eng = engine(tiny_clients, "fednova", training=training)
    folded = []
    add = eng.server.add
    eng.server.add = lambda reply: (folded.append((reply.client, reply.num_steps)), add(reply))[1]
    eng.run_round()
    assert folded == [("c0", 6), ("c1", 4), ("c2", 6)]
    assert (eng.server.schedule.lr, eng.server.schedule.momentum) == (0.05, 0.5)


def test_client_sampling_is_seeded_per_round():
    clients = [ClientData(f"c{i}", "d", make_split(4, i), make_split(4, i)) for i in range(20)]
    e1 = engine(clients, "fedavg", fraction=0.25)
    e2 = engine(clients, "fedavg", fraction=0.25)
    picks = [[c.name for c in e1.sample_clients(r)] for r in range(5)]
    # a round's draw depends on the seed and the round alone, not on which rounds were drawn before (a resumed
    # run, or the Flower server, draws round r first)
    assert picks == [[c.name for c in e2.sample_clients(r)] for r in reversed(range(5))][::-1]
    assert all(len(p) == 5 for p in picks)
    assert len({tuple(p) for p in picks}) > 1
    # without replacement: no client trains twice in a round, even when nearly all of them are drawn
    most = engine(clients, "fedavg", fraction=0.9)
    assert all(len({c.name for c in most.sample_clients(r)}) == 18 for r in range(5))


def test_sampled_count_is_c_times_k_rounded_half_up_and_at_least_one():
    """max(C K, 1) clients (McMahan et al.): 0.5 of 5 and of 7 clients are 3 and 4 (not round-half-to-even's
    2 and 4), 0.29 of 100 is 29 (not a float floor's 28), 0.01 of 5 is 1."""
    def count(n, fraction):
        clients = [ClientData(f"c{i}", "d", make_split(2, i), make_split(2, i)) for i in range(n)]
        return len(engine(clients, "fedavg", fraction=fraction).sample_clients(0))

    assert [count(5, 0.5), count(7, 0.5), count(100, 0.29), count(5, 0.01)] == [3, 4, 29, 1]


def test_checkpoint_round_trip_continues_identically(tiny_clients):
    a = engine(tiny_clients, "fedbn")
    for _ in range(3):
        a.run_round()
    b = engine(tiny_clients, "fedbn")
    b.run_round()
    c = engine(tiny_clients, "fedbn")
    c.load_state_dict(copy.deepcopy(b.state_dict()))
    c.run_round()
    c.run_round()
    for k in a.global_state:
        assert torch.equal(a.global_state[k], c.global_state[k])
    for name in a.local_states:
        for k in a.local_states[name]:
            assert torch.equal(a.local_states[name][k], c.local_states[name][k])


def test_fedbn_client_state_is_only_bn(tiny_clients):
    """A client's state is exactly its BatchNorm entries (5 per BN layer of the digit CNN's 5), nothing else; the
    server's copy of them stays the initial one (what a client that never trained would start from)."""
    eng = engine(tiny_clients, "fedbn")
    expected = bn_keys(eng.model, BN_ENTRIES["fedbn"])
    assert len(expected) == 25
    initial = {k: eng.global_state[k].clone() for k in expected}
    eng.run_round()
    for state in eng.local_states.values():
        assert set(state) == expected
    for k in expected:
        assert torch.equal(eng.global_state[k], initial[k]), k


def test_persistent_optimizer_keeps_momentum_per_client_and_fresh_does_not(tiny_clients):
    momentum = LocalTraining(batch_size=8, lr=0.05, momentum=0.9)
    fresh = engine(tiny_clients, "fedavg", training=momentum)
    kept = engine(tiny_clients, "fedavg", training=momentum, persistent_optimizer=True)
    fresh.run_round()
    kept.run_round()
    assert fresh.optimizer_states == {}
    assert set(kept.optimizer_states) == {"c0", "c1", "c2"}
    assert all(s["state"] for s in kept.optimizer_states.values())  # momentum buffers exist
    for k in fresh.global_state:  # identical first round: the optimizers start the same
        assert torch.equal(fresh.global_state[k], kept.global_state[k])
    # round 2: each client of `kept` resumes from its own momentum buffers, each of `fresh` from none
    expect_kept = {c.name: trained_alone(kept, c, 1, kept.optimizer_states[c.name]) for c in tiny_clients}
    expect_fresh = {c.name: trained_alone(fresh, c, 1) for c in tiny_clients}
    fresh.run_round()
    kept.run_round()
    for eng, expected in ((kept, expect_kept), (fresh, expect_fresh)):
        for key in ("features.0.weight", "classifier.6.bias"):
            torch.testing.assert_close(eng.global_state[key], sample_weighted_mean(tiny_clients, expected, key),
                                       rtol=1e-5, atol=1e-6)
    assert not torch.equal(fresh.global_state["features.0.weight"], kept.global_state["features.0.weight"])


def test_fixed_local_steps_give_every_client_the_same_iterations(tiny_clients):
    eng = engine(tiny_clients, "fedbn", training=LocalTraining(batch_size=8, lr=0.05, steps=5))
    results = eng.run_round()
    assert {r.num_steps for r in results.values()} == {5}
    assert {r.num_examples for r in results.values()} == {40}  # small clients repeat sampling


def test_fedbn_code_prox_schedule_has_no_term_in_the_first_round(tiny_clients, monkeypatch):
    import fednorm.engines.client_step as sim

    calls = []
    real = sim.train_locally

    def spy(*args, **kwargs):
        calls.append((kwargs["prox_reference"] is not None, kwargs["prox_skip_epoch_start"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(sim, "train_locally", spy)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients[:1],
                          resolve_method("fedprox", prox_schedule="fedbn_code"), TRAIN,
                          Federation(channels_last=False), normalize_batch)
    eng.run_round()
    eng.run_round()
    assert calls == [(False, True), (True, True)]
    with pytest.raises(ValueError, match="prox_schedule"):
        resolve_method("fedprox", prox_schedule="official")


@pytest.mark.parametrize("setting, precision, expected", [(None, "fp32", False), (None, "bf16", True),
                                                          (True, "fp32", True), (False, "bf16", False)])
def test_memory_format_is_channels_last_by_default_only_for_bf16(tiny_clients, setting, precision, expected):
    # fp32 stays NCHW (channels_last there was no faster and less precise: performance.md); bf16 wants NHWC
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("fedbn"),
                          LocalTraining(batch_size=8, precision=precision),
                          Federation(channels_last=setting), normalize_batch)
    assert eng.federation.channels_last is expected
    conv = next(m for m in eng.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) is expected
    x = eng.prepare(tiny_clients[0].train.x[:4])
    assert x.is_contiguous(memory_format=torch.channels_last) is expected and x.is_contiguous() is not expected


@pytest.mark.parametrize("method,policy,fraction", [
    ("moon", "local_bn", 1.0), ("feddc", "local_bn", 1.0), ("fedadam", "local_bn", 1.0),
    ("scaffold", "local_bn_stats", 1.0), ("fixbn", None, 1.0), ("fedbn", None, 0.67)])
def test_a_checkpoint_resumes_bit_identically_with_every_kind_of_state(tiny_clients, tmp_path, method, policy, fraction):
    """Two rounds, checkpoint, load into a fresh engine, one more round: equal to three straight rounds, for
    client-algorithm state (MOON's previous model, FedDC's drift, SCAFFOLD's c_i), server-optimizer moments,
    kept momentum under local BN, FixBN across its switch (round 2 of 3) and a sampled cross-silo FedBN."""
    from fednorm.runs import store

    def build():
        torch.manual_seed(0)
        overrides = {"policy": policy} if policy else {}
        if method == "fixbn":
            overrides["freeze_bn_stats_at"] = 2
        return InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method(method, **overrides),
                               LocalTraining(batch_size=8, lr=0.05, momentum=0.9),
                               Federation(seed=0, channels_last=False, persistent_optimizer=True, fraction=fraction,
                                          rounds=3), normalize_batch)

    straight = build()
    for _ in range(3):
        straight.run_round()
    first = build()
    for _ in range(2):
        first.run_round()
    store.save_checkpoint(tmp_path / "checkpoint.pt", first.state_dict())
    resumed = build()
    resumed.load_state_dict(store.load_checkpoint(tmp_path / "checkpoint.pt"))
    resumed.run_round()
    for k, v in straight.global_state.items():
        assert torch.equal(resumed.global_state[k], v), k
    assert straight.local_states.keys() == resumed.local_states.keys()
    for name, state in straight.local_states.items():
        for k, v in state.items():
            assert torch.equal(resumed.local_states[name][k], v), (name, k)
    assert [(e.client, e.split, e.accuracy, e.loss) for e in straight.evaluate()] == \
        [(e.client, e.split, e.accuracy, e.loss) for e in resumed.evaluate()]
