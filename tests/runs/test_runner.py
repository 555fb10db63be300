import json
import math
import os
import warnings

import pytest
import torch

from fednorm.runs import store
from fednorm.runs.config import load_config
from fednorm.runs.runner import RunError, load_run_config, resume_run, start_run

from ..conftest import TINY_RUN as TINY
from ..conftest import tiny_run_config as tiny_config


class Stop(Exception):
    pass


def stop_after(round_to_stop):
    def progress(label, seed, rnd, rounds, last):
        if label == "fedbn" and rnd == round_to_stop:
            raise Stop()
    return progress


def test_run_writes_the_run_folder(tmp_path):
    cfg = tiny_config()
    results = start_run(cfg, tmp_path / "run")
    run = tmp_path / "run"
    assert (run / "config.yaml").exists() and (run / "results.md").exists() and (run / "comparison.png").exists()
    cell = run / "fedbn" / "seed0"
    records = store.read_metrics(cell / "metrics.jsonl")
    assert {r["round"] for r in records} == {1, 2, 3, 4}
    assert {r["round"] for r in records if r["split"] == "test"} == {2, 4}
    assert {r["client"] for r in records} == {"rendered/print", "rendered/neon"}
    summary = json.loads((cell / "summary.json").read_text())
    last = [r for r in records if r["split"] == "test" and r["round"] == 4]
    assert {c["name"]: c["test"]["final_acc"] for c in summary["clients"]} == {r["client"]: r["acc"] for r in last}
    assert (cell / "accuracy.png").exists() and (cell / "loss.png").exists()
    assert [r.label for r in results] == ["fedavg", "fedbn"]
    text = (run / "results.md").read_text()
    assert "rendered stand-in" in text and "| print† |" in text and "rendered/print" in text
    with pytest.raises(RunError, match="fednorm resume"):
        start_run(cfg, run)


def test_resume_after_interruption_gives_identical_results(tmp_path):
    cfg = tiny_config()
    start_run(cfg, tmp_path / "straight")
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "stopped", progress=stop_after(3))
    ckpt = torch.load(tmp_path / "stopped" / "fedbn" / "seed0" / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == 3
    trained = []
    resume_run(tmp_path / "stopped", progress=lambda label, seed, rnd, rounds, last: trained.append((label, rnd)))
    # fedavg had finished (reported done, not retrained); fedbn starts at its round-3 checkpoint (the first report
    # is where a cell starts: 0 from scratch) and trains round 4 only
    assert trained == [("fedavg", 4), ("fedbn", 3), ("fedbn", 4)]
    for label in ("fedavg", "fedbn"):
        a = (tmp_path / "straight" / label / "seed0" / "metrics.jsonl").read_text()
        b = (tmp_path / "stopped" / label / "seed0" / "metrics.jsonl").read_text()
        assert a == b
        sa = torch.load(tmp_path / "straight" / label / "seed0" / "checkpoint.pt", weights_only=False)
        sb = torch.load(tmp_path / "stopped" / label / "seed0" / "checkpoint.pt", weights_only=False)
        for k in sa["global_state"]:
            assert torch.equal(sa["global_state"][k], sb["global_state"][k])


def test_a_finished_run_extended_to_more_rounds_equals_a_run_of_that_many_rounds(tmp_path):
    start_run(tiny_config(), tmp_path / "straight")  # 4 rounds
    start_run(tiny_config("federation.rounds=2"), tmp_path / "short")
    results = resume_run(tmp_path / "short", rounds=4)
    assert [r.summary["rounds"] for r in results] == [4, 4]
    for label in ("fedavg", "fedbn"):
        a = (tmp_path / "straight" / label / "seed0" / "metrics.jsonl").read_text()
        b = (tmp_path / "short" / label / "seed0" / "metrics.jsonl").read_text()
        assert a == b  # training and evaluations of rounds 1-4, the evaluation after round 2 included
        sa = json.loads((tmp_path / "straight" / label / "seed0" / "summary.json").read_text())
        sb = json.loads((tmp_path / "short" / label / "seed0" / "summary.json").read_text())
        assert sa["mean_final_test_acc"] == sb["mean_final_test_acc"]
    assert load_config(tmp_path / "short" / "config.yaml").federation.rounds == 4
    assert json.loads((tmp_path / "short" / "run.json").read_text())["extended"] == [{"from": 2, "to": 4}]
    with pytest.raises(RunError, match="extended, not shortened"):
        resume_run(tmp_path / "short", rounds=3)


def test_extending_refuses_a_switch_at_a_fraction_of_the_rounds_and_a_cell_without_checkpoint(tmp_path):
    fixbn = "methods=[{name: fixbn, freeze_bn_stats_at: 0.5}]"
    start_run(tiny_config(fixbn, "federation.rounds=2"), tmp_path / "fraction")
    with pytest.raises(RunError, match=r"round 1 of 2, round 2 of 4"):  # FixBN's switch would move
        resume_run(tmp_path / "fraction", rounds=4)
    assert load_config(tmp_path / "fraction" / "config.yaml").federation.rounds == 2  # nothing written
    start_run(tiny_config("methods=[{name: fixbn, freeze_bn_stats_at: 1}]", "federation.rounds=2"), tmp_path / "index")
    assert resume_run(tmp_path / "index", rounds=3)[0].summary["rounds"] == 3  # a round index does not move
    (tmp_path / "index" / "fixbn" / "seed0" / "checkpoint.pt").unlink()
    with pytest.raises(RunError, match="checkpoint.pt is gone"):
        resume_run(tmp_path / "index", rounds=4)


def test_resume_drops_metrics_written_after_the_last_checkpoint(tmp_path):
    cfg = tiny_config("federation.checkpoint_every=2")
    start_run(cfg, tmp_path / "straight")
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "stopped", progress=stop_after(3))
    cell = tmp_path / "stopped" / "fedbn" / "seed0"
    assert max(r["round"] for r in store.read_metrics(cell / "metrics.jsonl")) == 3
    with open(cell / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 4, "client": "x", "spl')  # a line cut by a kill
    resume_run(tmp_path / "stopped")
    assert (cell / "metrics.jsonl").read_text() == (tmp_path / "straight" / "fedbn" / "seed0" / "metrics.jsonl").read_text()


def test_a_damaged_metrics_line_loses_only_itself_on_resume_and_the_file_as_it_was_is_kept(tmp_path):
    """A line damaged in the middle of metrics.jsonl (not a kill's cut last line): the resume keeps every other
    record (not only those before it), leaves that one out, keeps the damaged file aside and says so."""
    cfg = tiny_config("federation.checkpoint_every=1")
    start_run(cfg, tmp_path / "straight")
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "stopped", progress=stop_after(3))
    cell = tmp_path / "stopped" / "fedbn" / "seed0"
    lines = (cell / "metrics.jsonl").read_text().splitlines(keepends=True)
    damaged = lines[:2] + [lines[2][:15] + "\n"] + lines[3:]
    (cell / "metrics.jsonl").write_text("".join(damaged))
    with pytest.warns(UserWarning, match=r"metrics.jsonl had 1 damaged line\(s\) \(line 3\).*metrics.damaged-1.jsonl"):
        resume_run(tmp_path / "stopped")
    assert (cell / "metrics.damaged-1.jsonl").read_text() == "".join(damaged)
    straight = (tmp_path / "straight" / "fedbn" / "seed0" / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert (cell / "metrics.jsonl").read_text() == "".join(straight[:2] + straight[3:])


def test_a_cell_whose_checkpoint_is_gone_trains_again_and_keeps_its_earlier_metrics_aside(tmp_path):
    # a folder copied or cloned without its *.pt files: the unfinished cell cannot go on, but its metrics are results
    cfg = tiny_config()
    start_run(cfg, tmp_path / "straight")
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "stopped", progress=stop_after(3))
    cell = tmp_path / "stopped" / "fedbn" / "seed0"
    before = (cell / "metrics.jsonl").read_text()
    assert max(r["round"] for r in store.read_metrics(cell / "metrics.jsonl")) == 3
    (cell / "checkpoint.pt").unlink()
    with pytest.warns(UserWarning, match=r"metrics up to round 3 but no checkpoint.pt.*metrics.no-checkpoint-1.jsonl"):
        resume_run(tmp_path / "stopped")
    assert (cell / "metrics.no-checkpoint-1.jsonl").read_text() == before
    straight = (tmp_path / "straight" / "fedbn" / "seed0" / "metrics.jsonl").read_text()
    assert (cell / "metrics.jsonl").read_text() == straight  # trained again from round 0, the same numbers
    # a second loss keeps the first set-aside file and adds another; a finished cell is never retrained
    (cell / "checkpoint.pt").unlink()
    (cell / "summary.json").unlink()
    with pytest.warns(UserWarning, match="metrics.no-checkpoint-2.jsonl"):
        resume_run(tmp_path / "stopped")
    assert (cell / "metrics.no-checkpoint-1.jsonl").read_text() == before
    assert (cell / "metrics.no-checkpoint-2.jsonl").read_text() == straight
    assert not (tmp_path / "stopped" / "fedavg" / "seed0" / "metrics.no-checkpoint-1.jsonl").exists()


