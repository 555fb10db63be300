"""HarmoFL's drift diagnostics: client drift Gamma_i, gradient dissimilarity, loss-landscape slices."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from fednorm.cli.main import app
from fednorm.data.domain import normalize_batch
from fednorm.diagnostics.gradients import dissimilarity, full_gradient
from fednorm.diagnostics.landscape import filter_normalized_direction, landscape, sharpness
from fednorm.methods.local_update import LocalTraining, train_locally
from fednorm.methods.tasks import CLASSIFICATION
from fednorm.runs import store
from fednorm.runs.config import load_config
from fednorm.runs.runner import build_engine, build_federation_data, load_cell_state, start_run

from ..conftest import make_split
from ..runs.test_runner import TINY


def _linear(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 28 * 28, 10))


def test_drift_is_the_mean_squared_distance_of_the_local_iterates_from_the_round_start():
    model, data, lr = _linear(), make_split(8, seed=1), 0.5
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = LocalTraining(batch_size=8, steps=3, lr=lr, track_drift=True)  # full batches: order does not matter
    result, _ = train_locally(model, data, cfg, generator=torch.Generator().manual_seed(0), prepare=normalize_batch)
    check = _linear()
    check.load_state_dict(start)
    theta0 = [p.detach().clone() for p in check.parameters()]
    distances = []
    for _ in range(3):  # Eq. 9: Gamma_i = 1/K sum_k ||theta_k - theta_0||^2, theta_k after the k-th step
        grads = torch.autograd.grad(F.cross_entropy(check(normalize_batch(data.x)), data.y), list(check.parameters()))
        with torch.no_grad():
            for p, g in zip(check.parameters(), grads):
                p -= lr * g
        distances.append(sum(float((p.detach() - p0).square().sum()) for p, p0 in zip(check.parameters(), theta0)))
    assert result.drift == pytest.approx(sum(distances) / 3, rel=1e-5)
    assert distances[0] > 0
    untracked, _ = train_locally(_linear(), data, LocalTraining(batch_size=8, steps=3, lr=lr),
                                 generator=torch.Generator(), prepare=normalize_batch)
    assert untracked.drift is None


def test_dissimilarity_by_hand():
    # g1 = (1, 0), g2 = (0, 1), p = (1/2, 1/2): sum p ||g||^2 = 1, ||mean||^2 = 1/2, B^2 = 2, ||g1 - g2|| = sqrt 2
    d = dissimilarity([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])], [0.5, 0.5])
    assert (d.grad_sq_mean, d.global_grad_sq, d.dissimilarity) == pytest.approx((1.0, 0.5, 2.0))
    assert d.pairwise == pytest.approx(math.sqrt(2))
    # weights 3/4, 1/4: sum p ||g||^2 = 1, mean (3/4, 1/4) -> 10/16
    d = dissimilarity([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])], [3, 1])
    assert d.global_grad_sq == pytest.approx(10 / 16) and d.dissimilarity == pytest.approx(1.6)
    same = dissimilarity([torch.tensor([2.0, -1.0])] * 3, [1, 1, 1])
    assert same.dissimilarity == pytest.approx(1.0) and same.pairwise == 0.0


def test_full_gradient_is_the_gradient_of_the_mean_loss_over_the_first_samples():
    model, data = _linear(), make_split(10, seed=2)
    names = [n for n, _ in model.named_parameters()]
    got = full_gradient(model, data, CLASSIFICATION, normalize_batch, names, samples=7, batch_size=3)
    loss = F.cross_entropy(model(normalize_batch(data.x[:7])), data.y[:7])
    want = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())  # leaves no gradient behind


def test_full_gradient_of_an_fbn_model_does_not_depend_on_the_batching_and_leaves_its_statistics():
    """FBN normalizes every sample with the shared statistics: the full-data gradient at theta is one number
    whatever the mini-batches, and measuring it moves no running statistic."""
    from fednorm.models.fbn import FederatedBatchNorm2d

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), FederatedBatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 26 * 26, 10))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = make_split(12, seed=3)
    names = [n for n, _ in model.named_parameters()]
    whole = full_gradient(model, data, CLASSIFICATION, normalize_batch, names, samples=12, batch_size=12)
    batched = full_gradient(model, data, CLASSIFICATION, normalize_batch, names, samples=12, batch_size=4)
    torch.testing.assert_close(batched, whole, rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_filter_normalized_direction_matches_each_filter_norm_and_ignores_biases():
    ref = {"conv": torch.randn(4, 3, 3, 3), "bias": torch.randn(4), "fc": torch.randn(5, 7)}
    d = filter_normalized_direction(ref, torch.Generator().manual_seed(0))
    for k in ("conv", "fc"):
        torch.testing.assert_close(d[k].reshape(len(d[k]), -1).norm(dim=1), ref[k].reshape(len(ref[k]), -1).norm(dim=1))
    assert torch.equal(d["bias"], torch.zeros(4))


DIAGNOSED = TINY + ["diagnostics.drift=true", "diagnostics.gradient_dissimilarity=true", "diagnostics.samples=32"]


def measured_from_checkpoint(run_dir, label) -> dict[str, float]:
    """The gradient dissimilarity of a cell's last checkpoint, recomputed client by client (size-weighted)."""
    from fednorm.runs.runner import load_run_config

    config = load_run_config(run_dir)
    method = next(m for m in config.methods if m.display == label)
    engine = build_engine(config, method, 0, build_federation_data(config, None))
    engine.load_state_dict(store.load_checkpoint(run_dir / label / "seed0" / store.CHECKPOINT_FILE))
    prepare = engine.runner.evaluation_prepare(engine.input_state)
    gradients = []
    for client in engine.clients:
        engine.model.load_state_dict({**engine.global_state, **engine.local_states.get(client.name, {})})
        gradients.append(full_gradient(engine.model, client.train, engine.training.task, prepare,
                                       engine.shared_params, 32, engine.training.batch_size))
    n = [c.num_train for c in engine.clients]
    return dissimilarity(gradients, [k / sum(n) for k in n]).as_record()


