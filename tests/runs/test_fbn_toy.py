"""The FBN paper's 2-D toy (Figs. 1-2, property T6). Margins come from the toy's geometry, not from runs:

- sigma = sqrt(R^2/2 + s^2): per-coordinate std of the union (m points of each of the n Gaussians on the
  radius-R circle; the mean of cos^2 over n equally spaced angles is exactly 1/2);
- d = R / sigma: distance of a class mean from the centre after centralized normalization (1.40 here).
  Naive BN centres every client at 0, so at extreme heterogeneity it errs by about d per point (Jensen:
  by at least the norm of the client's centrally-normalized mean, ``shift``);
- FBN normalizes with the exact union running stats of the previous round (Appendix A), so after its
  warm-up from (0, 1) it errs only by the O(s / (sigma sqrt(nm))) noise of the union statistics.
"""

import math

import numpy as np
import pytest
import torch

from fednorm.runs.fbn_toy import (SCHEMES, class_means, ncm_accuracy, partition, plot_toy, run_toy, sample_union,
                                  toy_table)

R, S, N, M, BETA, ROUNDS = 10.0, 1.0, 10, 30, 0.1, 100
SIGMA = math.sqrt(R**2 / 2 + S**2)
D = R / SIGMA
LEVELS = (0.0, 0.5, 0.9, 1.0)


@pytest.fixture(scope="module")
def runs():
    return {level: run_toy(level, rounds=ROUNDS, seed=0) for level in LEVELS}


def fbn_warmup_error() -> float:
    """Predicted FBN error from the (0, 1) init alone: at round t it scales by 1/sqrt(v_{t-1}) instead of
    1/sigma, v following the running-variance EMA towards sigma^2 (times the union's Kn/(Kn-1)); a point is
    about sqrt(R^2 + 2 s^2) from the origin."""
    v, target, radius, total = 1.0, SIGMA**2 * N * M / (N * M - 1), math.sqrt(R**2 + 2 * S**2), 0.0
    for _ in range(ROUNDS):
        total += radius * abs(1 / math.sqrt(v + 1e-5) - 1 / SIGMA)
        v = (1 - BETA) * v + BETA * target
    return total / ROUNDS


def test_partition_is_gamma_similarity_of_the_union():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(N), M)
    for level in LEVELS:
        parts = partition(rng, N, M, level)
        assert [len(p) for p in parts] == [M] * N
        assert sorted(np.concatenate(parts).tolist()) == list(range(N * M))  # each point to one client
    extreme = partition(rng, N, M, 1.0)
    assert all((labels[p] == i).all() for i, p in enumerate(extreme))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        partition(rng, N, M, 1.5)


def test_fbn_running_stats_equal_centralized_and_naive_variance_is_biased(runs):
    extreme = runs[1.0]["running"]
    for a, b in zip(extreme["fbn"], extreme["centralized"]):  # T1: exact at every round, checked at the last
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # naive BN averages within-client variances only: ~s^2 instead of ~sigma^2 (T4)
    assert (extreme["naive"][1] < 2 * S**2).all() and (extreme["centralized"][1] > SIGMA**2 / 2).all()
    # the same rounds replayed in NumPy: centralized BN's EMA of the union batch (unbiased over the Kn points);
    # naive BN's server mean of each client's EMA of its own batch (unbiased over its K points)
    point_rng, part_rng = np.random.default_rng([0, 0]), np.random.default_rng([0, 1])
    c_m, c_v, n_m, n_v = np.zeros(2), np.ones(2), np.zeros(2), np.ones(2)
    for _ in range(ROUNDS):
        raw, _ = sample_union(point_rng, class_means(N, R), M, S)
        parts = partition(part_rng, N, M, 1.0)
        c_m, c_v = (1 - BETA) * c_m + BETA * raw.mean(0), (1 - BETA) * c_v + BETA * raw.var(0, ddof=1)
        n_m, n_v = (np.mean([(1 - BETA) * n_m + BETA * raw[p].mean(0) for p in parts], 0),
                    np.mean([(1 - BETA) * n_v + BETA * raw[p].var(0, ddof=1) for p in parts], 0))
    for scheme, (mean, var) in {"centralized": (c_m, c_v), "fbn": (c_m, c_v), "naive": (n_m, n_v)}.items():
        torch.testing.assert_close(extreme[scheme][0], torch.from_numpy(mean), rtol=1e-10, atol=1e-10, msg=scheme)
        torch.testing.assert_close(extreme[scheme][1], torch.from_numpy(var), rtol=1e-10, atol=1e-10, msg=scheme)


def test_fbn_error_does_not_depend_on_heterogeneity_and_is_its_warmup(runs):
    # the union batches are the same at every level, and FBN only sees union statistics
    fbn = [runs[level]["error"]["fbn"] for level in LEVELS]
    np.testing.assert_allclose(fbn, fbn[0], rtol=1e-9)
    # what remains is the deterministic warm-up from (0, 1) plus small union-statistics noise
    assert abs(fbn[0] - fbn_warmup_error()) < 0.05
    assert runs[1.0]["error_late"]["fbn"] < D / 10