def test_a_folder_being_run_refuses_a_second_resume_and_frees_when_done(tmp_path):
    """Two processes resuming one folder would interleave checkpoints and metrics: the second is refused, naming
    the holder, and nothing of the folder changes; the lock goes with the first."""
    from fednorm.runs.runner import run_lock

    cfg = tiny_config("methods=[fedbn]")
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "run", progress=stop_after(2))
    cell = tmp_path / "run" / "fedbn" / "seed0"
    before = (cell / "metrics.jsonl").read_text()
    with run_lock(tmp_path / "run"):
        with pytest.raises(RunError, match=f"is being run by process {os.getpid()}"):
            resume_run(tmp_path / "run")
    assert (cell / "metrics.jsonl").read_text() == before
    (cell / "checkpoint.pt.k3j9x2.tmp").write_bytes(b"half a checkpoint")  # a write killed before its rename
    (tmp_path / "new").mkdir()
    with run_lock(tmp_path / "new"):  # another process is starting a run in this folder
        with pytest.raises(RunError, match="is being run by"):
            start_run(cfg, tmp_path / "new")
    assert not (tmp_path / "new" / "config.yaml").exists()
    assert resume_run(tmp_path / "run")[0].summary["rounds"] == cfg.federation.rounds
    assert not list((tmp_path / "run").rglob("*.tmp"))  # none left by atomic writes, and a killed write's leftover is removed


def test_same_seed_same_numbers_and_seeds_differ(tmp_path):
    cfg = tiny_config("seeds=[0, 1]", "methods=[fedbn]")
    start_run(cfg, tmp_path / "a")
    start_run(cfg, tmp_path / "b")
    read = lambda d, s: (d / "fedbn" / f"seed{s}" / "metrics.jsonl").read_text()  # noqa: E731
    assert read(tmp_path / "a", 0) == read(tmp_path / "b", 0)
    assert read(tmp_path / "a", 0) != read(tmp_path / "a", 1)


def test_keeping_freed_memory_changes_no_number(tmp_path):
    """federation.reuse_freed_memory only changes where memory comes from: the metrics are identical."""
    read = lambda d: (d / "fedbn" / "seed0" / "metrics.jsonl").read_text()  # noqa: E731
    for setting in ("false", "true"):
        start_run(tiny_config("methods=[fedbn]", "federation.rounds=2",
                              f"federation.reuse_freed_memory={setting}"), tmp_path / setting)
    assert read(tmp_path / "false") == read(tmp_path / "true")


def test_centralized_trains_one_model_and_reports_every_domain(tmp_path):
    cfg = tiny_config("methods=[centralized, singleset]", "federation.rounds=2")
    start_run(cfg, tmp_path / "run")
    records = store.read_metrics(tmp_path / "run" / "centralized" / "seed0" / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    assert {r["client"] for r in train} == {"centralized"}
    assert train[0]["n"] == 2 * 40  # the union of both clients' training data
    assert {r["client"] for r in records if r["split"] == "test"} == {"rendered/print", "rendered/neon"}


def test_missing_data_folder_is_reported_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDNORM_DATA", raising=False)
    cfg = load_config("default", TINY + ["data.domains=[mnist, rendered/print]"])
    from fednorm.data.domain import DataError

    with pytest.raises(DataError, match=r"(?s)nowhere.*(--data-dir|FEDNORM_DATA)"):
        start_run(cfg, tmp_path / "run", data_dir=str(tmp_path / "nowhere"))
    assert not (tmp_path / "run").exists()  # nothing half-made is left behind


@pytest.mark.integration
def test_real_digit_domains_run_end_to_end(tmp_path):
    from ..conftest import real_data_dir

    data = str(real_data_dir())
    cfg = load_config("fedbn_digits", ["data.domains=[usps, semeion, rendered/synth]", "model.width=0.125",
                                       "federation.rounds=2", "federation.eval_every=1", "seeds=[0]",
                                       "methods=[fedavg, fedbn]", "data.percent=0.1"])
    start_run(cfg, tmp_path / "run", data_dir=data)
    summary = json.loads((tmp_path / "run" / "fedbn" / "seed0" / "summary.json").read_text())
    sizes = {c["name"]: (c["num_train"], c["test"]["n"]) for c in summary["clients"]}
    assert sizes == {"usps": (743, 1860), "semeion": (127, 319), "rendered/synth": (743, 1860)}
    origins = {c["name"]: c["origin"] for c in summary["clients"]}
    assert origins == {"usps": "real", "semeion": "real", "rendered/synth": "rendered"}
    text = (tmp_path / "run" / "results.md").read_text()
    assert "paper" in text and "95.56" in text  # FedAvg's USPS number from FedBN Table 11 beside ours
    # ... and says where the paper rows come from, since this run's overrides (2 rounds, 10 %) are not the paper's
    assert "paper rows: FedBN Table 11 (centralized: Table 12), mean of 5 trials" in text
    assert json.loads((tmp_path / "run" / "results.json").read_text())["paper_source"] == cfg.paper_source


@pytest.mark.integration
def test_fedbn_unequal_sizes_preset_gives_each_client_its_datasets_share_and_the_largest_ones_iterations():
    """FedBN App. E.6 (Table 15): 10 % of each dataset's own training split, and every client runs the largest
    client's iterations of one epoch (the smaller ones repeat sampling)."""
    import math

    from fednorm.runs.runner import build_federation_data

    from ..conftest import real_data_dir

    cfg = load_config("fedbn_digits_unequal")
    sizes = {c.name: c.num_train for c in build_federation_data(cfg, real_data_dir())}
    # MNIST 70,000 and USPS 9,298 images, split 80/20: 10 % of 56,000 and of 7,438; MNIST-M's offline 18,000: 1,440
    assert sizes == {"mnist": 5600, "mnistm": 1440, "usps": 743, "rendered/street": 743, "rendered/synth": 743}
    assert cfg.training.steps == math.ceil(max(sizes.values()) / cfg.training.batch_size)


def test_cross_device_run_evaluates_each_domain_once_with_the_global_model(tmp_path):
    cfg = tiny_config("methods=[fedwon, fixbn]", "federation.setting=cross_device", "data.partition=even",
                      "data.clients_per_domain=10", "data.percent=1.0", "federation.fraction=0.2",
                      "training.batch_size=4", "model.classifier=fedwon", "federation.rounds=2")
    results = start_run(cfg, tmp_path / "run")
    for r in results:
        assert [c["name"] for c in r.summary["clients"]] == ["rendered/print", "rendered/neon"]
    records = store.read_metrics(tmp_path / "run" / "fedwon" / "seed0" / store.METRICS_FILE)
    trained = {x["client"] for x in records if x["split"] == "train" and x["round"] == 1}
    assert len(trained) == 4  # 20 % of 20 clients
    assert {x["client"] for x in records if x["split"] == "test"} == {"rendered/print", "rendered/neon"}


def test_label_skew_dsgd_run_with_byzantine_clients_resumes_exactly(tmp_path):
    overrides = ["data.domains=[rendered/print]", "data.rendered_size=400", "data.pool_size=300",
                 "data.partition=gamma", "data.gamma=0.5", "data.num_clients=5", "model.name=fbn_cnn",
                 "model.width=0.125", "training.steps=1", "training.batch_size=8", "training.momentum=0.9",
                 "training.momentum_style=ema", "training.lr=0.05", "training.precision=fp32",
                 "federation.rounds=4", "federation.eval_every=2", "federation.persistent_optimizer=true",
                 "federation.weighting=uniform", "federation.byzantine={count: 1, attack: sign_flip}",
                 "methods=[fbn, {name: naive_bn, label: naive-median, server: {rule: median}}, centralized_bn]"]
    cfg = load_config("default", overrides)
    results = start_run(cfg, tmp_path / "full")
    clients = {c["name"] for r in results for c in r.summary["clients"]}
    assert clients == {"rendered/print"}  # stateless methods: the shared test split is evaluated once
    def progress(label, seed, rnd, rounds, last):
        if label == "naive-median" and rnd == 3:
            raise Stop()
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "cut", progress=progress)
    resumed = resume_run(tmp_path / "cut")
    for a, b in zip(results, resumed):
        assert a.summary == b.summary
    for label in ("fbn", "naive-median", "centralized_bn"):  # every round's numbers and the whole final state
        cells = [tmp_path / run / label / "seed0" for run in ("full", "cut")]
        assert (cells[0] / store.METRICS_FILE).read_text() == (cells[1] / store.METRICS_FILE).read_text()
        assert_same_state(*(store.load_checkpoint(c / store.CHECKPOINT_FILE) for c in cells))


