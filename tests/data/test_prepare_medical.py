"""The medical preparers in ``fednorm data prepare``'s table (:data:`fednorm.data.prepare.PREPARERS`):
their manual-download messages, site selection, and a real preparation from files in the official
layout. Nothing downloads: every call passes ``download=False`` and the downloaders are disabled."""

from __future__ import annotations

import numpy as np
import pytest

from fednorm.data import medical
from fednorm.data.domain import DataError
from fednorm.data.federation import known_domains
from fednorm.data.prepare import (MEDICAL_PREPARERS, MEDICAL_SITE_OPTIONS, OBJECT_PREPARERS, PREPARERS,
                                  prepare_dataset, preparer_for)

from .medical.test_camelyon17 import _bundle
from .medical.test_nuclei import _pair

# What each preparer's message must tell a user who has none of the files.
MANUAL = {
    "camelyon17": ("camelyon17_v1.0.tar.gz", "worksheets.codalab.org"),
    "prostate": ("liuquande.github.io/SAML", "BIDMC"),
    "nuclei": ("monusac2020_breast", "grand-challenge.org"),
    "abide": ("Phenotypic_V1_0b_preprocessed1.csv", "fcp-indi"),
    "fed_isic2019": ("train_test_split", "owkin/FLamby"),
}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to download")

    monkeypatch.setattr("fednorm.data.medical._common._download", refuse)
    monkeypatch.setattr("fednorm.data.prepare._download", refuse)


def test_every_medical_dataset_is_in_the_preparer_table():
    assert set(MEDICAL_PREPARERS) == set(medical.MEDICAL_DATASETS) == set(MANUAL)
    assert PREPARERS["camelyon17"] is medical.prepare_camelyon17
    assert PREPARERS["prostate"] is medical.prepare_prostate
    assert PREPARERS["nuclei"] is medical.prepare_nuclei
    assert PREPARERS["abide"] is medical.prepare_abide
    assert PREPARERS["fed_isic2019"] is medical.prepare_fed_isic2019
    assert {"svhn", "synthdigits", "cifar10", *OBJECT_PREPARERS} <= set(PREPARERS)


@pytest.mark.parametrize("dataset", sorted(MANUAL))
def test_missing_medical_files_raise_the_manual_download_message(tmp_path, dataset):
    with pytest.raises(DataError) as err:
        prepare_dataset(dataset, tmp_path / "data", download=False, progress=False)
    message = str(err.value)
    assert all(part in message for part in MANUAL[dataset]), message
    assert str(tmp_path / "data" / "raw" / dataset) in message  # the default raw folder: where to put files
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_preparer_for_names_the_command_of_every_prepared_domain():
    assert preparer_for("camelyon17/hospital3") == "camelyon17"
    assert preparer_for("prostate/ISBI_1.5") == "prostate"
    assert preparer_for("abide/NYU") == "abide"
    assert preparer_for("fed_isic2019/msk") == "fed_isic2019"
    assert preparer_for("nuclei/tnbc") == "nuclei"
    assert preparer_for("svhn") == "svhn" and preparer_for("cifar10/test") == "cifar10"
    assert preparer_for("office_caltech10/amazon@256") == "office_caltech10"
    assert preparer_for("corrupt/fog/3/domainnet/real") == "domainnet"
    for offline in ("mnist", "mnistm", "usps", "semeion", "pacs/photo", "rendered/neon", "corrupt/fog/1/mnistm"):
        assert preparer_for(offline) is None
    # known_domains() lists concrete names; CIFAR-10-C's 95 (corruption, severity) names are a pattern beside them
    from fednorm.data.cifar10c import cifar10c_domains

    assert {preparer_for(d) for d in known_domains() + cifar10c_domains(3)} - {None} == set(PREPARERS)


def test_options_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="unknown dataset 'isic'"):
        prepare_dataset("isic", "unused")
    with pytest.raises(ValueError, match="--size and --domains"):
        prepare_dataset("camelyon17", "unused", domains=["hospital1"])
    with pytest.raises(ValueError, match="--size and --domains"):
        prepare_dataset("abide", "unused", domains="NYU")
    with pytest.raises(ValueError, match="--size and --domains"):
        prepare_dataset("nuclei", "unused", size=128)
    with pytest.raises(ValueError, match="--fedbn-dir applies to svhn and synthdigits only"):
        prepare_dataset("prostate", "unused", fedbn_dir="somewhere")


def test_domains_select_the_sites_of_a_medical_preparer(tmp_path, monkeypatch):
    seen = {}

    def fake(data_dir, **kwargs):
        seen.update(kwargs, data_dir=data_dir)
        return [data_dir / "x.npz"]

    for name in MEDICAL_SITE_OPTIONS:
        monkeypatch.setitem(PREPARERS, name, fake)
    assert prepare_dataset("prostate", tmp_path, domains="HK, UCL", download=False) == [tmp_path / "x.npz"]
    assert seen["sites"] == ("HK", "UCL") and seen["download"] is False and seen["raw_dir"] is None
    seen.clear()
    prepare_dataset("nuclei", tmp_path, raw_dir=str(tmp_path / "r"), domains=["tnbc"])
    assert seen["clients"] == ("tnbc",) and seen["raw_dir"] == tmp_path / "r"
    seen.clear()
    prepare_dataset("fed_isic2019", tmp_path)
    assert "centers" not in seen  # default: every center


def test_prepare_dataset_converts_real_layouts(tmp_path):
    raw = tmp_path / "raw"
    _bundle(raw / "camelyon17" / "camelyon17_v1.0", sizes=(5, 4, 4, 4, 6))
    written = prepare_dataset("camelyon17", tmp_path / "data", raw_dir=raw / "camelyon17", download=False,
                              progress=False)
    assert [p.name for p in written] == [f"hospital{k}.npz" for k in range(1, 6)]
    with np.load(written[4]) as f:
        assert f["x"].shape == (6, 96, 96, 3)
    rng = np.random.default_rng(0)
    for i in range(5):
        _pair(raw / "nuclei" / "monuseg2018" / "train", f"A{i}", rng)
    _pair(raw / "nuclei" / "monuseg2018" / "test", "T0", rng)
    # only the selected site: the other five nuclei clients are not needed
    written = prepare_dataset("nuclei", tmp_path / "data", raw_dir=raw / "nuclei", domains="monuseg2018",
                              download=False, progress=False)
    assert [p.name for p in written] == ["monuseg2018.npz"]
    assert medical.load_nuclei("monuseg2018", tmp_path / "data").test.x.shape[0] == 1
