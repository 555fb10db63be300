import pytest

from fednorm.runs.config import ConfigError, load_config, preset_names


def test_default_preset_is_fedbn_against_fedavg_on_rendered_domains():
    cfg = load_config()
    assert [m.name for m in cfg.methods] == ["fedavg", "fedbn"]
    assert all(d.startswith("rendered/") for d in cfg.data.domains)
    assert "default" in preset_names() and "fedbn_digits" in preset_names()


def test_overrides_are_parsed_as_yaml():
    cfg = load_config("default", ["federation.rounds=3", "methods=[fedprox, {name: fedbn, prox_mu: 0.01, label: fedbn+prox}]",
                                  "training.lr=0.05"])
    assert cfg.federation.rounds == 3 and cfg.training.lr == 0.05
    assert cfg.methods[1].build().prox_mu == 0.01 and cfg.methods[1].build().policy == "local_bn"
    assert cfg.methods[0].build().prox_mu == 0.01  # FedProx preset


@pytest.mark.parametrize(
    "override, message",
    [
        ("federation.roundz=3", "federation.roundz: unknown key"),
        ("federation.rounds=0", "federation.rounds"),
        ("methods=[fedsgd]", "unknown method 'fedsgd'"),
        ("data.domains=[svhn2]", "unknown domain 'svhn2'"),
        ("model.norm=batch", "model.norm"),
        ("methods=[fedavg, fedavg]", "labels must be distinct"),
        ("rounds", "key=value"),
    ],
)
def test_bad_config_gets_an_error_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", [override])


def test_missing_config_file_and_unknown_preset(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="neither a config file nor a preset"):
        load_config("nonexistent_preset")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seeds: [0\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