def assert_same_state(a, b, where="checkpoint"):
    """Two checkpoints hold the same entries with bit-identical tensors (model, optimizer momentum, server and
    FBN statistics, random-generator states)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_external_data_all_scores_every_image_of_the_external_domain():
    """UniFed: external clients' data "are all held out for testing": with external.data=all an external
    client's test split is its whole domain, not the federation protocol's 20 % test split."""
    from fednorm.data.federation import load_domain
    from fednorm.runs.runner import build_external_clients

    split = build_external_clients(tiny_config("external.domains=[rendered/street]"), None)
    whole = build_external_clients(tiny_config("external.domains=[rendered/street]", "external.data=all"), None)
    cfg = tiny_config()
    pool = load_domain("rendered/street", data_dir=None, rendered_size=cfg.data.rendered_size,
                       seed=cfg.data.split_seed).all()
    assert len(split[0].test) < len(pool)
    assert torch.equal(whole[0].test.x, pool.x) and torch.equal(whole[0].test.y, pool.y)
    assert whole[0].meta["external"] and len(whole[0].train) == 0  # loaded once: no protocol split kept beside it


def test_prepared_morpho_sets_score_as_unseen_clients_of_a_digits_federation(tmp_path):
    """FedBN App. G (Table 17): Morpho-MNIST sets, prepared from zips in the authors' format, are external clients
    of a digits run, scored under each mode on their test split; the paper's rows sit under those columns."""
    import numpy as np

    from fednorm.data.prepare import prepare_dataset

    from ..data.test_morpho import _sets, _zip

    data = tmp_path / "data"
    raw = tmp_path / "raw"
    raw.mkdir()
    for k, kind in enumerate(("global", "local")):
        _zip(raw / f"morpho_{kind}.zip", _sets(np.random.default_rng(k), kind, n_train=40, n_test=10), f"{kind}/")
        prepare_dataset(f"morpho_{kind}", data, raw_dir=raw, download=False, progress=False)
    cfg = tiny_config("methods=[fedavg, fedbn]", "external.domains=[morpho_global, morpho_local]",
                      "external.modes=[global, fedbn_average]", "federation.rounds=2")
    (fedavg, fedbn) = start_run(cfg, tmp_path / "run", data_dir=str(data))
    for r in (fedavg, fedbn):
        scored = {c["name"]: c["test"]["n"] for c in r.summary["clients"] if c.get("external")}
        # 50 images each, the protocol's stratified 80/20 re-split: 10 scored
        assert scored == {f"morpho_{k}:{m}": 10 for k in ("global", "local") for m in ("global", "fedbn_average")}
    from fednorm.runs.config import load_config

    table17 = load_config("fedbn_digits_unseen")
    assert set(table17.paper["fedbn"]) == {"morpho_global:fedbn_average", "morpho_local:fedbn_average"}


def test_external_domain_is_reported_per_mode_and_left_out_of_the_average(tmp_path):
    cfg = tiny_config("methods=[fedavg, fedbn, perfedavg]", "external.domains=[rendered/street]")
    results = start_run(cfg, tmp_path / "run")
    for r in results:
        names = [c["name"] for c in r.summary["clients"]]
        assert names == ["rendered/print", "rendered/neon", "rendered/street:global", "rendered/street:test_time_bn",
                         "rendered/street:fedbn_average"]
        internal = [c["test"]["final_acc"] for c in r.summary["clients"] if not c.get("external")]
        assert r.summary["mean_final_test_acc"] == sum(internal) / len(internal)
    text = (tmp_path / "run" / "results.md").read_text()
    assert "street:test_time_bn" in text
    # comparison.png's last accuracy point is the table's Avg (the internal clients' mean), not the external ones
    from fednorm.runs.plots import comparison_curves

    curves, _ = comparison_curves(tmp_path / "run", [(r.label, r.seed) for r in results])
    for r in results:
        acc = curves["acc"][r.label]
        assert acc[max(acc)] == pytest.approx(r.summary["mean_final_test_acc"], abs=1e-12)
    # UniFed Fig. 6 ablation from the checkpoints: the global row equals the run's own final global column
    from fednorm.methods.external import ABLATION_MOMENTA, ABLATION_ORDERS, ABLATION_TEST_BATCH_SIZES
    from fednorm.runs.unifed_ablation import ablation_rows

    rows = ablation_rows(tmp_path / "run")
    fedavg = [r for r in rows if r[0] == "fedavg/seed0"]
    assert len(fedavg) == 3 + len(ABLATION_TEST_BATCH_SIZES) + len(ABLATION_MOMENTA) + len(ABLATION_ORDERS)
    final = {c["name"]: c["test"]["final_acc"] for c in results[0].summary["clients"]}
    assert fedavg[0][1] == "global" and abs(fedavg[0][3] - 100 * final["rendered/street:global"]) < 1e-9
    # FedBN App. G's mode, recomputed from the checkpoint, equals the run's own final column
    assert fedavg[1][1] == "fedbn_average (App. G)"
    assert abs(fedavg[1][3] - 100 * final["rendered/street:fedbn_average"]) < 1e-9
    # the run's own test_time_bn column is the ablation's default point (batch 32, momentum 0.9), and the
    # ablation's settings act: its test batch sizes and momenta do not all give one number
    by_setting = {r[1]: r[3] for r in fedavg}
    assert abs(by_setting["momentum 0.9"] - 100 * final["rendered/street:test_time_bn"]) < 1e-9
    # FedAvg's BN layers are the clients' average already: the bn_average row is the global model's
    assert fedavg[2][1] == "bn_average (averaged statistics)" and fedavg[2][3] == fedavg[0][3]
    assert len({round(v, 9) for k, v in by_setting.items() if k.startswith(("batch", "momentum"))}) > 1
    # external.momentum reaches the run's evaluation: momentum 0 (training is the same) gives the momentum-0 point
    [zero] = start_run(tiny_config("methods=[fedavg]", "external.domains=[rendered/street]", "external.momentum=0.0"),
                       tmp_path / "momentum0")
    at_zero = {c["name"]: c["test"]["final_acc"] for c in zero.summary["clients"]}
    assert abs(by_setting["momentum 0.0"] - 100 * at_zero["rendered/street:test_time_bn"]) < 1e-9
    assert at_zero["rendered/street:global"] == final["rendered/street:global"]
    # Per-FedAvg is evaluated as in the run: adapted on its labelled test samples first, which are left out
    perfedavg = {r[1]: r[3] for r in rows if r[0] == "perfedavg/seed0"}
    final = {c["name"]: c["test"]["final_acc"] for c in results[2].summary["clients"]}
    assert abs(perfedavg["global"] - 100 * final["rendered/street:global"]) < 1e-9
    assert abs(perfedavg["fedbn_average (App. G)"] - 100 * final["rendered/street:fedbn_average"]) < 1e-9
    # saved per cell and resumed: a run stopped after its first cell recomputes only the second
    from fednorm.runs.unifed_ablation import FIGURE_FILE, ROWS_FILE, TABLE_FILE, iter_ablation, run_ablation

    first_label, first_rows = next(iter_ablation(tmp_path / "run"))
    store.write_json(tmp_path / "run" / ROWS_FILE, first_rows)
    seen = []
    resumed = run_ablation(tmp_path / "run", progress=lambda done, total: seen.append(total))
    assert resumed == rows and set(seen) == {2 * len(fedavg)}  # only fedbn's and perfedavg's were left to do
    table = (tmp_path / "run" / TABLE_FILE).read_text()
    assert "| fedbn/seed0 | momentum" in table
    # Fig. 6(c): the orders in one line per cell, mean (min-max) over the orders of the cell's fedavg rows
    street = [r[3] for r in fedavg if r[1].startswith("order ")]
    assert (f"| fedavg/seed0 | {len(ABLATION_ORDERS)} orders: mean (min-max) | "
            f"{sum(street) / len(street):.2f} ({min(street):.2f}-{max(street):.2f}) |") in table
    assert "| fedavg/seed0 | order 0 |" not in table
    assert (tmp_path / "run" / FIGURE_FILE).stat().st_size > 0
    # a saved ablation from before a setting existed: only the missing (cell, setting, client) rows are computed
    older = [r for r in rows if not r[1].startswith("order ")]
    store.write_json(tmp_path / "run" / ROWS_FILE, older)
    seen = []
    filled = run_ablation(tmp_path / "run", progress=lambda done, total: seen.append(total))
    assert sorted(filled) == sorted(rows) and filled[:len(older)] == older
    assert set(seen) == {3 * len(ABLATION_ORDERS)}  # three cells, one external client


def test_validation_split_and_model_selection_by_validation_accuracy(tmp_path):
    cfg = tiny_config("methods=[fedbn]", "data.val_fraction=0.25")
    results = start_run(cfg, tmp_path / "run")
    records = store.read_metrics(tmp_path / "run" / "fedbn" / "seed0" / store.METRICS_FILE)
    val = {}
    for r in records:
        if r["split"] == "val":
            val.setdefault(r["round"], []).append(r["acc"])
    chosen = max(val, key=lambda rnd: (sum(val[rnd]) / len(val[rnd]), -rnd))
    for c in results[0].summary["clients"]:
        test_at = next(r["acc"] for r in records if r["client"] == c["name"] and r["split"] == "test"
                       and r["round"] == chosen)
        assert c["test"]["selected_round"] == chosen and c["test"]["selected_acc"] == test_at
        assert c["val"]["n"] > 0


# a run whose mean validation accuracy peaks before its last round (seeded: round 3 of 6 here)
SELECTION = ("methods=[fedbn]", "data.val_fraction=0.25", "external.domains=[rendered/street]",
             "federation.eval_every=1", "federation.rounds=6", "training.lr=0.5")


