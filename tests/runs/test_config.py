import warnings

import pytest

from fednorm.runs.config import ConfigError, ConfigWarning, ExperimentConfig, load_config, preset_names


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
        ("federation.rounds=0", "federation.rounds: Input should be greater than or equal to 1"),
        ("methods=[fedsgd]", "unknown method 'fedsgd'"),
        ("data.domains=[svhn2]", "unknown domain 'svhn2'"),
        ("model.norm=batch", "model.norm: Input should be 'bn', 'gn', 'ln', 'in', 'none', 'ws' or 'fbn'"),
        ("methods=[fedavg, fedavg]", "labels must be distinct"),
        ("data.domains=[office_caltech10/amazon, office_caltech10/amazon@64]", "domains must be distinct"),
        ("rounds", "key=value"),
        ("methods.0.lr=0.1", "'methods' is a list, set as a whole"),
        ("seeds=[-1]", "seeds.0: Input should be greater than or equal to 0"),
        ("data.split_seed=-1", "data.split_seed: Input should be greater than or equal to 0"),
        ("federation=5", "federation: Input should be a valid dictionary"),
        # a label is the cell's folder: RUN/<label>/seed<k> must stay inside the run folder
        ("methods=[{name: fedavg, label: ../escaped}]", "methods.0.label: String should match pattern"),
        ("methods=[{name: fedavg, label: a/b}]", "methods.0.label: String should match pattern"),
        ("methods=[{name: fedavg, label: '..'}]", "names no folder of its own"),
        # options the method never reads: the row would be the plain method under another label
        ("methods=[{name: singleset, prox_mu: 10}]", "does not use prox_mu .*trains each client alone"),
        ("methods=[{name: fedavg, server: {momentum: 0.9}}]", "does not use server.momentum .*this method's is mean"),
        ("methods=[{name: fedavg, client: {moon_mu: 10}}]", "does not use client.moon_mu \\(read by moon"),
        ("methods=[{name: fedavg, prox_schedule: fedbn_code}]", "does not use prox_schedule"),
        ("methods=[{name: fedavg, agc_exclude_head: false}]", "does not use agc_exclude_head"),
        ("methods=[{name: fedavg, server: {rule: fedavgm, tau: 0.01}}]", "server.tau .*this method's is fedavgm"),
        # an external client never trained, and the global model must be able to score it
        ("external.domains=[rendered/print]", "rendered/print also train in data.domains"),
        ("external.domains=[pacs/photo]", "external.domains do not fit data.domains: .* mix image sizes"),
    ],
)
def test_bad_config_gets_an_error_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", [override])


