"""The run's plots: the comparison curve ends at the table's Avg, and short or crowded series stay readable."""

from __future__ import annotations

import warnings

import matplotlib.pyplot as plt
import pytest

from fednorm.runs import plots, store


def _cell(run_dir, label, seed, accs: dict[int, float], clients=("a", "b")):
    """A cell's metrics.jsonl: every client scores ``accs[round]`` on test and trains with loss 1 / round."""
    cell = store.cell_dir(run_dir, label, seed)
    cell.mkdir(parents=True)
    store.append_metrics(cell / store.METRICS_FILE, [
        rec for rnd, acc in accs.items() for c in clients
        for rec in ({"round": rnd, "client": c, "split": "test", "acc": acc},
                    {"round": rnd, "client": c, "split": "train", "loss": 1 / rnd})])


def test_a_seed_that_stopped_early_keeps_its_last_score_in_the_comparison(tmp_path):
    # seed 0 diverged in round 3 (last finite evaluation: round 2), seed 1 ran its 4 rounds
    _cell(tmp_path, "fedbn", 0, {1: 0.5, 2: 0.4})
    _cell(tmp_path, "fedbn", 1, {1: 0.6, 2: 0.7, 3: 0.8, 4: 0.9})
    curves, score = plots.comparison_curves(tmp_path, [("fedbn", 0), ("fedbn", 1)])
    # the table's Avg of this row is mean(0.4, 0.9) = 0.65: the curve's last point is that, not 0.9 alone
    assert curves["acc"]["fedbn"] == pytest.approx({1: 0.55, 2: 0.55, 3: 0.6, 4: 0.65})
    assert curves["loss"]["fedbn"] == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.25})  # losses are not carried
    assert score == "accuracy"


def test_the_comparison_curve_leaves_external_clients_out_as_the_table_avg_does(tmp_path):
    import json

    _cell(tmp_path, "fedbn", 0, {1: 0.5}, clients=("a",))
    cell = store.cell_dir(tmp_path, "fedbn", 0)
    # an external client (never trained) scores 0.1: in metrics.jsonl, named external by the finished cell's summary
    store.append_metrics(cell / store.METRICS_FILE, [{"round": 1, "client": "x", "split": "test", "acc": 0.1}])
    (cell / store.SUMMARY_FILE).write_text(json.dumps({"method": "fedbn", "seed": 0, "clients": [
        {"name": "a"}, {"name": "x", "external": True}]}))
    assert store.external_clients(cell) == {"x"}
    curves, _ = plots.comparison_curves(tmp_path, [("fedbn", 0)])
    assert curves["acc"]["fedbn"] == pytest.approx({1: 0.5})


def test_one_evaluation_is_drawn_as_a_point(tmp_path, monkeypatch):
    _cell(tmp_path, "fedavg", 0, {5: 0.7})
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    plots.plot_comparison(tmp_path, [("fedavg", 0)])
    (fig,) = drawn
    assert all(line.get_marker() == "." for ax in fig.axes for line in ax.lines)


def test_a_run_without_a_finite_training_loss_plots_its_scores_without_a_warning(tmp_path, monkeypatch):
    # every cell diverged in its first round: evaluated there (recorded), no training loss
    cell = store.cell_dir(tmp_path, "fedavg", 0)
    cell.mkdir(parents=True)
    store.append_metrics(cell / store.METRICS_FILE, [{"round": 1, "client": "a", "split": "test", "acc": 0.1,
                                                      "diverged": True}])
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend"
        plots.plot_comparison(tmp_path, [("fedavg", 0)])
    accuracy, loss = drawn[0].axes
    assert [t.get_text() for t in accuracy.get_legend().get_texts()] == ["fedavg"]
    assert loss.get_legend() is None and [t.get_text() for t in loss.texts] == ["none recorded"]


def test_many_clients_are_thin_lines_under_their_mean(tmp_path, monkeypatch):
    clients = [f"c{i}" for i in range(plots.MAX_LEGEND_CLIENTS + 1)]
    _cell(tmp_path, "fedwon", 0, {1: 0.2, 2: 0.4}, clients=clients)
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    cell = store.cell_dir(tmp_path, "fedwon", 0)
    plots.plot_cell(store.read_metrics(cell / store.METRICS_FILE), cell)
    accuracy = drawn[0].axes[0]
    labels = [t.get_text() for t in accuracy.get_legend().get_texts()]
    assert labels == [f"mean over the clients ({len(clients)}, each a thin line)"]
    assert len(accuracy.lines) == len(clients) + 1 and list(accuracy.lines[-1].get_ydata()) == [20.0, 40.0]


def test_plots_name_the_run_and_the_cell_they_show(tmp_path, monkeypatch):
    run = tmp_path / "fbn_mnistm-gamma0"
    _cell(run, "naive_bn", 2, {1: 0.5, 2: 0.6})
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    cell = store.cell_dir(run, "naive_bn", 2)
    plots.plot_cell(store.read_metrics(cell / store.METRICS_FILE), cell)
    assert [fig.axes[0].get_title() for fig in drawn] == ["fbn_mnistm-gamma0: naive_bn, seed 2"] * 2  # accuracy, loss
    plots.plot_comparison(run, [("naive_bn", 2)])
    assert drawn[-1].get_suptitle() == "fbn_mnistm-gamma0"
