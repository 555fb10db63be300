"""FedBN's convergence check (fednorm.runs.fedbn_theory): Corollary 4.6's Gram matrices and App. F's data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fednorm.runs import fedbn_theory as theory


def test_closed_form_gram_is_the_expectation_over_gaussian_first_layer_weights():
    """Def. 4.2: G_pq = E_{v ~ N(0, alpha^2 I)}[relu(v.x_p) relu(v.x_q)], estimated here by Monte Carlo."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4)) * np.array([[1.0], [2.0], [0.5], [1.5], [3.0]])  # points of several norms
    alpha = 2.5
    v = rng.standard_normal((400_000, 4)) * alpha
    relu = np.maximum(v @ x.T, 0.0)
    monte_carlo = relu.T @ relu / len(v)
    np.testing.assert_allclose(theory.arccos_gram(x, alpha), monte_carlo, rtol=0.02)
    # on the diagonal theta = 0: alpha^2 |x|^2 / 2 exactly
    np.testing.assert_allclose(np.diag(theory.arccos_gram(x, alpha)), alpha**2 * (x**2).sum(1) / 2)
    with pytest.raises(ValueError, match="non-zero points"):
        theory.arccos_gram(np.zeros((2, 3)))


def test_fedbns_rate_constant_is_the_smallest_client_block_and_never_below_fedavgs():
    """Corollary 4.6: mu0* = min_i lambda_min(G_inf_i) >= lambda_min(G_inf) = mu0; one client: equal."""
    rng = np.random.default_rng(1)
    for seed in range(5):
        covs = theory.client_covariances(3, 6, np.random.default_rng(seed))
        clients = [rng.multivariate_normal(np.zeros(6), cov, size=12) for cov in covs]
        check = theory.gram_check(clients)
        assert check.mu0_star == pytest.approx(min(check.per_client), rel=1e-10)
        assert check.mu0_star >= check.mu0 > 0
    single = theory.gram_check([clients[0]])
    assert single.mu0 == pytest.approx(single.mu0_star, rel=1e-10)


def test_synthetic_clients_have_app_f_means_and_covariances():
    c1, c2 = theory.synthetic_clients(points_per_class=4000, seed=0)
    for client, cov in ((c1, np.eye(10)), (c2, theory.second_client_covariance(0.4))):
        x, y = client.train.x.double().numpy(), client.train.y.numpy()
        assert x.shape == (8000, 10) and np.bincount(y).tolist() == [4000, 4000]
        np.testing.assert_allclose(x[y == 0].mean(0), -1.0, atol=0.06)  # N(-1, S_i) and N(+1, S_i)
        np.testing.assert_allclose(x[y == 1].mean(0), 1.0, atol=0.06)
        np.testing.assert_allclose(np.cov(x[y == 1].T), cov, atol=0.07)
    assert theory.second_client_covariance(0.4)[0, 1] == 0.4 and theory.second_client_covariance(0.4)[0, 2] == 0
    assert not torch.equal(c1.train.x, c1.test.x)  # the test points are drawn apart
    with pytest.raises(ValueError, match="positive definite"):
        theory.second_client_covariance(0.6)


def test_synthetic_model_draws_weights_and_biases_with_std_alpha():
    model = theory.synthetic_model(seed=0)
    first, bn, _, last = model
    assert (first.in_features, first.out_features, bn.num_features, last.out_features) == (10, 100, 100, 2)
    with torch.no_grad():
        assert float(first.weight.std()) == pytest.approx(10.0, rel=0.1)
        assert float(last.weight.std()) == pytest.approx(10.0, rel=0.1)
        assert float(torch.cat([first.bias, last.bias]).std()) == pytest.approx(10.0, rel=0.25)


def test_synthetic_runs_of_both_methods_start_alike_and_fedbn_keeps_bn_per_client():
    fedavg = theory.synthetic_run("fedavg", steps=3, points_per_class=30)
    fedbn = theory.synthetic_run("fedbn", steps=3, points_per_class=30)
    assert len(fedavg["loss"]) == len(fedbn["loss"]) == 3
    # the same data, initial model and batches: the first step's loss is the same number
    assert fedavg["loss"][0] == pytest.approx(fedbn["loss"][0], rel=1e-6)
    assert fedavg["loss"][2] != pytest.approx(fedbn["loss"][2], rel=1e-6)  # then BN averaged or kept apart