def test_naive_error_grows_with_heterogeneity_and_fbn_is_far_below_at_extreme(runs):
    naive = [runs[level]["error"]["naive"] for level in LEVELS]
    assert all(a < b for a, b in zip(naive, naive[1:])), naive
    for level in LEVELS:  # Jensen: centring each client on its own mean costs at least the shift
        assert runs[level]["error"]["naive"] >= runs[level]["shift"] - 1e-12
    extreme = runs[1.0]
    assert extreme["shift"] == pytest.approx(D, rel=0.1)
    assert extreme["error"]["naive"] > 0.9 * D
    assert extreme["error"]["fbn"] < extreme["error"]["naive"] / 4


def test_iid_naive_is_close_to_fbn(runs):
    iid = runs[0.0]
    # a client's own batch stats then only differ from the union's by sampling noise (~1/sqrt(m))
    assert iid["error"]["naive"] < D / 4 and iid["error"]["fbn"] < D / 4
    assert abs(iid["error"]["naive"] - iid["error"]["fbn"]) < D / 10


def test_fixbn_keeps_separability_but_misnormalizes_at_extreme(runs):
    fixbn = [runs[level]["error"]["fixbn"] for level in LEVELS]
    assert all(a < b for a, b in zip(fixbn, fixbn[1:])), fixbn
    # phase 2 (half the rounds) scales by ~1/s instead of 1/sigma: error ~R (1 - s/sigma) per point
    assert fixbn[-1] > 0.4 * R * (1 - S / SIGMA)
    assert runs[1.0]["accuracy_final"]["fixbn"] > 0.95


def test_separability_centralized_and_fbn_yes_naive_no(runs):
    extreme = runs[1.0]
    # neighbouring means are 2 R sin(pi/n) = 6.2 s apart: Bayes error 2 Q(3.1) ~ 0.2 %
    assert extreme["accuracy"]["centralized"] > 0.95
    assert extreme["accuracy"]["fbn"] > 0.95
    # naive BN maps every client (= class) to the same standardized cloud: chance level 1/n
    assert extreme["accuracy"]["naive"] < 1 / N + 0.05
    assert runs[0.0]["accuracy"]["naive"] > 0.8  # iid: naive keeps the classes apart


def test_logistic_separability_agrees():
    run = run_toy(1.0, rounds=4, seed=1, classifier="logistic")
    assert run["accuracy"]["centralized"] > 0.95 and run["accuracy"]["naive"] < 1 / N + 0.1


def test_ncm_accuracy():
    pts = np.array([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0]])
    assert ncm_accuracy(pts, np.array([0, 0, 1, 1])) == 1.0
    assert ncm_accuracy(pts, np.array([0, 1, 0, 1])) == 0.5


def test_deterministic_given_seed():
    a, b, c = run_toy(0.7, rounds=6, seed=3), run_toy(0.7, rounds=6, seed=3), run_toy(0.7, rounds=6, seed=4)
    for k in SCHEMES:
        np.testing.assert_array_equal(a["error_per_round"][k], b["error_per_round"][k])
        np.testing.assert_array_equal(a["points"][k], b["points"][k])
    assert not np.array_equal(a["points"]["raw"], c["points"]["raw"])


def test_table_plot_and_errors(tmp_path):
    rows = toy_table(levels=(0.0, 1.0), seeds=(0, 1), rounds=4)
    assert [r["level"] for r in rows] == [0.0, 1.0] and rows[1]["err_naive"] > rows[0]["err_naive"]
    for row, level in zip(rows, (0.0, 1.0)):  # each column the mean over the seeds of its run's quantity
        per_seed = [run_toy(level, rounds=4, seed=s) for s in (0, 1)]

        def mean(get):
            return pytest.approx(float(np.mean([get(r) for r in per_seed])), rel=1e-12)

        assert row["shift"] == mean(lambda r: r["shift"])
        assert row["err_fbn_late"] == mean(lambda r: r["error_late"]["fbn"])
        for k in ("naive", "fbn", "fixbn"):
            assert row[f"err_{k}"] == mean(lambda r: r["error"][k])
        for k in SCHEMES:
            assert row[f"acc_{k}"] == mean(lambda r: r["accuracy"][k])
        assert row["acc_fixbn_final"] == mean(lambda r: r["accuracy_final"]["fixbn"])
    png = plot_toy(tmp_path / "toy.png", level=1.0, rounds=4, rows=rows)
    assert png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="unknown classifier"):
        run_toy(1.0, classifier="svm")
    with pytest.raises(ValueError, match="beta"):
        run_toy(1.0, beta=1.0)
    with pytest.raises(ValueError, match="fixbn_switch"):
        run_toy(1.0, rounds=4, fixbn_switch=5)
