"""``extends:`` in config files and presets: a config starts from another and lays its own keys over it
(sections merged key by key, lists and values replaced whole), as the UniFed CIFAR-10-C presets do."""

from __future__ import annotations

import pytest

from fednorm.runs.config import ConfigError, load_config


def test_a_file_extending_a_preset_changes_only_what_it_names(tmp_path):
    base = load_config("unifed_corrupt_internal")
    path = tmp_path / "mine.yaml"
    path.write_text("extends: unifed_corrupt_internal\nname: mine\ndata:\n  domains: [corrupt/fog/3/mnistm]\n"
                    "training:\n  lr: 0.01\n")
    cfg = load_config(path)
    assert cfg.name == "mine" and cfg.data.domains == ["corrupt/fog/3/mnistm"] and cfg.training.lr == 0.01
    # the rest of each section it touches, and every section it does not, are the preset's
    assert cfg.data.val_fraction == base.data.val_fraction and cfg.training.momentum == base.training.momentum
    assert cfg.training.batch_size == base.training.batch_size and cfg.federation == base.federation
    assert [m.display for m in cfg.methods] == [m.display for m in base.methods] and cfg.paper == base.paper
    # lists are replaced, not appended to; overrides still apply last
    assert load_config(path, ["seeds=[4]"]).seeds == [4]
    # the paper's numbers are one table: given again, they replace the extended preset's rows and clients whole
    path.write_text("extends: unifed_corrupt_internal\npaper:\n  fedavg: {corrupt/fog/3/mnistm: 50.0}\n")
    assert load_config(path).paper == {"fedavg": {"corrupt/fog/3/mnistm": 50.0}}
    # ... and with them the extended preset's source and variants go: they described the other numbers
    path.write_text("extends: fbn_cifar10\npaper:\n  fbn: {Avg: 10.0}\n")
    mine = load_config(path)
    assert mine.paper_source is None and mine.paper_variants == [] and load_config("fbn_cifar10").paper_variants
    path.write_text("extends: fbn_cifar10\nname: other\n")  # giving none keeps all three
    assert load_config(path).paper_variants == load_config("fbn_cifar10").paper_variants


def test_files_extend_files_relative_to_their_folder_and_cycles_are_named(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.yaml").write_text("extends: default\nseeds: [7]\nfederation:\n  rounds: 3\n")
    (tmp_path / "sub" / "child.yaml").write_text("extends: base.yaml\nfederation:\n  eval_every: 3\n")
    cfg = load_config(tmp_path / "sub" / "child.yaml")
    assert cfg.seeds == [7] and cfg.federation.rounds == 3 and cfg.federation.eval_every == 3
    assert cfg.data.domains == load_config("default").data.domains
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends makes a cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "bad.yaml").write_text("extends: [default]\n")
    with pytest.raises(ConfigError, match="extends must name one preset or config file"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "gone.yaml").write_text("extends: nosuchpreset\n")
    with pytest.raises(ConfigError, match="'nosuchpreset' is neither a config file nor a preset"):
        load_config(tmp_path / "gone.yaml")


def test_the_cifar10c_presets_are_the_corrupted_presets_on_the_released_files():
    """UniFed Tables II / III on their own data: the generated presets' methods, training and paper numbers, with
    the released CIFAR-10-C domains, the 0.7 / 0.1 / 0.2 split and the pretrained AlexNet at 224."""
    for name, generated in (("unifed_cifar10c_internal", "unifed_corrupt_internal"),
                            ("unifed_cifar10c_external", "unifed_corrupt_external")):
        cfg, gen = load_config(name), load_config(generated)
        assert [m.display for m in cfg.methods] == [m.display for m in gen.methods]
        assert cfg.training == gen.training and cfg.seeds == gen.seeds and cfg.paper == gen.paper
        assert cfg.data.domains == [d.replace("corrupt/", "cifar10c/").replace("/mnistm", "") for d in gen.data.domains]
        assert cfg.external.domains == [d.replace("corrupt/", "cifar10c/").replace("/mnistm", "")
                                        for d in gen.external.domains]
        assert (cfg.data.percent, cfg.data.pool_size, cfg.data.val_fraction) == (1.0, 8000, gen.data.val_fraction)
        assert (cfg.model.name, cfg.model.norm, cfg.model.classifier, cfg.model.pretrained, cfg.model.input_size) == \
            ("alexnet", "bn", "fedbn", "imagenet", 224)
    assert load_config("unifed_cifar10c_external").external.data == "all"