def test_diagnostics_are_recorded_and_plotted_without_changing_the_run(tmp_path):
    plain = start_run(load_config("default", TINY), tmp_path / "plain")
    diagnosed = start_run(load_config("default", DIAGNOSED + ["diagnostics.landscape=true",
                                                              "diagnostics.landscape_points=3"]), tmp_path / "diag")
    for a, b in zip(plain, diagnosed):  # measuring changes nothing in the training
        assert a.summary["clients"] == b.summary["clients"]
    for label in ("fedavg", "fedbn"):
        cell = tmp_path / "diag" / label / "seed0"
        records = store.read_metrics(cell / store.METRICS_FILE)
        train = [r for r in records if r["split"] == "train"]
        assert train and all(r["drift"] > 0 for r in train)
        diag = [r for r in records if r["split"] == "diagnostics"]
        assert [r["round"] for r in diag] == [2, 4]  # every evaluation round
        assert all(r["dissimilarity"] >= 1.0 - 1e-9 and r["pairwise"] > 0 for r in diag)
        # the round-4 record is the measure of the final model: recomputed from the checkpoint, each client's
        # full gradient over its first 32 training samples with its own local state, weighted by its size
        measured = measured_from_checkpoint(tmp_path / "diag", label)
        assert {k: diag[-1][k] for k in measured} == pytest.approx(measured, rel=1e-5)
        for png in ("drift.png", "dissimilarity.png", "landscape.png", "accuracy.png"):
            assert (cell / png).exists(), png
        result = json.loads((cell / "landscape.json").read_text())
        assert set(result["clients"]) == {"rendered/print", "rendered/neon"}
        assert len(result["clients"]["rendered/print"]) == 3
    assert (tmp_path / "diag" / "diagnostics.png").exists()
    assert not (tmp_path / "plain" / "diagnostics.png").exists()


def test_landscape_centre_is_each_clients_loss_at_its_model_and_the_model_is_restored(tmp_path):
    cfg = load_config("default", TINY + ["federation.rounds=2"])
    clients = build_federation_data(cfg, None)
    engine = build_engine(cfg, cfg.methods[1], 0, clients)  # fedbn: each client keeps its BN layers
    engine.run_round()
    engine.run_round()
    global_before = {k: v.clone() for k, v in engine.global_state.items()}
    local_before = {c: {k: v.clone() for k, v in s.items()} for c, s in engine.local_states.items()}
    result = landscape(engine, span=0.5, points=3, samples=16, seed=1)
    # nothing of the run changed, and the working model holds the global state again
    assert all(torch.equal(engine.global_state[k], v) for k, v in global_before.items())
    assert all(torch.equal(engine.local_states[c][k], v) for c, s in local_before.items() for k, v in s.items())
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in global_before.items())
    for client in engine.clients:
        engine.load_client(client.name)
        _, loss = engine.evaluate_split(client.train.subset(torch.arange(16)))
        assert result["clients"][client.name][1][1] == pytest.approx(loss, rel=1e-5)
    # off-centre points by hand: two Gaussian directions drawn in turn from the seeded generator, each filter
    # (first-axis slice) of a weight tensor scaled to that filter's norm in the global model, zero for biases
    # and other 1-D tensors (Li et al. 2018); point (i, j) is the global model + a_i d1 + b_j d2 on the shared
    # weights, the client's own BN kept
    g = torch.Generator().manual_seed(1)
    ref = {k: engine.global_state[k].detach().float() for k in engine.shared_params}

    def direction():
        out = {}
        for k, w in ref.items():
            if w.dim() <= 1:
                out[k] = torch.zeros_like(w)
                continue
            d = torch.randn(w.shape, generator=g)
            scale = w.flatten(1).norm(dim=1) / d.flatten(1).norm(dim=1)
            out[k] = d * scale.view(-1, *[1] * (w.dim() - 1))
        return out

    d1, d2 = direction(), direction()
    assert result["coords"] == [-0.5, 0.0, 0.5]
    for client in engine.clients:
        for (i, j), (a, b) in {(0, 2): (-0.5, 0.5), (2, 1): (0.5, 0.0), (0, 0): (-0.5, -0.5)}.items():
            engine.load_client(client.name)
            with torch.no_grad():
                for k, p in engine.model.named_parameters():
                    if k in ref:
                        p.copy_(ref[k] + a * d1[k] + b * d2[k])
            _, loss = engine.evaluate_split(client.train.subset(torch.arange(16)))
            assert result["clients"][client.name][i][j] == pytest.approx(loss, rel=1e-5), (client.name, i, j)
            assert loss != result["clients"][client.name][1][1]  # the weights did move (the model is near ln 10)
    summary = sharpness(result)
    assert all(s["centre"] == result["clients"][c][1][1] for c, s in summary.items())