def test_missing_config_file_and_unknown_preset(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="neither a config file nor a preset") as err:
        load_config("nonexistent_preset")
    assert "did you mean" not in str(err.value)
    with pytest.raises(ConfigError, match=r"'fbn_mnistmm' is neither .* did you mean 'fbn_mnistm'\? presets: default,"):
        load_config("fbn_mnistmm")
    with pytest.raises(ConfigError, match=r"did you mean 'fedwon_small_batch_b4' or 'fedwon_small_batch_b1' or"):
        load_config("fedwon_small_batch_b2")
    with pytest.raises(ConfigError, match=r"'FBN_mnistm' is neither .* did you mean 'fbn_mnistm'\?"):
        load_config("FBN_mnistm")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seeds: [0\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    twice = tmp_path / "twice.yaml"  # plain YAML keeps the last value silently
    twice.write_text("training: {lr: 0.1, lr: 0.001}\n")
    with pytest.raises(ConfigError, match="the key 'lr' is given twice"):
        load_config(str(twice))
    twice.write_text("federation:\n  rounds: 50\nseeds: [0]\nfederation:\n  fraction: 0.5\n")
    with pytest.raises(ConfigError, match="the key 'federation' is given twice"):
        load_config(str(twice))
    # a YAML merge key is not a repetition: the mapping's own keys override the merged ones
    merged = tmp_path / "merged.yaml"
    merged.write_text("training: {<<: {lr: 0.1, momentum: 0.5}, lr: 0.01}\n")
    cfg = load_config(str(merged))
    assert (cfg.training.lr, cfg.training.momentum) == (0.01, 0.5)


def test_fedwon_methods_and_cross_device_validate():
    cfg = load_config("default", ["methods=[fedwon, fedavg_gn, fedavg_ln, fixbn, {name: fedwon, agc_clip: 0, label: ws}]",
                                  "federation.setting=cross_device", "data.partition=even",
                                  "data.clients_per_domain=20", "data.percent=1.0"])
    built = {m.display: m.build() for m in cfg.methods}
    assert built["fedwon"].norm == "ws" and built["fedwon"].agc_clip == 0.64
    assert built["ws"].agc_clip == 0.0
    assert built["fedavg_gn"].norm == "gn" and built["fixbn"].freeze_bn_stats_at == 0.5


@pytest.mark.parametrize("overrides, message", [
    (["methods=[fedbn]", "federation.setting=cross_device"],
     r"method 'fedbn' cannot run cross-device: all BatchNorm state .* stays on each client, and cross-device clients "
     r"are stateless .* Use a stateless method \(fedavg, fedprox, .*fedwon.*\) or federation.setting: cross_silo"),
    (["methods=[scaffold]", "federation.setting=cross_device", "model.norm=gn"],
     r"'scaffold' cannot run cross-device: each client keeps its control variate c_i \(SCAFFOLD\) from one round"),
    (["methods=[fedavg]", "training.batch_size=1"], "batch_size 1"),
    (["methods=[{name: fedbn, norm: gn}]"], "keeps BatchNorm state local"),
    (["model.norm=batch"], "model.norm"),
    (["methods=[{name: fedwon, agc_clip: -1}]"], "agc_clip"),
    (["model.name=alexnet"], "at least 63"),
    (["data.clients_per_domain=20"], "partition: even"),
    (["data.domains=[pacs/photo]"], "digit_cnn takes 28"),
    (["data.domains=[mnist, pacs/photo]", "model.name=resnet18"], "mix"),
])
def test_bad_fedwon_configs_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", overrides)


@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_preset_validates_and_builds_its_methods(name):
    cfg = load_config(name)
    for m in cfg.methods:
        m.build()


def test_ws_variance_reaches_every_wsconv():
    from fednorm.models import WSConv2d

    cfg = load_config("default", ["model.ws_variance=biased", "model.width=0.125"])
    model = cfg.model.build(norm="ws")
    convs = [m for m in model.modules() if isinstance(m, WSConv2d)]
    assert len(convs) == 3 and all(c.variance == "biased" for c in convs)
    assert all(c.variance == "unbiased" for c in load_config().model.build(norm="ws").modules()
               if isinstance(c, WSConv2d))


def test_fbn_presets_validate_with_dsgd_settings_and_bad_byzantine_configs_are_refused():
    cfg = load_config("fbn_mnistm")
    assert (cfg.training.steps, cfg.training.momentum_style, cfg.training.lr_decay_every) == (1, "ema", 1000)
    assert [m.build().norm for m in cfg.methods] == ["fbn", "bn", "bn", "bn"]
    robust = load_config("fbn_robust_mnistm")
    assert robust.federation.byzantine.count == 3
    assert {m.build().server.rule for m in robust.methods} == {"mean", "median", "trimmed_mean"}
    with pytest.raises(ConfigError, match="byzantine"):
        load_config("fbn_robust_mnistm", ["federation.byzantine.attack=null"])
    with pytest.raises(ConfigError, match="rule"):
        load_config("default", ["methods=[{name: fedavg, server: {rule: fedsgd}}]"])
    with pytest.raises(ConfigError, match="training.steps"):
        load_config("default", ["methods=[centralized_bn]"])
    adam = load_config("default", ["methods=[{name: fedadam, server: {lr: 0.1}}]"]).methods[0].build()
    assert (adam.server.rule, adam.server.lr) == ("fedadam", 0.1)


def test_dsgd_pattern_means_one_step_and_a_persistent_optimizer(tmp_path):
    cfg = load_config("default", ["federation.pattern=dsgd"])
    assert cfg.training.steps == 1 and cfg.federation.persistent_optimizer
    # the server's step is Algorithm 3's (1/n) sum_i g_i unless a weighting is asked for
    # a config that names no weighting: the config's default is samples, dsgd's uniform; an explicit one is kept
    plain = tmp_path / "plain.yaml"
    plain.write_text("name: plain\nmethods: [fedavg]\n")
    assert load_config(plain).federation.weighting == "samples"
    assert load_config(plain, ["federation.pattern=dsgd"]).federation.weighting == "uniform"
    assert load_config(plain, ["federation.pattern=dsgd", "federation.weighting=samples"]).federation.weighting \
        == "samples"
    with pytest.raises(ConfigError, match="one local step"):
        load_config("default", ["federation.pattern=dsgd", "training.steps=5"])
    with pytest.raises(ConfigError, match="momentum"):
        load_config("default", ["federation.pattern=dsgd", "federation.persistent_optimizer=false"])


def test_fednova_with_a_carried_over_momentum_buffer_warns_that_its_normalization_is_approximate():
    """FedNova's a_k for momentum assumes the buffer starts each round at zero (its official code resets it)."""
    carried = ["methods=[fednova]", "federation.persistent_optimizer=true", "training.momentum=0.9"]
    with pytest.warns(ConfigWarning, match="FedNova's a_k"):
        load_config("default", carried)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("default", carried[:1] + ["training.momentum=0.9"])  # reset each round: a_k is exact
        load_config("default", carried[:2] + ["training.momentum=0"])  # plain SGD: a_k = tau, nothing carried
        load_config("default", ["methods=[fedavg]"] + carried[1:])  # FedAvg does not normalize by a_k


def test_fedwon_preset_agc_at_small_batches_warns_that_the_paper_bypasses_it():
    """FedWon App. A.3: AGC only at B = 32, bypassed at B in {1, 2, 4}; an explicit agc_clip is the user's choice."""
    head = "model.classifier=fedwon"
    with pytest.warns(ConfigWarning, match="bypasses it at small batches") as caught:
        load_config("default", ["methods=[fedavg, fedwon]", "training.batch_size=4", head])
    assert len(caught) == 1 and "'fedwon'" in str(caught[0].message) and "0.64" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("default", ["methods=[fedwon]", head])  # B = 32, the paper's
        load_config("default", ["methods=[{name: fedwon, agc_clip: 0}]", "training.batch_size=2", head])
        load_config("default", ["methods=[{name: fedwon, agc_clip: 1.28}]", "training.batch_size=2", head])  # ablation
        for preset in ("fedwon_small_batch", "fedwon_small_batch_b1", "fedwon_cross_device", "fedwon_ablation"):
            load_config(preset)


def test_norm_free_method_with_the_fedbn_head_warns_that_it_is_not_fedwons_architecture():
    """FedWon Tables 5-6: the norm-free CNN's head has Dropout before FC1 and FC2. The fedbn head (BN after FC1, FC2)
    with its BN removed has none, so a ws / none method on it warns, naming model.classifier: fedwon."""
    for methods in ("[fedavg, fedwon]", "[{name: fedavg, norm: none}]"):
        with pytest.warns(ConfigWarning, match="model.classifier: fedwon") as caught:
            load_config("default", [f"methods={methods}"])
        assert len(caught) == 1 and "digit_cnn" in str(caught[0].message)
    with pytest.warns(ConfigWarning, match="model.classifier: fedwon"):
        load_config("fedwon_office", ["model.classifier=fedbn"])  # AlexNet has the same two heads
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("default", ["methods=[fedavg, fedbn, fedavg_gn]"])  # the head keeps a normalization layer
        load_config("default", ["methods=[fedwon]", "model.classifier=fedwon"])
        load_config("default", ["methods=[fedwon]", "model.name=resnet18"])  # its own head, no classifier option
        for preset in ("fedwon_digits", "fedwon_office", "fedwon_pacs", "fedwon_cross_device"):
            load_config(preset)


def test_fedwon_cross_device_small_batches_are_presets_with_table9_right_rates():
    """FedWon Fig. 4 left (B = 1, 2 at C = 0.1 of 100 clients): fedwon_cross_device with only the batch size and
    Table 9 (right)'s rates changed, no AGC, FedAvg absent at B = 1; the paper gives curves, so no paper rows."""
    base = load_config("fedwon_cross_device")
    table9_right = {2: {"fedavg": 0.005, "fedwon": 0.01}, 1: {"fedwon": 0.01}}
    for batch, rates in table9_right.items():
        cfg = load_config(f"fedwon_cross_device_b{batch}")
        assert cfg.training.batch_size == batch
        assert {m.name: m.lr for m in cfg.methods} == rates
        assert all(m.agc_clip == 0 for m in cfg.methods if m.name == "fedwon")
        assert cfg.paper is None and not cfg.paper_variants
        assert (cfg.data, cfg.model, cfg.federation) == (base.data, base.model, base.federation)
        assert cfg.training.model_copy(update={"batch_size": base.training.batch_size}) == base.training
    with pytest.raises(ConfigError, match="batch_size 1"):
        load_config("fedwon_cross_device_b1", ["methods=[fedavg]"])


@pytest.mark.parametrize("name", ["harmofl_camelyon17", "harmofl_nuclei", "harmofl_prostate"])
def test_harmofl_paper_rows_carry_the_papers_avg_as_printed(name):
    """HarmoFL Tables 1-2 print an Avg per method; the presets quote it beside ours (as printed: Table 2's FedNova Avg
    83.61 is 0.02 under the mean of its printed hospitals, the rounding of unrounded per-client means)."""
    cfg = load_config(name)
    assert set(cfg.paper) == {m.display for m in cfg.methods}
    for method, row in cfg.paper.items():
        clients = [v for k, v in row.items() if k != "Avg"]
        assert len(clients) == len(cfg.data.domains) and abs(sum(clients) / len(clients) - row["Avg"]) <= 0.025, method
    assert "--avg-std clients" in cfg.paper_source


def test_a_model_option_the_model_does_not_take_is_refused_when_the_config_is_read():
    """ResNet-20 has no width, the ResNets and MobileNetV2 no classifier choice: refused at load, naming the key,
    rather than when the first cell builds its model; at their defaults they are simply not passed."""
    for override, key in (("model.width=0.5", "width"), ("model.classifier=fedwon", "classifier"),
                          ("model.bn_mode=batch", "bn_mode")):
        with pytest.raises(ConfigError, match=rf"model 'resnet20' has no option '{key}': remove model.{key}"):
            load_config("default", ["model.name=resnet20", "data.domains=[rendered/print]", override])
    assert load_config("default", ["model.name=resnet20", "data.domains=[rendered/print]"]).model.width == 1.0
    assert load_config("default", ["model.width=0.5"]).model.width == 0.5  # the digit CNN takes a width


def test_paper_rows_follow_the_setting_an_override_selects():
    """FedWon Table 3's preset is C = 0.1; at C = 0.2 or 0.4 its tables quote the paper's rows of that C."""
    base = load_config("fedwon_cross_device")
    assert base.paper_for_setting() == (base.paper, base.paper_source)
    assert base.paper["fedwon"]["mnist"] == 98.6 and "C = 0.1" in base.paper_source
    numbers, source = load_config("fedwon_cross_device", ["federation.fraction=0.2"]).paper_for_setting()
    assert numbers["fedwon"] == {"mnist": 98.7, "mnistm": 90.8, "usps": 98.2} and source.startswith("FedWon Table 3, C = 0.2")
    numbers, source = load_config("fedwon_cross_device", ["federation.fraction=0.4"]).paper_for_setting()
    assert numbers["fedavg"]["mnist"] == 98.1 and "Table 21, C = 0.4" in source
    # a setting the paper has no row for keeps the preset's own rows (and their source says which setting)
    odd = load_config("fedwon_cross_device", ["federation.fraction=0.3"])
    assert odd.paper_for_setting() == (base.paper, base.paper_source)
    # FBN's CIFAR-10 preset is gamma = 0 (naive BN 17 %); at gamma = 0.01 the paper's text has naive BN at 40 %
    assert load_config("fbn_cifar10").paper_for_setting()[0]["naive_bn"] == {"cifar10/train": 17.0}
    assert load_config("fbn_cifar10", ["data.gamma=0.01"]).paper_for_setting()[0] == {"naive_bn": {"cifar10/train": 40.0}}
    # its MNIST-M stand-in quotes the same CIFAR-10 numbers per setting, under its own column
    assert load_config("fbn_mnistm").paper_for_setting()[0]["naive_bn"] == {"mnistm": 17.0}
    assert load_config("fbn_mnistm", ["data.gamma=0.01"]).paper_for_setting()[0] == {"naive_bn": {"mnistm": 40.0}}


def test_a_paper_variant_keyed_on_an_unknown_setting_is_refused():
    variant = "paper_variants=[{when: {federation.fractoin: 0.2}, paper: {fedavg: {mnist: 1.0}}, paper_source: x}]"
    with pytest.raises(ConfigError, match="'federation.fractoin' is not a config key"):
        load_config("default", [variant])


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_puts_the_papers_numbers_beside_its_own_rows_and_columns(name):
    """A paper number is shown beside ours only under a method label and a client of the run: a misspelled key
    (a domain written without its @size, a label the preset does not run) would silently drop it."""
    cfg = load_config(name)
    labels = {m.display for m in cfg.methods}
    columns = set(cfg.data.domains) | {f"{d}:{mode}" for d in cfg.external.domains for mode in cfg.external.modes}
    for table in [cfg.paper or {}] + [v.paper for v in cfg.paper_variants]:
        assert set(table) <= labels, f"{name}: paper rows {sorted(set(table) - labels)} are not methods of the preset"
        for row in table.values():
            assert set(row) <= columns | {"Avg"}, f"{name}: paper columns {sorted(set(row) - columns - {'Avg'})}"


def test_external_bn_modes_need_running_statistics_before_any_training():
    """HarmoFL's code BN (model.bn_mode: batch) keeps no running statistics: UniFed's test-time BN and FedBN App. G
    have nothing to re-estimate, which the config says at once, not at the first evaluation after training."""
    assert load_config("unifed_camelyon17").model.name == "densenet121"
    with pytest.raises(ConfigError, match=r"external.modes \['test_time_bn', 'fedbn_average'\] .*model.bn_mode: batch"):
        load_config("unifed_camelyon17", ["model.bn_mode=batch"])
    only_global = load_config("unifed_camelyon17", ["model.bn_mode=batch", "external.modes=[global]"])
    assert only_global.external.modes == ["global"]


def test_external_config_reaches_the_test_time_bn_settings():
    bn = load_config("default", ["data.domains=[rendered/print, rendered/neon]", "external.domains=[rendered/street]",
                                 "external.batch_size=16",
                                 "external.momentum=0.5", "external.convention=pytorch", "external.reset=false",
                                 "external.predict=after_pass", "external.shuffle_seed=4",
                                 "external.unbiased=true"]).external.bn()
    assert (bn.batch_size, bn.momentum, bn.convention, bn.reset, bn.predict, bn.shuffle_seed, bn.unbiased) == (
        16, 0.5, "pytorch", False, "after_pass", 4, True)
    assert load_config("default").external.bn().unbiased is False


def test_a_test_time_bn_setting_without_its_mode_is_said_to_change_nothing(tmp_path):
    """external.momentum etc. shape only test_time_bn (fedbn_average is FedBN App. G's fixed protocol): set without
    that mode, the config warns; with it, or at the defaults, or reloaded from a run's config.yaml (every key
    written out) at the defaults, it does not."""
    import warnings

    import yaml

    from fednorm.runs.config import ConfigWarning

    base = ["data.domains=[rendered/print, rendered/neon]", "external.domains=[rendered/street]"]
    with pytest.warns(ConfigWarning, match=r"external.momentum, external.predict set the test-time BN .* "
                                           r"\['global', 'fedbn_average'\] leaves out"):
        load_config("default", base + ["external.modes=[global, fedbn_average]", "external.momentum=0.5",
                                       "external.predict=after_pass"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config("default", base + ["external.modes=[global, test_time_bn]", "external.momentum=0.5"])
        quiet = load_config("default", base + ["external.modes=[global, fedbn_average]"])
        written = tmp_path / "config.yaml"
        written.write_text(yaml.safe_dump(quiet.model_dump(mode="json")))
        load_config(str(written))


def test_fedwon_table13_resnet20_preset_has_table10_rates_on_fedwon_offices_protocol():
    """FedWon Table 13: the seven methods on Office-Caltech-10 with ResNet-20 and Table 10's learning rates, every
    other setting fedwon_office's; the paper's Avg is the mean of its four domains."""
    office, cfg = load_config("fedwon_office"), load_config("fedwon_office_resnet20")
    table10 = {"fedavg": 0.1, "fedavg_gn": 0.03, "fedavg_ln": 0.01, "silobn": 0.05, "fixbn": 0.03, "fedbn": 0.03,
               "fedwon": 0.1}
    assert {m.display: m.lr for m in cfg.methods} == table10 and cfg.model.name == "resnet20"
    assert [m.agc_clip for m in cfg.methods if m.display == "fedwon"] == [1.28]
    assert (cfg.data, cfg.training, cfg.federation) == (office.data, office.training, office.federation)
    for row in cfg.paper.values():
        assert round(sum(row[d] for d in cfg.data.domains) / 4, 1) == pytest.approx(row["Avg"], abs=0.051)


def test_fedwon_table12_unseen_domain_preset_scores_webcam_as_an_external_client():
    """FedWon Table 12: A, C, D train; WebCam never trains and is scored zero-shot. The paper's WebCam number is
    quoted under the global model for the shared-model methods and under FedBN App. G's averaged BN for FedBN."""
    cfg = load_config("fedwon_office_unseen")
    webcam = "office_caltech10/webcam@256"
    assert webcam not in cfg.data.domains and cfg.external.domains == [webcam] and len(cfg.data.domains) == 3
    assert [m.display for m in cfg.methods] == ["fedavg_nobn", "fedavg", "fedbn", "fedwon"]
    assert cfg.methods[0].build().norm == "none"  # FedAvg w/o BN: BN removed, plain convolutions
    unseen = {method: [k for k in row if k.startswith(webcam)] for method, row in cfg.paper.items()}
    assert unseen == {"fedavg_nobn": [f"{webcam}:global"], "fedavg": [f"{webcam}:global"],
                      "fedbn": [f"{webcam}:fedbn_average"], "fedwon": [f"{webcam}:global"]}
    # FedBN's other reading (running statistics averaged too, nothing estimated on WebCam) is reported beside it
    assert set(cfg.external.modes) == {"global", "fedbn_average", "bn_average"}


def test_fedwon_table2_and_table20_batch_sizes_are_presets_with_table9_rates():
    """FedWon Table 2 (B = 1, 2) and Table 20 (B = 4): one preset per batch size, each fedwon_pacs's protocol with
    only the batch size and Table 9's learning rates changed (no AGC); BatchNorm methods are absent at B = 1 and
    refused there. The Office-Caltech-10 presets are the same on fedwon_office's data, with the paper's rows."""
    pacs, office = load_config("fedwon_pacs"), load_config("fedwon_office")
    table9 = {  # batch size: {method: lr}, FedWon Table 9 (left)
        1: {"fedavg_gn": 0.001, "fedavg_ln": 0.001, "fedwon": 0.005},
        2: {"fedavg": 0.001, "silobn": 0.001, "fixbn": 0.001, "fedbn": 0.001, "fedavg_gn": 0.001, "fedavg_ln": 0.001,
            "fedwon": 0.01},
        4: {"fedavg": 0.001, "silobn": 0.01, "fixbn": 0.01, "fedbn": 0.01, "fedavg_gn": 0.001, "fedavg_ln": 0.001,
            "fedwon": 0.03},
    }
    paper_fedwon_avg = {1: 77.13, 2: 76.13, 4: 77.85}  # Tables 2 and 20, mean of A / C / D / W
    for batch, suffix in ((1, "_b1"), (2, ""), (4, "_b4")):
        on_pacs = load_config("fedwon_small_batch" + suffix)
        on_office = load_config("fedwon_office_small_batch" + suffix)
        for cfg, base in ((on_pacs, pacs), (on_office, office)):
            assert cfg.training.batch_size == batch
            assert (cfg.data, cfg.model, cfg.federation, cfg.seeds) == (base.data, base.model, base.federation,
                                                                        base.seeds)
            assert (cfg.training.augment, cfg.training.epochs) == (base.training.augment, base.training.epochs)
            assert {m.name: m.lr for m in cfg.methods} == table9[batch]
            assert all(m.agc_clip == 0 for m in cfg.methods if m.name == "fedwon")
        assert on_office.methods == on_pacs.methods
        assert set(on_office.paper) == {m.display for m in on_office.methods} and not on_pacs.paper
        fedwon_row = next(row for label, row in on_office.paper.items() if label.startswith("fedwon"))
        assert sum(fedwon_row.values()) / 4 == pytest.approx(paper_fedwon_avg[batch], abs=0.005)
    with pytest.raises(ConfigError, match="cannot use batch_size 1"):
        load_config("fedwon_small_batch_b1", ["methods=[{name: fedbn, lr: 0.001}]"])


def test_a_misspelled_key_gets_the_keys_spelled_like_it():
    with pytest.raises(ConfigError, match=r"federation.rouns: unknown key; did you mean federation.rounds\?"):
        load_config("default", ["federation.rouns=3"])
    with pytest.raises(ConfigError, match=r"methods.0.prox_mux: unknown key; did you mean methods.0.prox_mu\? "):
        load_config("default", ["methods=[{name: fedprox, prox_mux: 0.1}]"])
    with pytest.raises(ConfigError) as err:  # nothing close: no guess
        load_config("default", ["training.zzzzzz=3"])
    assert "did you mean" not in str(err.value) and "training.zzzzzz: unknown key" in str(err.value)


@pytest.mark.parametrize("override", ["federation.rounds=true", "training.lr=false", "federation.fraction=true"])
def test_true_or_false_where_a_number_belongs_is_refused_not_read_as_1_or_0(override):
    key = override.split("=")[0].split(".")[-1]
    with pytest.raises(ConfigError, match=rf"{key} is a number, got (true|false)") as err:
        load_config("default", [override])
    assert "Value error" not in str(err.value)  # pydantic's prefix is not shown


def test_numbers_yaml_reads_as_strings_are_still_numbers_and_booleans_stay_booleans():
    cfg = load_config("default", ["training.lr=1e-3", "federation.rounds=3", "federation.channels_last=true"])
    assert cfg.training.lr == 1e-3 and cfg.federation.rounds == 3 and cfg.federation.channels_last is True


@pytest.mark.parametrize("override", ["=3", "federation.=3", ".rounds=3"])
def test_an_empty_key_is_named_as_such(override):
    with pytest.raises(ConfigError, match="has an empty key"):
        load_config("default", [override])


def test_a_seed_given_twice_is_refused():
    with pytest.raises(ConfigError, match=r"seeds must be distinct, got \[0, 1, 0\]"):
        load_config("default", ["seeds=[0, 1, 0]"])


def test_held_out_type_builds_unifeds_fold_and_the_presets_list_their_folds():
    """``external.held_out_type`` sets both domain lists (from the set and severity the listed domains name); the
    corrupted external presets list exactly the noise fold's domains (without the option: lists a user gives are
    used as given); a type on the preset switches both lists, and re-validating a config that holds the fold
    changes nothing."""
    from importlib import resources

    import yaml

    from fednorm.data.corrupt import UNIFED_TYPES, corruption_type_fold

    for preset in ("unifed_corrupt_external", "unifed_cifar10c_external"):
        cfg = load_config(preset)
        assert cfg.external.held_out_type is None
        document = yaml.safe_load((resources.files("fednorm.runs") / "presets" / f"{preset}.yaml").read_text())
        written = (document.get("data", {}).get("domains"), document.get("external", {}).get("domains"))
        assert (cfg.data.domains, cfg.external.domains) == corruption_type_fold("noise", cfg.data.domains)
        assert (cfg.data.domains, cfg.external.domains) == written  # the YAML lists what the option builds
        for held in UNIFED_TYPES:
            fold = load_config(preset, [f"external.held_out_type={held}"])
            assert (fold.data.domains, fold.external.domains) == corruption_type_fold(held, cfg.data.domains)
            again = load_config(preset, [f"external.held_out_type={held}", f"data.domains={fold.data.domains}",
                                         f"external.domains={fold.external.domains}"])
            assert again.model_dump() == fold.model_dump()
    # without the option the lists are as given
    assert load_config("unifed_corrupt_external", ["external.domains=[corrupt/fog/2/mnistm]"]
                       ).external.domains == ["corrupt/fog/2/mnistm"]
    with pytest.raises(ConfigError, match="external.held_out_type: .* 'mnistm' is not one"):
        load_config("unifed_corrupt_external", ["external.held_out_type=blur", "data.domains=[mnistm]"])


def test_held_out_domains_move_trained_domains_to_the_external_clients():
    """Leave-one-domain-out: the held-out domain leaves data.domains and joins external.domains (after the ones
    listed), so one preset gives every fold; a run folder's config, which holds the fold, re-validates unchanged."""
    base = load_config("unifed_digits")
    assert base.data.domains == ["mnist", "mnistm", "usps", "rendered/synth"]
    fold = load_config("unifed_digits", ["external.held_out_domains=[usps]"])
    assert fold.data.domains == ["mnist", "mnistm", "rendered/synth"]
    assert fold.external.domains == ["semeion", "rendered/street", "usps"]
    assert ExperimentConfig.model_validate(fold.model_dump()).model_dump() == fold.model_dump()
    two = load_config("unifed_digits", ["external.domains=[]", "external.held_out_domains=[mnistm, mnist]"])
    assert (two.data.domains, two.external.domains) == (["usps", "rendered/synth"], ["mnistm", "mnist"])
    with pytest.raises(ConfigError, match=r"held_out_domains: \['svhn'\] are not in data.domains"):
        load_config("unifed_digits", ["external.held_out_domains=[svhn]"])
    with pytest.raises(ConfigError, match="leaves no domain to train on"):
        load_config("unifed_digits", ["external.held_out_domains=[mnist, mnistm, usps, rendered/synth]"])
    with pytest.raises(ConfigError, match="give one"):
        load_config("unifed_corrupt_external", ["external.held_out_domains=[corrupt/fog/3/mnistm]",
                                                "external.held_out_type=blur"])


def test_an_empty_config_file_is_refused_not_run_as_the_defaults(tmp_path):
    empty = tmp_path / "mine.yaml"
    empty.write_text("# only a comment\n")
    with pytest.raises(ConfigError, match=r"mine.yaml is empty: .*extends: default"):
        load_config(empty)
    (tmp_path / "defaults.yaml").write_text("extends: default\n")
    assert load_config(tmp_path / "defaults.yaml") == load_config("default")


def test_fedbn_digits_ablation_presets_keep_the_protocol_and_quote_tables_13_and_14_per_setting():
    """FedBN's digits studies: Table 11/12 (the paper's 300 rounds, centralized beside FedBN), local epochs
    (300 / E rounds), B x E (Table 13), local data size (Table 14), clients per domain; each keeps fedbn_digits'
    data, model and optimizer, and the paper's numbers follow the setting a run is given."""
    base = load_config("fedbn_digits")
    assert base.federation.rounds == 300 and base.training.epochs == 1
    assert base.paper["centralized"] == {"mnist": 96.53, "mnistm": 79.65, "usps": 96.46}  # Table 12
    ablations = {name: load_config(name) for name in ("fedbn_digits_local_epochs", "fedbn_digits_batch_epochs",
                                                     "fedbn_digits_data_size", "fedbn_digits_clients")}
    for name, cfg in ablations.items():
        assert (cfg.data.domains, cfg.model, cfg.training.lr, cfg.federation.weighting) == (
            base.data.domains, base.model, base.training.lr, base.federation.weighting), name
    epochs = ablations["fedbn_digits_local_epochs"]
    assert epochs.training.epochs * epochs.federation.rounds == 300 and not epochs.paper
    assert ablations["fedbn_digits_clients"].data.clients_per_domain == 2
    # Table 13: each of the nine (B, E) cells quotes its own row; B = inf is a client's whole set (743)
    grid = {}
    for batch in (10, 50, 743):
        for e in (1, 4, 16):
            cfg = load_config("fedbn_digits_batch_epochs", [f"training.batch_size={batch}", f"training.epochs={e}"])
            paper, source = cfg.paper_for_setting()
            assert f"B = {'inf' if batch == 743 else batch}" in source and f"E = {e}," in source
            grid[batch, e] = paper
    assert len({str(p) for p in grid.values()}) == 9
    assert grid[50, 4]["fedbn"]["mnistm"] == 77.56 and grid[743, 16]["fedavg"]["usps"] == 94.68
    assert grid[10, 1]["fedbn"] == {"mnist": 97.41, "mnistm": 82.81, "usps": 97.37}
    # Table 14: seven shares of the pool, each its own column of numbers
    sizes = {p: load_config("fedbn_digits_data_size", [f"data.percent={p}"]).paper_for_setting()
             for p in (1.0, 0.6, 0.4, 0.2, 0.1, 0.05, 0.01)}
    assert all(f"{p * 100:g} % of the pool" in source for p, (_, source) in sizes.items())
    assert sizes[0.01][0]["singleset"]["mnistm"] == 17.23 and sizes[1.0][0]["fedbn"]["usps"] == 98.82
    assert sizes[0.1][0]["fedavg"]["mnist"] == 96.22  # not Table 11's 95.87: a different run (the paper's note)


def test_fedwon_office_ablation_local_epoch_and_agc_presets_quote_tables_18_14_19_on_fedwon_offices_protocol():
    """FedWon's Office-Caltech-10 studies: WSConv x AGC (Table 4 / 18, B = 32 and B = 2), local epochs (Table 14)
    and AGC on the other methods (Table 19): fedwon_office's data and protocol, the paper's rows per setting, each
    Avg the mean of its four domains as printed."""
    office = load_config("fedwon_office")
    b32 = load_config("fedwon_office_ablation")
    b2 = load_config("fedwon_office_ablation", ["training.batch_size=2", "training.lr=0.01"])
    e1, e8 = (load_config("fedwon_office_local_epochs", [f"training.epochs={e}"]) for e in (1, 8))
    agc = load_config("fedwon_office_agc")
    for cfg in (b32, b2, e1, e8, agc):
        assert (cfg.data, cfg.federation, cfg.seeds) == (office.data, office.federation, office.seeds)
        paper, _ = cfg.paper_for_setting()
        for method, row in paper.items():  # the printed Avg is the mean rounded to 0.1 (75.55 printed 75.6) ...
            mean = sum(row[d] for d in cfg.data.domains) / 4
            # ... but for FedWon's Table 1 row (67.0, 50.4, 95.3, 90.7), whose mean 75.85 the paper prints 75.6
            # (extraction Sec. 0): quoted as printed
            printed_off = [row[d] for d in cfg.data.domains] == [67.0, 50.4, 95.3, 90.7]
            assert mean == pytest.approx(75.85 if printed_off else row["Avg"], abs=0.051), (cfg.name, method)
    assert (b32.training.lr, b32.model.norm) == (0.08, "none")
    assert {m.display: (m.build().norm, m.build().agc_clip) for m in b32.methods} == {
        "ws+agc": ("ws", 1.28), "ws": ("ws", 0), "agc": ("none", 1.28), "neither": ("none", 0)}
    assert b32.paper_for_setting()[0]["neither"]["Avg"] == 28.2 and b2.paper_for_setting()[0]["neither"]["Avg"] == 65.3
    # E = 1 is Table 1's setting: Table 14's E = 1 rows are fedwon_office's own FedBN and FedWon numbers
    for method in ("fedbn", "fedwon"):
        row = e1.paper_for_setting()[0][method]
        assert {d: row[d] for d in office.data.domains} == office.paper[method]
    assert e8.paper_for_setting()[0]["fedwon"]["Avg"] == 75.6
    assert {m.display: m.agc_clip for m in agc.methods if m.display != "fedwon"} == {
        f"{name}+agc": 1.28 for name in ("fedavg", "fedavg_gn", "fedavg_ln", "fixbn", "silobn", "fedbn")}
    assert load_config("fbn_robust_cifar10").data.test_domain == "cifar10/test"
