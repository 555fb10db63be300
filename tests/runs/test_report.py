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