def test_landscape_command_draws_a_finished_cell_at_another_span(tmp_path):
    start_run(load_config("default", TINY + ["federation.rounds=2", "methods=[fedavg]"]), tmp_path / "run")
    out = CliRunner().invoke(app, ["landscape", str(tmp_path / "run"), "--span", "8", "--points", "3",
                                   "--samples", "16"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "run" / "fedavg" / "seed0" / "landscape-span8.png").exists()
    bad = CliRunner().invoke(app, ["landscape", str(tmp_path / "run"), "--method", "fedprox"])
    assert bad.exit_code == 2 and "no method labelled 'fedprox'" in bad.output


@pytest.mark.parametrize("method", ["fedavg", "fedbn"])
def test_bn_stats_command_compares_each_clients_data_statistics_with_the_running_ones(tmp_path, method):
    """FedWon Fig. 1b: per client, the mean / variance per channel of the BN input over its own training data, at
    its own model, beside the running statistics held (the server's under FedAvg, the client's under FedBN)."""
    # evaluation batches of 8: the statistics come from several batches, where a one-pass fold would be off
    overrides = ["federation.rounds=2", f"methods=[{method}]", "federation.eval_batch_size=8"]
    start_run(load_config("default", TINY + overrides), tmp_path / "run")
    out = CliRunner().invoke(app, ["bn-stats", str(tmp_path / "run"), "--layers", "features.1,features.5"])
    assert out.exit_code == 0, out.output
    cell = tmp_path / "run" / method / "seed0"
    assert (cell / "bn_statistics.png").exists()
    result = json.loads((cell / "bn_statistics.json").read_text())
    assert result["layers"] == ["features.1", "features.5"]
    config = load_config(str(tmp_path / "run" / "config.yaml"))
    engine = build_engine(config, config.methods[0], 0, build_federation_data(config, None))
    load_cell_state(engine, cell / "checkpoint.pt", "test", client_state=True)
    for client in engine.clients:
        # independently: the first BN layer's input is the first convolution's output, whatever the BN statistics
        engine.load_client(client.name)
        with torch.no_grad():
            h = engine.model.features[0](engine.runner.evaluation_prepare(None)(client.train.x).float())
        mine = result["clients"][client.name]
        torch.testing.assert_close(torch.tensor(mine["data"]["features.1"]["mean"], dtype=torch.float64), h.mean((0, 2, 3)).double(),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mine["data"]["features.1"]["var"], dtype=torch.float64),
                                   h.var((0, 2, 3), unbiased=False).double(), rtol=1e-3, atol=1e-5)
        held = engine.model.features[1].running_mean.double()
        torch.testing.assert_close(torch.tensor(mine["stored"]["features.1"]["mean"], dtype=torch.float64), held)
        # the second BN layer: its input when the first normalizes with those exact statistics (by hand: BN in
        # eval mode is (h - mean) / sqrt(var + eps) * weight + bias), then ReLU, pool, conv
        bn = engine.model.features[1]
        mean, var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
        z = (h - mean[:, None, None]) / torch.sqrt(var[:, None, None] + bn.eps) * bn.weight.detach()[:, None, None] \
            + bn.bias.detach()[:, None, None]
        with torch.no_grad():
            g = engine.model.features[4](torch.nn.functional.max_pool2d(torch.relu(z), 2))
        torch.testing.assert_close(torch.tensor(mine["data"]["features.5"]["mean"], dtype=torch.float64),
                                   g.mean((0, 2, 3)).double(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mine["data"]["features.5"]["var"], dtype=torch.float64),
                                   g.var((0, 2, 3), unbiased=False).double(), rtol=1e-3, atol=1e-5)
    if method == "fedavg":  # one shared model: every client holds the server's running statistics
        assert all(c["stored"] == result["server"] for c in result["clients"].values())
    else:  # FedBN: each client its own, none the server's untouched initial ones
        stored = [c["stored"]["features.1"]["mean"] for c in result["clients"].values()]
        assert stored[0] != stored[1] and result["server"]["features.1"]["mean"] == [0.0] * len(stored[0])
    bad = CliRunner().invoke(app, ["bn-stats", str(tmp_path / "run"), "--layers", "features.0"])
    assert bad.exit_code == 2 and "no BatchNorm layer named features.0" in bad.output