def test_the_validation_selected_model_is_saved_and_is_the_model_of_the_selected_round(tmp_path):
    from fednorm.runs.runner import load_selected
    from fednorm.runs.unifed_ablation import ablation_rows, run_ablation_with_progress

    [result] = start_run(tiny_config(*SELECTION), tmp_path / "run")
    cell = tmp_path / "run" / "fedbn" / "seed0"
    clients = {c["name"]: c["test"] for c in result.summary["clients"]}
    chosen = clients["rendered/print"]["selected_round"]
    assert result.summary["selected_model"] == {"file": store.SELECTED_FILE, "round": chosen}
    assert chosen < 6  # the selected model is not the last one: the two files must differ
    # selected.pt holds the engine state after round `chosen` (training went on after it was kept): a run of
    # `chosen` rounds ends with exactly that state, every client's local BN included
    start_run(tiny_config(*SELECTION, f"federation.rounds={chosen}"), tmp_path / "short")
    assert_same_state(load_selected(cell / store.SELECTED_FILE),
                      store.load_checkpoint(tmp_path / "short" / "fedbn" / "seed0" / store.CHECKPOINT_FILE))
    # the ablation of the selected model reproduces the run's scores at the selected round, that of the last
    # model the final scores
    for model, key in (("selected", "selected_acc"), ("final", "final_acc")):
        rows = {r[1]: r[3] for r in ablation_rows(tmp_path / "run", model=model)}
        assert abs(rows["global"] - 100 * clients["rendered/street:global"][key]) < 1e-9
        assert abs(rows["momentum 0.9"] - 100 * clients["rendered/street:test_time_bn"][key]) < 1e-9
    (cell / store.SELECTED_FILE).unlink()
    with pytest.raises(RunError, match="no cell has a validation-selected model"):
        run_ablation_with_progress(tmp_path / "run", model="selected")
    # switched off: no model file, the same selected scores in the summary
    [lean] = start_run(tiny_config(*SELECTION, "federation.keep_selected_model=false"), tmp_path / "lean")
    assert not (tmp_path / "lean" / "fedbn" / "seed0" / store.SELECTED_FILE).exists()
    assert "selected_model" not in lean.summary
    assert lean.summary["clients"] == result.summary["clients"]


def test_a_resumed_run_keeps_the_selected_model_of_its_kept_history_only(tmp_path):
    from fednorm.runs.runner import ModelSelection, load_selected

    cfg = tiny_config(*SELECTION, "federation.checkpoint_every=2")
    [straight] = start_run(cfg, tmp_path / "straight")
    chosen = straight.summary["selected_model"]["round"]
    assert chosen == 3  # kept at the round-4 checkpoint, before the stop below
    expected = load_selected(tmp_path / "straight" / "fedbn" / "seed0" / store.SELECTED_FILE)
    pending = store.SELECTED_FILE.replace(".pt", ".pending.pt")
    for name, stop, between in (("stopped", 5, None), ("before the peak's checkpoint", 3, None),
                                ("between the writes, before the checkpoint", 5, "before"),
                                ("between the writes, after the checkpoint", 5, "after")):
        with pytest.raises(Stop):
            start_run(cfg, tmp_path / name, progress=stop_after(stop))  # the checkpoint is round stop - 1's
        cell = tmp_path / name / "fedbn" / "seed0"
        # selected.pt never runs ahead of the checkpoint: stopped after round 3, it holds round 1 or 2
        assert ModelSelection.read_round(cell / store.SELECTED_FILE) <= store.load_checkpoint(
            cell / store.CHECKPOINT_FILE)["round"] == stop - 1
        assert not (cell / pending).exists()  # committed with its checkpoint
        state = store.load_checkpoint(cell / store.SELECTED_FILE)
        if between == "before":  # a later round's pending file, its checkpoint never written: of no kept history
            store.save_checkpoint(cell / pending, {**state, "round": 5})
        elif between == "after":  # round 3's file still pending, selected.pt an older best's (another model)
            (cell / store.SELECTED_FILE).rename(cell / pending)
            store.save_checkpoint(cell / store.SELECTED_FILE,
                                  {**state, "round": 1, "state": store.load_checkpoint(cell / store.CHECKPOINT_FILE)})
        [resumed] = resume_run(tmp_path / name)
        # neither stop loses round 3's model nor passes another round's off as it
        assert resumed.summary["selected_model"] == straight.summary["selected_model"]
        assert_same_state(load_selected(cell / store.SELECTED_FILE), expected)
        assert not (cell / pending).exists()
        assert resumed.summary["clients"] == straight.summary["clients"]  # the selected scores come from metrics


def test_best_is_one_round_for_every_client_not_each_clients_own_best():
    """report --best: the scores of the round with the best mean internal test score (one model), not the
    per-client maxima (client a peaks in round 1, client b in round 2; the mean peaks in round 2)."""
    from types import SimpleNamespace

    from fednorm.runs.runner import summarize_cell

    def rec(rnd, client, acc, split="test"):
        return {"round": rnd, "client": client, "split": split, "acc": acc, "loss": 0.0, "n": 10}

    records = [rec(1, "a", 0.9), rec(1, "b", 0.5), rec(2, "a", 0.8), rec(2, "b", 0.7),
               rec(1, "x", 1.0), rec(2, "x", 0.0)]  # x is external: its peak must not choose the round
    clients = [SimpleNamespace(name=n, domain=n, origin="real", num_train=10, meta={"external": n == "x"})
               for n in "abx"]
    test = {c["name"]: c["test"] for c in summarize_cell(records, clients, "fedbn", 0, 2)["clients"]}
    assert (test["a"]["best_acc"], test["b"]["best_acc"]) == (0.9, 0.7)  # per client, from different rounds
    assert [(test[n]["best_mean_acc"], test[n]["best_mean_round"]) for n in "abx"] == [(0.8, 2), (0.7, 2), (0.0, 2)]


def test_corrupted_copies_of_one_domain_hold_out_the_same_images_for_validation(tmp_path, monkeypatch):
    # corrupt/contrast/... and corrupt/brightness/... of one base train on the same base images; a client
    # validating on images another client trains on (other corruption, same digit) inflates validation
    from fednorm.data import corrupt
    from fednorm.runs.runner import build_federation_data

    monkeypatch.setenv(corrupt.CACHE_ENV, str(tmp_path / "cache"))
    base = "rendered/print"
    domains = [base, f"corrupt/contrast/1/{base}", f"corrupt/brightness/1/{base}"]
    cfg = tiny_config(f"data.domains=[{', '.join(domains)}]", "data.val_fraction=0.25")
    clean, *copies = build_federation_data(cfg, None)
    assert len(clean.val) == 10 and len(clean.train) == 30
    from fednorm.data.federation import load_domain

    def whole(name):
        return load_domain(name, data_dir=None, rendered_size=cfg.data.rendered_size, seed=cfg.data.split_seed).all()

    row = {img.numpy().tobytes(): i for i, img in enumerate(whole(base).x)}
    for split in ("val", "train"):
        positions = torch.tensor([row[img.numpy().tobytes()] for img in getattr(clean, split).x])
        for name, copy in zip(domains[1:], copies):
            # each copy holds the corrupted versions of exactly the clean client's base images, in its order
            torch.testing.assert_close(getattr(copy, split).x, whole(name).x[positions], rtol=0, atol=0)
            assert torch.equal(getattr(copy, split).y, getattr(clean, split).y)
            assert not torch.equal(getattr(copy, split).x, getattr(clean, split).x)  # yet corrupted
    # the positions held out depend on the partition only, not on the client's place in the federation
    alone = build_federation_data(tiny_config(f"data.domains=[{base}]", "data.val_fraction=0.25"), None)[0]
    assert torch.equal(alone.val.x, clean.val.x)


@pytest.mark.parametrize("extra, names", [
    ([], ["rendered/print", "rendered/neon"]),
    # label skew (FBN): the partition's clients carry their scheme in meta; the record is still of their data
    (["data.domains=[rendered/print]", "data.partition=gamma", "data.gamma=0.0", "data.num_clients=3"],
     ["rendered/print-1", "rendered/print-2", "rendered/print-3"]),
])
def test_partitions_are_saved_with_the_run_and_checked_on_resume(tmp_path, extra, names):
    cfg = tiny_config("methods=[fedavg]", "federation.rounds=2", *extra)
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "run", progress=lambda label, seed, rnd, rounds, last: (_ for _ in ()).throw(Stop())
                  if rnd == 1 else None)
    saved = json.loads((tmp_path / "run" / "partitions.json").read_text())
    assert [c["name"] for c in saved] == names
    assert all(len(c["train"]["sha256"]) == 64 and sum(c["train"]["labels"]) == c["train"]["n"] for c in saved)
    saved[0]["train"]["sha256"] = "0" * 64  # as if the data had changed since the run started
    (tmp_path / "run" / "partitions.json").write_text(json.dumps(saved))
    with pytest.raises(RunError, match=f"{names[0]}.*train data"):
        resume_run(tmp_path / "run")


