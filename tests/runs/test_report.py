from fednorm.runs.report import config_differences, split_label

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
