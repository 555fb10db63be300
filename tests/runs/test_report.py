from fednorm.runs.report import ResultsTable, config_differences, split_label

from .test_runner import tiny_config


def test_config_differences_name_settings_not_the_cells_of_a_study():
    base = tiny_config()
    # another seed, method list or paper row is the same study: no difference
    same_study = tiny_config("seeds=[1, 2]", "methods=[fedavg]", "paper={fedbn: {mnist: 1.0}}", "name=other")
    assert config_differences(base, same_study) == []
    other = tiny_config("federation.channels_last=false", "training.lr=0.5")
    assert sorted(config_differences(base, other)) == ["federation.channels_last", "training.lr"]


def test_split_label_shows_the_key_and_value_as_set():
    assert split_label("fedbn", "federation.channels_last", tiny_config("federation.channels_last=false")) \
        == "fedbn [channels_last=false]"
    assert split_label("fedbn", "training.lr", tiny_config("training.lr=0.05")) == "fedbn [lr=0.05]"


def test_table_cells_give_mean_and_std_over_seeds_and_no_std_for_one_seed():
    table = ResultsTable(columns=["mnist"], origins={"mnist": "real"},
                         rows={"fedbn": {"mnist": [0.90, 0.94], "Avg": [0.90, 0.94]},
                               "fedavg": {"mnist": [0.80], "Avg": [0.80]}},
                         seeds={"fedbn": [0, 1], "fedavg": [0]})
    head, fedbn, fedavg = table.text_rows()
    assert head == ["Method", "seeds", "mnist", "Avg"]
    # population std of 90 and 94 is 2.00
    assert fedbn == ["fedbn", "2", "92.00 (2.00)", "92.00 (2.00)"]
    assert fedavg == ["fedavg", "1", "80.00", "80.00"]


def test_sample_std_uses_ddof_1_and_says_so_under_the_table():
    rows = {"fedbn": {"mnist": [0.90, 0.94, 0.95], "Avg": [0.90, 0.94, 0.95]}, "fedavg": {"mnist": [0.80], "Avg": [0.80]}}
    population = ResultsTable(columns=["mnist"], origins={"mnist": "real"}, rows=rows, seeds={"fedbn": [0, 1, 2], "fedavg": [0]})
    sample = ResultsTable(columns=["mnist"], origins={"mnist": "real"}, rows=rows, seeds={"fedbn": [0, 1, 2], "fedavg": [0]},
                          ddof=1)
    # 90, 94, 95: mean 93, squared deviations 9 + 1 + 4 = 14; population sqrt(14 / 3), sample sqrt(14 / 2)
    assert population.text_rows()[1][2] == f"93.00 ({(14 / 3) ** 0.5:.2f})" == "93.00 (2.16)"
    assert sample.text_rows()[1][2] == f"93.00 ({(14 / 2) ** 0.5:.2f})" == "93.00 (2.65)"
    # a single seed has no spread in either convention (not a NaN from ddof 1)
    assert sample.text_rows()[2][2] == "80.00" and sample.to_dict()["methods"]["fedavg"]["mnist"]["std"] == 0.0
    assert "sample standard deviation" in sample.footnote() and "standard deviation" not in population.footnote()
    assert sample.to_dict()["std_ddof"] == 1 and population.to_dict()["std_ddof"] == 0


def test_avg_is_over_the_internal_clients_and_an_external_client_is_a_column_of_its_own():
    """UniFed's tables: Avg over the clients that trained; an external client is reported beside it, never in it."""
    from fednorm.runs.report import build_table

    def summary(seed, a, b, ext):
        return {"method": "fedbn", "seed": seed, "clients": [
            {"name": "a", "test": {"final_acc": a}}, {"name": "b", "test": {"final_acc": b}},
            {"name": "ext", "external": True, "test": {"final_acc": ext}}]}

    table = build_table([summary(0, 0.8, 0.6, 0.1), summary(1, 0.9, 0.7, 0.3)])
    avg, avg_std, seeds = table.cell("fedbn", "Avg")
    # seed means 0.70 and 0.80 (the external 0.1 and 0.3 left out): 75.00 (5.00); with them it would be 55.00
    assert (round(avg, 6), round(avg_std, 6), seeds) == (75.0, 5.0, 2)
    assert [round(v, 6) for v in table.cell("fedbn", "ext")[:2]] == [20.0, 10.0]
    assert table.columns == ["a", "b", "ext"]