def test_a_segmentation_client_is_recorded_with_its_pixels_per_class(tmp_path):
    from fednorm.runs.runner import PARTITIONS_FILE, check_partitions, partition_record

    from ..engines.test_segmentation_engine import SIDE, clients

    sites = clients(2)
    [entry, _] = partition_record(sites)
    mask = sites[0].train.y
    assert "labels" not in entry["train"]
    assert entry["train"]["pixels"] == [int((mask == 0).sum()), int((mask == 1).sum())]
    assert sum(entry["train"]["pixels"]) == entry["train"]["n"] * SIDE * SIDE
    assert entry["val"]["pixels"][1] == int(sites[0].val.y.sum())
    # a run started by an earlier fednorm recorded each mask's first pixel as its label: same data, so a resume goes
    # on and the file gets the pixel counts; other data are still refused
    earlier = partition_record(sites)
    for site in earlier:
        for split in ("train", "val", "test"):
            counts = site[split].pop("pixels")
            site[split]["labels"] = [8 if split == "train" else 4 if split == "test" else 2] if counts else []
    (tmp_path / PARTITIONS_FILE).write_text(json.dumps(earlier))
    check_partitions(tmp_path, sites)
    assert json.loads((tmp_path / PARTITIONS_FILE).read_text()) == partition_record(sites)
    earlier[1]["test"]["sha256"] = "0" * 64
    (tmp_path / PARTITIONS_FILE).write_text(json.dumps(earlier))
    with pytest.raises(RunError, match="'site1' no longer holds the same test data") as refused:
        check_partitions(tmp_path, sites)
    assert "data protocol changed" in str(refused.value) and "drawn again" not in str(refused.value)


def test_a_segmentation_run_whose_partitions_json_describes_flower_placeholders_of_an_earlier_fednorm_resumes(tmp_path):
    # a Flower run started before its nodes reported records wrote the server's placeholder clients (zeros), and an
    # earlier fednorm recorded a mask's first pixel as its label: the nodes' records (pixels) replace them
    from dataclasses import replace

    from fednorm.data.medical import SegmentationSplit
    from fednorm.runs.runner import PARTITIONS_FILE, check_partitions, partition_record

    from ..engines.test_segmentation_engine import clients

    sites = clients(2)
    zeros = [replace(c, **{split: SegmentationSplit(torch.zeros_like(getattr(c, split).x),
                                                    torch.zeros_like(getattr(c, split).y))
                           for split in ("train", "val", "test")}) for c in sites]
    earlier = partition_record(zeros)
    for site in earlier:
        for split in ("train", "val", "test"):
            site[split]["labels"] = [site[split]["n"]]
            del site[split]["pixels"]
    (tmp_path / PARTITIONS_FILE).write_text(json.dumps(earlier))
    on_server = [replace(z, meta={**z.meta, "partition_record": r}) for z, r in zip(zeros, partition_record(sites))]
    check_partitions(tmp_path, on_server)
    assert json.loads((tmp_path / PARTITIONS_FILE).read_text()) == partition_record(sites)


def test_a_resume_checks_the_data_not_the_class_counts_the_record_derives_from_them(tmp_path):
    """A record without counts (a node started with share-labels=false) describes the same data: a resume goes on."""
    from fednorm.runs.runner import PARTITIONS_FILE, check_partitions, partition_record, without_class_counts

    from ..engines.test_segmentation_engine import clients

    sites = clients(2)
    (tmp_path / PARTITIONS_FILE).write_text(json.dumps([without_class_counts(e) for e in partition_record(sites)]))
    check_partitions(tmp_path, sites)
    assert json.loads((tmp_path / PARTITIONS_FILE).read_text()) == partition_record(sites)
    changed = partition_record(sites)
    changed[0]["train"]["n"] += 1
    (tmp_path / PARTITIONS_FILE).write_text(json.dumps(changed))
    with pytest.raises(RunError, match="'site0' no longer holds the same train data"):
        check_partitions(tmp_path, sites)


def test_a_diverged_cell_stops_the_run_or_is_recorded_and_the_grid_goes_on(tmp_path):
    from fednorm.methods.aggregation import DivergenceError
    from fednorm.runs.report import DIVERGED

    methods = "methods=[{name: fedavg, label: fedavg-lr1e9, lr: 1.0e9}, fedbn]"
    # default: stop, naming the cell and round, with the advice and the way on
    with pytest.raises(DivergenceError, match=r"fedavg-lr1e9 seed 0 diverged in round \d.*lower the learning rate.*"
                                              r"--on-divergence record"):
        start_run(tiny_config(methods), tmp_path / "stop")
    assert not (tmp_path / "stop" / "fedbn" / "seed0").exists()
    # resuming with --on-divergence record marks that cell diverged and runs the next ones
    went_on = resume_run(tmp_path / "stop", on_divergence="record")
    assert "diverged" in went_on[0].summary and went_on[1].summary["rounds"] == 4
    assert load_run_config(tmp_path / "stop").federation.on_divergence == "record"

    results = start_run(tiny_config(methods, "federation.on_divergence=record"), tmp_path / "run")
    bad, good = results
    at = bad.summary["diverged"]["round"]
    assert 1 <= at < 4 and "nan" in bad.summary["diverged"]["reason"].lower()
    # the cell stopped at the round that failed and was evaluated there with the server's last finite model
    records = store.read_metrics(tmp_path / "run" / "fedavg-lr1e9" / "seed0" / "metrics.jsonl")
    assert max((r["round"] for r in records if r["split"] == "train"), default=0) == at - 1
    final = [r for r in records if r["split"] == "test" and r["round"] == at]
    assert len(final) == 2 and all(r["diverged"] for r in final)
    assert [c["test"]["final_acc"] for c in bad.summary["clients"]] == [r["acc"] for r in final]
    # the next cell ran to the end, and the table marks the diverged method with a footnote
    assert "diverged" not in good.summary and good.summary["rounds"] == 4
    text = (tmp_path / "run" / "results.md").read_text()
    assert f"| fedavg-lr1e9{DIVERGED} |" in text
    assert f"fedavg-lr1e9 seed 0 in round {at}" in text and "the server's model before that round" in text
    # a resume keeps the recorded outcome instead of retraining into the same NaN
    assert resume_run(tmp_path / "run")[0].summary["diverged"] == bad.summary["diverged"]


def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    """NFS without lockd answers flock with ENOLCK: that is not 'another process holds it'."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="cannot lock the run folder"):
        [result] = start_run(tiny_config("methods=[fedbn]", "federation.rounds=1"), tmp_path / "run")
    assert result.summary["rounds"] == 1


def test_run_files_are_readable_as_any_file_written_here(tmp_path):
    """Atomic writes go through mkstemp (mode 0600): the files get the umask's mode, as results.md does."""
    start_run(tiny_config("methods=[fedbn]", "federation.rounds=1"), tmp_path / "run")
    mask = store._UMASK
    assert (tmp_path / "run" / "results.md").stat().st_mode & 0o777 == 0o666 & ~mask
    for name in ("config.yaml", "run.json", "fedbn/seed0/summary.json", "fedbn/seed0/metrics.jsonl",
                 "fedbn/seed0/checkpoint.pt"):
        assert (tmp_path / "run" / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_a_checkpoint_of_another_model_is_named_on_resume(tmp_path):
    cfg = tiny_config("methods=[fedbn]")
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "run", progress=stop_after(2))
    text = (tmp_path / "run" / "config.yaml").read_text()
    (tmp_path / "run" / "config.yaml").write_text(text.replace("width: 0.125", "width: 0.25"))
    # a run written before run.json recorded its config's fingerprint: the edit reaches the checkpoint's check
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    del info["config_fingerprint"]
    (tmp_path / "run" / "run.json").write_text(json.dumps(info))
    with pytest.raises(RunError, match=r"fedbn/seed0/checkpoint.pt does not fit the model .* delete the checkpoint"):
        resume_run(tmp_path / "run")


def test_a_setting_a_later_fednorm_added_and_an_extension_cut_off_by_a_kill_are_no_edits(tmp_path, monkeypatch):
    """The fingerprint guard must not refuse a run nobody edited: a setting a later version added (its default
    filled in on loading) or no longer fingerprints, or `--rounds` killed between writing config.yaml and run.json."""
    from fednorm.runs import runner

    run = tmp_path / "run"
    start_run(tiny_config("methods=[fedavg]", "federation.rounds=2"), run)
    info = json.loads((run / "run.json").read_text())
    del info["config_fingerprint"]["federation.keep_selected_model"]  # as if started before that setting existed
    # recorded by a fednorm that still counted it a training setting (before edits of it were allowed)
    info["config_fingerprint"]["federation.reuse_freed_memory"] = "0123456789abcdef"
    (run / "run.json").write_text(json.dumps(info))
    assert resume_run(run, rounds=3)[0].summary["rounds"] == 3
    real_write_json, real_write_text = store.write_json, store.write_text
    for cut in ("before config.yaml", "after config.yaml"):
        def write_text(path, text, cut=cut):
            if cut == "before config.yaml":
                raise KeyboardInterrupt  # killed before config.yaml was replaced
            real_write_text(path, text)

        def write_json(path, data, cut=cut):
            if cut == "after config.yaml" and "config_fingerprint_before" not in data:
                raise KeyboardInterrupt  # killed after config.yaml, before run.json dropped the old fingerprint
            real_write_json(path, data)

        rounds_before = load_run_config(run).federation.rounds
        monkeypatch.setattr(runner.store, "write_text", write_text)
        monkeypatch.setattr(runner.store, "write_json", write_json)
        with pytest.raises(KeyboardInterrupt):
            resume_run(run, rounds=rounds_before + 1)
        monkeypatch.undo()
        on_disk = load_run_config(run).federation.rounds
        assert on_disk == (rounds_before if cut == "before config.yaml" else rounds_before + 1)
        # a plain resume goes on with the config on disk, and the extension can be given again
        assert resume_run(run)[0].summary["rounds"] == on_disk
        assert resume_run(run, rounds=on_disk + 1)[0].summary["rounds"] == on_disk + 1
        assert "config_fingerprint_before" not in json.loads((run / "run.json").read_text())


def test_a_method_field_a_later_fednorm_added_keeps_the_fingerprint_of_runs_begun_before_it():
    """run.json of runs begun before `amplitude_init` existed holds the methods' fingerprint without it: for methods
    without AmpNorm the field stays unset and out of the fingerprint, so those runs (every FBN run) resume; setting
    it is an edit like any other. (AmpNorm methods: tests/runs/test_harmofl_run.py.)"""
    from fednorm.runs.config import ExperimentConfig, MethodConfig
    from fednorm.runs.runner import config_fingerprint

    methods = [MethodConfig(name="fbn"), MethodConfig(name="fedbn", label="x", prox_mu=0.01)]
    assert config_fingerprint(ExperimentConfig(methods=methods))["methods"] == "cc3d865cff9e2d5f"  # fednorm 6f4ff6c
    ampnorm = [MethodConfig(name="fedavg_ampnorm", amplitude_init=init) for init in (None, "zero", "first_batch")]
    assert ampnorm[0] == ampnorm[1]  # the default is filled in, so config.yaml records it
    assert len({config_fingerprint(ExperimentConfig(methods=[m]))["methods"] for m in ampnorm}) == 2


def test_a_config_edited_by_hand_is_refused_on_resume_naming_the_settings_and_the_way_on(tmp_path):
    """A run's checkpoints were trained with its config: going on with an edited learning rate would give a curve
    of neither config. The texts of the preset and where the run runs may change; every setting training uses not."""
    import yaml

    from fednorm.runs.runner import config_fingerprint

    run = tmp_path / "run"
    with pytest.raises(Stop):
        start_run(tiny_config("methods=[fedbn]"), run, progress=stop_after(2))
    original = (run / "config.yaml").read_text()
    saved = yaml.safe_load(original)
    assert json.loads((run / "run.json").read_text())["config_fingerprint"] == config_fingerprint(load_run_config(run))
    edited = saved | {"training": saved["training"] | {"lr": saved["training"]["lr"] * 10},
                      "seeds": [0, 1], "description": "renamed"}
    (run / "config.yaml").write_text(yaml.safe_dump(edited))
    lr = saved["training"]["lr"]
    with pytest.raises(RunError, match=rf"config.yaml was edited since the run wrote it: seeds \(was \[0\], now "
                                       rf"\[0, 1\]\), training.lr \(was {lr}, now {lr * 10}\) differ"
                                       r".*fednorm run .*run/config.yaml --out NEW_DIR") as err:
        resume_run(run)
    assert "description" not in str(err.value).split("differ")[0]
    assert torch.load(run / "fedbn" / "seed0" / "checkpoint.pt", weights_only=False)["round"] == 2  # kept as it was
    # the advice works: a new run from the edited config trains with the new learning rate
    fresh = start_run(load_config(str(run / "config.yaml")), tmp_path / "new")
    assert [(r.seed, r.summary["rounds"]) for r in fresh] == [(0, 4), (1, 4)]
    assert load_run_config(tmp_path / "new").training.lr == edited["training"]["lr"]
    # a new description, the device the run trains on and where its memory comes from are no training settings:
    # the resume goes on
    (run / "config.yaml").write_text(yaml.safe_dump(
        saved | {"description": "renamed", "federation": saved["federation"] | {
            "device": "cpu", "reuse_freed_memory": not saved["federation"]["reuse_freed_memory"]}}))
    [result] = resume_run(run)
    assert result.summary["rounds"] == 4