def test_avg_std_across_clients_is_harmofls_convention():
    """HarmoFL Table 2, FedAvg on Camelyon17: hospitals 91.10, 83.12, 82.06, 87.49, 74.78 give Avg 83.71 (6.16), the
    sample std across the five hospitals; with avg_std="clients" a one-seed run of those scores prints exactly that."""
    from fednorm.runs.report import build_table

    hospitals = [0.9110, 0.8312, 0.8206, 0.8749, 0.7478]
    one_seed = {"method": "fedavg", "seed": 0, "clients": [{"name": f"h{i + 1}", "test": {"final_acc": acc}}
                                                           for i, acc in enumerate(hospitals)]}
    table = build_table([one_seed], avg_std="clients")
    assert table.text_rows()[1][-1] == "83.71 (6.16)"
    assert table.to_dict()["avg_std"] == "clients" and "across those clients" in table.footnote()
    assert build_table([one_seed]).text_rows()[1][-1] == "83.71"  # over seeds: one seed, no spread

    def summary(seed, a, b, ext):
        return {"method": "fedbn", "seed": seed, "clients": [
            {"name": "a", "test": {"final_acc": a}}, {"name": "b", "test": {"final_acc": b}},
            {"name": "ext", "external": True, "test": {"final_acc": ext}}]}

    two_seeds = build_table([summary(0, 0.8, 0.6, 0.1), summary(1, 0.9, 0.7, 0.3)], avg_std="clients")
    # client means over seeds 0.85 and 0.65 (the external client left out): 75.00, sample std sqrt(2) * 10
    avg, std, seeds = two_seeds.cell("fedbn", "Avg")
    assert (round(avg, 6), round(std, 6), seeds) == (75.0, round(200 ** 0.5, 6), 2)
    assert two_seeds.cell("fedbn", "a")[:2] == build_table([summary(0, 0.8, 0.6, 0.1),
                                                             summary(1, 0.9, 0.7, 0.3)]).cell("fedbn", "a")[:2]


def test_collected_runs_name_paper_rows_that_disagree_and_cells_with_fewer_rounds_than_asked(tmp_path):
    """Two runs whose configs give other paper numbers for a method: the table shows the first run's, and says so.
    A run whose config asks for more rounds than a cell finished (an extension under way) names that cell."""
    import yaml

    from fednorm.runs.report import collect_runs
    from fednorm.runs.runner import start_run

    first, second = tmp_path / "a", tmp_path / "b"
    start_run(tiny_config("methods=[fedavg]", "federation.rounds=1", "paper={fedavg: {Avg: 50.0}}"), first)
    start_run(tiny_config("methods=[fedavg]", "seeds=[1]", "federation.rounds=1", "paper={fedavg: {Avg: 60.0}}"),
              second)
    out = collect_runs([first, second])
    assert out.paper == {"fedavg": {"Avg": 50.0}}
    assert [n for n in out.notes if "paper rows" in n] == [
        f"the paper rows of fedavg differ between the runs' configs ({second}); the table shows the first"]
    assert not any("finished fewer" in n for n in out.notes)
    # the second run's config now asks for 3 rounds (as `fednorm resume --rounds 3` writes it before training)
    saved = yaml.safe_load((second / "config.yaml").read_text())
    saved["federation"]["rounds"] = 3
    (second / "config.yaml").write_text(yaml.safe_dump(saved))
    [short] = [n for n in collect_runs([first, second]).notes if "finished fewer" in n]
    assert short == f"{second}: its config asks for 3 rounds; fedavg seed 1 (1 rounds) finished fewer " \
                    "(an extension still going?)"