@pytest.mark.parametrize("overrides, message", [
    (["methods=[fedavg, {name: fedavg_gn, freeze_bn_stats_at: 0.5}]"], "fedavg_gn' freezes BatchNorm statistics"),
    (["model.name=resnet18", "model.width=0.5"], "model 'resnet18' has no option 'width'"),
    (["model.name=densenet121"], "Output size is too small"),  # 28 x 28 digits through DenseNet-121's pools
])
def test_a_method_that_cannot_run_fails_before_the_run_folder_is_written(tmp_path, overrides, message):
    """Found when its cell starts, such an error would leave a folder whose frozen config no resume gets past."""
    from fednorm.runs.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        start_run(tiny_config(*overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_finite_weights_with_non_finite_outputs_are_a_divergence_not_a_result(tmp_path):
    """lr 1e3: the round-2 weights are finite but the model's logits overflow: its 'accuracy' (argmax of NaN)
    must not be recorded as a result, whatever on_divergence is."""
    from fednorm.methods.aggregation import DivergenceError

    methods = "methods=[{name: fedavg, label: fedavg-lr1e3, lr: 1.0e3}]"
    with pytest.raises(DivergenceError, match="round 2: the global model's test loss on rendered/print is nan"):
        start_run(tiny_config(methods, "federation.rounds=2", "federation.eval_every=1"), tmp_path / "stop")
    [bad] = start_run(tiny_config(methods, "federation.rounds=2", "federation.eval_every=1", "federation.on_divergence=record"),
                      tmp_path / "run")
    assert bad.summary["diverged"]["round"] == 2 and "outputs are not finite" in bad.summary["diverged"]["reason"]
    records = store.read_metrics(tmp_path / "run" / "fedavg-lr1e3" / "seed0" / "metrics.jsonl")
    assert all(r["round"] < 2 for r in records if r["split"] == "test")  # nothing of the NaN evaluation kept
    assert all(math.isfinite(r["loss"]) for r in records)
    finals = [c["test"]["final_acc"] for c in bad.summary["clients"]]
    assert finals == [r["acc"] for r in records if r["split"] == "test" and r["round"] == 1]
    # diverging at its first evaluation, a cell keeps that evaluation, marked diverged, and the table its row
    [first] = start_run(tiny_config(methods, "federation.rounds=2", "federation.on_divergence=record"),
                        tmp_path / "first")
    records = store.read_metrics(tmp_path / "first" / "fedavg-lr1e3" / "seed0" / "metrics.jsonl")
    assert {r["round"] for r in records if r["split"] == "test"} == {2}
    assert all(r["diverged"] for r in records if r["split"] == "test")
    assert "| fedavg-lr1e3‡ | 1 |" in (tmp_path / "first" / "results.md").read_text()


@pytest.mark.parametrize("setting, precision, expected", [("auto", "fp32", False), ("auto", "bf16", True),
                                                          ("true", "fp32", True)])
def test_channels_last_setting_reaches_the_engine(setting, precision, expected):
    from fednorm.runs.runner import build_engine, build_federation_data

    config = tiny_config(f"federation.channels_last={setting}", f"training.precision={precision}")
    assert tiny_config().federation.channels_last == "auto"  # the default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # bf16 without native support warns; only built here
        engine = build_engine(config, config.methods[0], 0, build_federation_data(config, None))
    assert engine.federation.channels_last is expected


def test_run_info_records_the_resolved_precision_and_layout(tmp_path):
    # config.yaml keeps `auto`; run.json says what it became on this machine
    start_run(tiny_config("federation.rounds=1", "methods=[fedavg]", "training.precision=fp32"), tmp_path / "a")
    info = json.loads((tmp_path / "a" / "run.json").read_text())
    assert info["precision"] == "fp32" and info["channels_last"] is False
    start_run(tiny_config("federation.rounds=1", "methods=[fedavg]", "federation.channels_last=true"), tmp_path / "b")
    assert json.loads((tmp_path / "b" / "run.json").read_text())["channels_last"] is True


def _rounding_warnings(record):
    return [str(w.message) for w in record if "float rounding" in str(w.message)]


def test_run_json_records_where_each_session_trained_which_cells_and_warns_when_a_resume_trains_elsewhere(tmp_path):
    # bit-equal resumes need the same CPU kernels and thread count: run.json says which session trained what, where
    cfg = tiny_config()
    run = tmp_path / "run"
    with pytest.raises(Stop):
        start_run(cfg, run, progress=stop_after(2))
    first = json.loads((run / "run.json").read_text())["sessions"]
    assert len(first) == 1 and first[0]["cells"] == {"fedavg/seed0": 0, "fedbn/seed0": 0}
    assert first[0]["torch_threads"] == torch.get_num_threads() and first[0]["engine"] == "in-process"
    assert first[0]["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and first[0]["device"] == "cpu"
    with warnings.catch_warnings(record=True) as same:
        warnings.simplefilter("always")
        with pytest.raises(Stop):
            resume_run(run, progress=stop_after(3))
    assert _rounding_warnings(same) == []
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        with warnings.catch_warnings(record=True) as other:
            warnings.simplefilter("always")
            resume_run(run)
    finally:
        torch.set_num_threads(threads)
    [message] = _rounding_warnings(other)
    assert f"torch_threads {threads} -> {threads + 1}" in message and "fedbn/seed0" in message
    assert "fedavg" not in message  # finished before: nothing of it trains again
    sessions = json.loads((run / "run.json").read_text())["sessions"]
    assert [s["cells"] for s in sessions] == [{"fedavg/seed0": 0, "fedbn/seed0": 0}, {"fedbn/seed0": 2},
                                             {"fedbn/seed0": 3}]
    assert [s["torch_threads"] for s in sessions] == [threads, threads, threads + 1]
    resume_run(run)  # finished: nothing trains, no session
    assert len(json.loads((run / "run.json").read_text())["sessions"]) == 3


def test_a_run_begun_before_sessions_were_recorded_is_compared_with_its_start(tmp_path):
    cfg = tiny_config()
    run = tmp_path / "run"
    with pytest.raises(Stop):
        start_run(cfg, run, progress=stop_after(2))
    info = json.loads((run / "run.json").read_text())
    del info["sessions"]
    (run / "run.json").write_text(json.dumps(info | {"cpu_capability": "AVX2"}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resume_run(run)
    [message] = _rounding_warnings(record)
    assert f"cpu_capability AVX2 -> {torch.backends.cpu.get_cpu_capability()}" in message
    assert "torch_threads" not in message  # the start did not record its threads
    assert json.loads((run / "run.json").read_text())["sessions"][0]["cells"] == {"fedbn/seed0": 2}


def test_a_damaged_config_or_checkpoint_is_named_not_replaced_by_defaults(tmp_path):
    from fednorm.runs.store import CorruptFileError

    cfg = tiny_config("methods=[fedavg]", "federation.rounds=1")
    start_run(cfg, tmp_path / "run")
    config_path = tmp_path / "run" / "config.yaml"
    good = config_path.read_text()
    config_path.write_text("")  # as a kill during a non-atomic write would leave it
    with pytest.raises(CorruptFileError, match="config.yaml is empty"):
        resume_run(tmp_path / "run")
    config_path.write_text("federation: {rounds: [")
    with pytest.raises(CorruptFileError, match="not valid YAML"):
        resume_run(tmp_path / "run")
    config_path.write_text(good)
    (tmp_path / "run" / "fedavg" / "seed0" / "checkpoint.pt").write_bytes(b"cut off")
    with pytest.raises(CorruptFileError, match="checkpoint.*unreadable.*delete it"):
        resume_run(tmp_path / "run", rounds=2)


def test_the_configured_input_normalization_reaches_the_engine():
    from fednorm.runs.runner import build_engine, build_federation_data

    config = tiny_config("data.input_norm=unit")
    engine = build_engine(config, config.methods[0], 0, build_federation_data(config, None))
    x = engine.clients[0].train.x[:3]
    torch.testing.assert_close(engine.prepare(x), x.float() / 255)


def test_center_crop_is_in_the_input_pipeline_every_path_goes_through():
    """data.center_crop: the engine's prepare cuts every larger batch (training, evaluation, diagnostics) to its
    centre and passes a batch already of that size (flamby_isic's random crops) as it is; the model is built for
    the cropped size; configs that cannot run are refused when loaded."""
    from fednorm.data.domain import Standardize
    from fednorm.runs.runner import build_engine, build_federation_data

    config = tiny_config("data.center_crop=20", "model.name=resnet20", "model.width=1")
    engine = build_engine(config, config.methods[0], 0, build_federation_data(config, None))
    x = engine.clients[0].test.x[:3]
    torch.testing.assert_close(engine.prepare(x), (x[..., 4:24, 4:24].float() / 255 - 0.5) / 0.5)
    assert config.input_size() == 20 and tiny_config().input_size() == 28
    crop = Standardize(crop=200)
    big = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    assert torch.equal(crop.center_crop(big), big[..., 12:212, 12:212])  # (224 - 200) // 2
    assert torch.equal(crop.center_crop(big[..., :200, :200]), big[..., :200, :200])
    with pytest.raises(ValueError, match="larger than the 20 x 20"):
        crop.center_crop(big[..., :20, :20])
    with pytest.raises(Exception, match="set data.center_crop: 200"):
        tiny_config("training.augment=flamby_isic")
    with pytest.raises(Exception, match="at least 216 pixels"):
        tiny_config("training.augment=flamby_isic", "data.center_crop=200")
    with pytest.raises(Exception, match="center_crop 40 is larger"):
        tiny_config("data.center_crop=40")
    with pytest.raises(Exception, match="digit_cnn takes 28 x 28"):
        tiny_config("data.center_crop=20")  # the default model: built for the cropped size, refused


def test_a_cell_whose_plots_fail_is_not_finished_and_a_resume_finishes_it(tmp_path, monkeypatch):
    """The summary marks a cell finished and is written after its plots: a failure in between (a broken plotting
    library, an interrupt) leaves the cell for a resume, which plots and summarizes it from its last checkpoint
    without training again."""
    import fednorm.runs.plots as plots

    original = plots.plot_cell

    def broken(records, cell):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(plots, "plot_cell", broken)
    config = tiny_config("methods=[fedavg]", "federation.rounds=2")
    with pytest.raises(RuntimeError, match="plotting failed"):
        start_run(config, tmp_path / "run")
    cell = tmp_path / "run" / "fedavg" / "seed0"
    assert not (cell / store.SUMMARY_FILE).exists() and (cell / store.CHECKPOINT_FILE).exists()
    metrics = store.read_metrics(cell / store.METRICS_FILE)
    monkeypatch.setattr(plots, "plot_cell", original)
    resume_run(tmp_path / "run")
    assert (cell / store.SUMMARY_FILE).exists() and (cell / "accuracy.png").exists()
    assert store.read_metrics(cell / store.METRICS_FILE) == metrics  # no round trained twice


def test_unifed_ablation_settings_are_unifeds_whatever_the_runs_external_convention():
    """A run evaluated with external.convention pytorch and predict after_pass: Fig. 6's rows still re-estimate
    batch by batch in the history convention and predict online, so momentum 0 is "each batch with its own
    statistics" (in the pytorch convention it would freeze the first batch's); the global row keeps the run's."""
    from fednorm.methods.external import ABLATION_MOMENTA, ABLATION_ORDERS, ABLATION_TEST_BATCH_SIZES, ExternalBN
    from fednorm.runs.unifed_ablation import ablation_settings

    run = ExternalBN(batch_size=64, momentum=0.1, convention="pytorch", reset=False, predict="after_pass",
                     shuffle_seed=3)
    settings = ablation_settings(run)
    assert [name for name, _, _ in settings] == (
        ["global", "fedbn_average (App. G)", "bn_average (averaged statistics)"]
        + [f"batch {b}" for b in ABLATION_TEST_BATCH_SIZES]
        + [f"momentum {m}" for m in ABLATION_MOMENTA] + [f"order {k}" for k in ABLATION_ORDERS])
    assert settings[0] == ("global", "global", run) and settings[1][2] is None and settings[2][1:] == ("bn_average", None)
    for name, mode, bn in settings[3:]:
        assert mode == "test_time_bn" and (bn.convention, bn.reset, bn.predict) == ("history", True, "online")
        assert bn.unbiased is False  # the run's variance estimator
        assert name.startswith("order") or bn.shuffle_seed == 3  # (a) and (b) keep the run's batch order
    one_batch = [bn for name, _, bn in settings if name.startswith("batch")]
    assert [bn.batch_size for bn in one_batch] == list(ABLATION_TEST_BATCH_SIZES)
    assert all(bn.history_weight == 0.0 for bn in one_batch)  # no tracked statistics carried between batches
    momenta = [bn for name, _, bn in settings if name.startswith("momentum")]
    assert [bn.history_weight for bn in momenta] == list(ABLATION_MOMENTA)
    assert all(bn.batch_size == 32 for bn in momenta)
    # Fig. 6(c): UniFed's default point (batch 32, tau 0.9) under each seeded sample order instead of the run's
    orders = [(name, bn) for name, _, bn in settings if name.startswith("order")]
    assert [name for name, _ in orders] == [f"order {k}" for k in ABLATION_ORDERS]
    assert [bn.shuffle_seed for _, bn in orders] == list(ABLATION_ORDERS)
    assert all((bn.batch_size, bn.history_weight) == (32, 0.9) for _, bn in orders)


def test_ties_choose_the_earliest_round_for_a_client_and_for_the_mean():
    """best_round of a client and the best-mean round (report --best, model selection) take the earliest of
    equal scores: a later round that only equals the best is not a better model."""
    from types import SimpleNamespace

    from fednorm.runs.runner import best_mean_round, summarize_cell

    def rec(rnd, client, acc, split="test"):
        return {"round": rnd, "client": client, "split": split, "acc": acc, "loss": 0.0, "n": 10}

    # the mean is 0.7 in both rounds; client a is 0.8 in both
    records = [rec(1, "a", 0.8), rec(1, "b", 0.6), rec(2, "a", 0.8), rec(2, "b", 0.6),
               rec(1, "a", 0.5, "val"), rec(1, "b", 0.7, "val"), rec(2, "a", 0.7, "val"), rec(2, "b", 0.5, "val")]
    assert best_mean_round(records, "test") == 1 and best_mean_round(records, "val") == 1
    clients = [SimpleNamespace(name=n, domain=n, origin="real", num_train=10, meta={}) for n in "ab"]
    test = {c["name"]: c["test"] for c in summarize_cell(records, clients, "fedbn", 0, 2)["clients"]}
    assert test["a"]["best_round"] == 1 and test["a"]["best_mean_round"] == 1 and test["a"]["selected_round"] == 1


def test_a_client_whose_labels_changed_is_refused_on_resume_even_with_the_same_counts(tmp_path):
    """partitions.json's sha256 covers the labels, not only the images: a relabelled client (same images, same
    class counts, labels permuted) does not resume silently on other data."""
    from fednorm.runs.runner import build_federation_data, check_partitions

    config = tiny_config()
    clients = build_federation_data(config, None)
    (tmp_path / "run").mkdir()
    check_partitions(tmp_path / "run", clients)
    first = clients[0]
    y = first.train.y.clone()
    moved = torch.roll(y, 1)
    assert not torch.equal(moved, y) and torch.equal(torch.bincount(moved), torch.bincount(y))  # same counts
    first.train.y.copy_(moved)
    with pytest.raises(RunError, match=f"client {first.name!r} no longer holds the same train data") as refused:
        check_partitions(tmp_path / "run", clients)
    # a rendered client is drawn again on resume: the advice says so, and what may have changed
    assert first.origin == "rendered" and "drawn again on resume" in str(refused.value)


def test_an_existing_runs_data_folder_is_the_option_then_the_config_then_the_recorded_then_the_environment(
        tmp_path, monkeypatch):
    """``fednorm resume / rescore --data-dir`` wins; else config.yaml's data.data_dir; else the folder the run
    recorded in run.json when it started; else FEDNORM_DATA (then the cache)."""
    from fednorm.runs.runner import RUN_INFO_FILE, run_data_dir

    monkeypatch.setenv("FEDNORM_DATA", str(tmp_path / "env"))
    files = tiny_config("data.domains=[mnist, rendered/street]")
    run = tmp_path / "run"
    run.mkdir()
    assert run_data_dir(run, files) == tmp_path / "env"  # nothing recorded: the environment
    (run / RUN_INFO_FILE).write_text(json.dumps({"data_dir": str(tmp_path / "recorded")}))
    assert run_data_dir(run, files) == tmp_path / "recorded"
    configured = tiny_config("data.domains=[mnist, rendered/street]", f"data.data_dir={tmp_path / 'config'}")
    assert run_data_dir(run, configured) == tmp_path / "config"
    assert run_data_dir(run, configured, str(tmp_path / "option")) == tmp_path / "option"
    assert run_data_dir(run, tiny_config(), str(tmp_path / "option")) is None  # rendered domains read no files


def test_a_resume_may_change_where_a_run_runs_and_its_texts_but_not_a_training_setting():
    """config.yaml edits a resume accepts: the fingerprint leaves them out. channels_last changes the float rounding
    of convolutions (a curve resumed in the other layout is of neither), so it stays a training setting."""
    from fednorm.runs.runner import config_fingerprint

    base = config_fingerprint(tiny_config())
    for allowed in ["data.data_dir=/elsewhere", "federation.device=cpu", "federation.on_divergence=record",
                    "federation.reuse_freed_memory=false", "name=renamed", "description=other",
                    "paper={fedavg: {Avg: 1.0}}"]:
        assert config_fingerprint(tiny_config(allowed)) == base, allowed
    for training in ["federation.channels_last=true", "training.precision=bf16", "training.lr=0.5", "seeds=[3]"]:
        changed = config_fingerprint(tiny_config(training))
        assert {k for k in base if changed[k] != base[k]} == {training.split("=")[0]}, training


def test_only_the_federations_clients_can_diverge_an_external_client_is_scored_not_trained():
    from types import SimpleNamespace

    from fednorm.runs.runner import DivergenceError, check_evaluations

    def ev(client, loss):
        return SimpleNamespace(client=client, split="test", loss=loss)

    check_evaluations([ev("a", 0.5), ev("x", math.nan), ev("x", math.inf)], external_names={"x"})
    with pytest.raises(DivergenceError, match=r"test loss on b is nan .*; 1 more client evaluations too"):
        check_evaluations([ev("a", 0.5), ev("b", math.nan), ev("x", math.nan), ev("a", math.inf)], {"x"})


def test_model_projection_dim_gives_every_cell_moons_head_and_moon_contrasts_its_output(tmp_path):
    """``model.projection_dim`` builds MOON's projection head into the run's model, for MOON and for the baseline
    beside it (the same network, as MOON's code compares); the head's weights are shared and aggregated, and
    MOON's z is the projection output (projection_dim values per sample)."""
    from fednorm.methods.client_algorithms import representation_module
    from fednorm.runs.runner import build_engine, build_federation_data

    cfg = tiny_config("methods=[moon, fedavg]", "model.projection_dim=8", "federation.rounds=1",
                      "federation.eval_every=1")
    clients = build_federation_data(cfg, None)
    for method in cfg.methods:
        engine = build_engine(cfg, method, 0, clients)
        head = engine.model.classifier[-1]
        assert (head.project2.out_features, head.output.in_features) == (8, 8)
        assert {"classifier.6.project1.weight", "classifier.6.output.weight"} <= set(engine.shared_params)
        before = {k: v.clone() for k, v in engine.global_state.items()}
        engine.run_round()
        assert not torch.equal(engine.global_state["classifier.6.project2.weight"], before["classifier.6.project2.weight"])
        name, _ = representation_module(engine.model)
        assert name == "classifier.6.output"
    with pytest.raises(Exception, match="U-Net ends in a 1 x 1 convolution"):
        load_config("default", ["model.name=unet", "model.projection_dim=8"])


def test_damaged_or_missing_run_files_are_named_with_the_way_on(tmp_path):
    """run.json, partitions.json or summary.json damaged, config.yaml or run.json missing: each is named with what
    to do, a damaged summary is written again by the resume, and nothing trained is lost."""
    import shutil

    from fednorm.runs.report import read_cells

    cfg = tiny_config("methods=[fedbn]", "federation.checkpoint_every=1")
    start_run(cfg, tmp_path / "done")
    with pytest.raises(Stop):
        start_run(cfg, tmp_path / "stopped", progress=stop_after(2))
    copy = lambda name, src="stopped": shutil.copytree(tmp_path / src, tmp_path / name)  # noqa: E731
    for name, file in (("info", "run.json"), ("parts", "partitions.json")):
        copy(name)
        (tmp_path / name / file).write_text('{"run_id": ')
        with pytest.raises(store.CorruptFileError, match=rf"{name}/{file} is damaged \(not JSON: .*\); it records .*"
                                                         "restore it .* or delete it to resume without"):
            resume_run(tmp_path / name)
    # a damaged summary of a finished cell: kept aside, written again from the checkpoint at its last round
    copy("summary", "done")
    cell = tmp_path / "summary" / "fedbn" / "seed0"
    good = (cell / "summary.json").read_text()
    (cell / "summary.json").write_text('{"method": ')
    with pytest.warns(UserWarning, match=r"summary.json was damaged \(kept as summary.damaged-1.json\): the resume "
                                         "writes the cell's summary again$"):
        resume_run(tmp_path / "summary")
    assert json.loads((cell / "summary.json").read_text()) == json.loads(good)
    assert (cell / "summary.damaged-1.json").read_text() == '{"method": '
    assert len(read_cells(tmp_path / "summary")) == 1
    # config.yaml gone from a run folder: not "not a run folder"
    copy("noconfig")
    (tmp_path / "noconfig" / "config.yaml").unlink()
    with pytest.raises(store.CorruptFileError, match=r"config.yaml is missing, but .*noconfig is a run folder \(it "
                                                     r"has run.json, partitions.json, fedbn/seed0/metrics.jsonl\)"):
        resume_run(tmp_path / "noconfig")
    # run.json gone: the resume says what it cannot check, records the fingerprint again, and then catches an edit
    copy("noinfo")
    (tmp_path / "noinfo" / "run.json").unlink()
    with pytest.warns(UserWarning, match=r"checkpoints but no run.json: config.yaml cannot be checked"):
        resume_run(tmp_path / "noinfo")
    assert (tmp_path / "noinfo" / "fedbn" / "seed0" / "metrics.jsonl").read_text() == \
        (tmp_path / "done" / "fedbn" / "seed0" / "metrics.jsonl").read_text()
    text = (tmp_path / "noinfo" / "config.yaml").read_text()
    (tmp_path / "noinfo" / "config.yaml").write_text(text.replace("lr: 0.01", "lr: 0.05"))
    with pytest.raises(RunError, match="was edited since the run wrote it"):
        resume_run(tmp_path / "noinfo", rounds=6)


def test_run_json_records_the_data_folder_as_an_absolute_path(tmp_path, monkeypatch):
    from fednorm.runs.runner import _write_run_info

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    _write_run_info(tmp_path / "run", "data", tiny_config(), "in-process")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["data_dir"] == str(tmp_path / "data")


def test_a_config_chooses_the_dirichlet_form_of_its_label_skew():
    """data.dirichlet_form reaches the partition: per_client (Hsu et al., the FBN paper's citation) gives clients of
    equal size, per_class (the default, the FBN authors' byzfl library) clients of the sizes their draws give."""
    from fednorm.runs.runner import build_federation_data

    sizes = {}
    for form in ("per_class", "per_client"):
        cfg = tiny_config("data.domains=[rendered/print]", "data.pool_size=200", "data.partition=dirichlet",
                          "data.alpha=0.3", "data.num_clients=4", f"data.dirichlet_form={form}")
        sizes[form] = [c.num_train for c in build_federation_data(cfg, None)]
    assert sizes["per_client"] == [50] * 4
    assert len(set(sizes["per_class"])) > 1 and sum(sizes["per_class"]) == 200
