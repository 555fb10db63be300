"""Medical datasets of the five papers: loaders and preparers writing the data folder's npz format.

* ``camelyon17`` (HarmoFL Table 2, UniFed Fig. 5): sites ``hospital1`` .. ``hospital5``;
  :class:`~fednorm.data.domain.Split`, 3 x 96 x 96, 2 classes.
* ``prostate`` (HarmoFL Table 1): sites ``BIDMC HK I2CVB ISBI ISBI_1.5 UCL``;
  :class:`SegmentationSplit`, 3 x 384 x 384 (2.5-D slices), masks with 2 classes.
* ``nuclei`` (HarmoFL Table 1): sites ``monusac2020_{breast,kidney,lung,prostate} monuseg2018 tnbc``;
  :class:`SegmentationSplit`, 3 x 256 x 256, 2 classes.
* ``abide`` (FedBN Table 1): sites ``NYU USM UM UCLA``; :class:`FeatureSplit`, 5,995 float32
  features, 2 classes.
* ``fed_isic2019`` (FedWon Table 11): sites ``bcn vidir_molemax vidir_modern rosendahl msk
  vienna_dias``; :class:`~fednorm.data.domain.Split`, 3 x 224 x 224, 8 classes.

Each module's docstring gives the official source, the exact preprocessing (and where the paper
and the authors' code leave a choice, which one is made), the split rule and the npz layout.
Every ``prepare_*`` takes ``(data_dir, *, raw_dir=None, download=True, progress=True)`` like
:mod:`fednorm.data.prepare`, writes through :func:`~fednorm.data.prepare.write_dataset_file` (npz +
manifest entry) and raises :class:`~fednorm.data.domain.DataError` saying exactly what to download
and where to put it when a source needs a manual step. Every ``load_*`` returns a
:class:`~fednorm.data.domain.Domain` with train/val/test splits. :data:`MEDICAL_DATASETS` lists
them for a federation builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._common import (HARMOFL_FRACTIONS, FeatureSplit, SegmentationSplit, fraction_bounds, group_split_indices,
                      harmofl_bounds, split_indices, truncate_train_to_smallest)
from .abide import (ABIDE_SITES, FEDBN_NUM_FEATURES, load_abide, prepare_abide, prepare_abide_vectors,
                    standardize_features)
from .camelyon17 import (CAMELYON17_HOSPITALS, UNIFED_EXTERNAL, UNIFED_INTERNAL, load_camelyon17,
                         load_camelyon17_pool, load_unifed_camelyon17, prepare_camelyon17)
from .isic2019 import ISIC_CENTERS, ISIC_CLASSES, load_fed_isic2019, prepare_fed_isic2019
from .nifti import read_nifti
from .nuclei import NUCLEI_CLIENTS, load_nuclei, prepare_nuclei
from .prostate import PROSTATE_SITES, load_prostate, prepare_prostate


@dataclass(frozen=True)
class MedicalDataset:
    """What a federation builder needs to turn a medical dataset's sites into domains."""

    name: str
    sites: tuple[str, ...]
    task: str  # "classification", "segmentation" or "features"
    num_classes: int
    input_shape: tuple[int, ...]  # per sample: (C, H, W) or (D,)
    load: Callable  # load(site, data_dir, **options) -> Domain
    prepare: Callable  # prepare(data_dir, *, raw_dir, download, progress) -> path(s)
    truncate_train: bool  # HarmoFL truncates every training split to the smallest client
    paper: str


MEDICAL_DATASETS: dict[str, MedicalDataset] = {
    "camelyon17": MedicalDataset("camelyon17", CAMELYON17_HOSPITALS, "classification", 2, (3, 96, 96),
                                 load_camelyon17, prepare_camelyon17, True, "HarmoFL Table 2; UniFed Fig. 5"),
    "prostate": MedicalDataset("prostate", PROSTATE_SITES, "segmentation", 2, (3, 384, 384),
                               load_prostate, prepare_prostate, True, "HarmoFL Table 1"),
    "nuclei": MedicalDataset("nuclei", NUCLEI_CLIENTS, "segmentation", 2, (3, 256, 256),
                             load_nuclei, prepare_nuclei, False, "HarmoFL Table 1"),
    "abide": MedicalDataset("abide", ABIDE_SITES, "features", 2, (FEDBN_NUM_FEATURES,),
                            load_abide, prepare_abide, False, "FedBN Table 1"),
    "fed_isic2019": MedicalDataset("fed_isic2019", ISIC_CENTERS, "classification", len(ISIC_CLASSES), (3, 224, 224),
                                   load_fed_isic2019, prepare_fed_isic2019, False, "FedWon Table 11"),
}


def medical_domain_names() -> list[str]:
    """Every medical domain as ``<dataset>/<site>`` (e.g. ``camelyon17/hospital1``)."""
    return [f"{d.name}/{s}" for d in MEDICAL_DATASETS.values() for s in d.sites]


def load_medical_domain(domain: str, data_dir: Path, **options):
    """``load_medical_domain("prostate/HK", data_dir)`` -> that site's :class:`Domain`."""
    dataset, _, site = domain.partition("/")
    if dataset not in MEDICAL_DATASETS or site not in MEDICAL_DATASETS[dataset].sites:
        raise ValueError(f"unknown medical domain {domain!r}; choose from {', '.join(medical_domain_names())}")
    return MEDICAL_DATASETS[dataset].load(site, Path(data_dir), **options)


__all__ = [
    "ABIDE_SITES", "CAMELYON17_HOSPITALS", "FEDBN_NUM_FEATURES", "HARMOFL_FRACTIONS", "ISIC_CENTERS", "ISIC_CLASSES",
    "MEDICAL_DATASETS", "NUCLEI_CLIENTS", "PROSTATE_SITES", "UNIFED_EXTERNAL", "UNIFED_INTERNAL", "FeatureSplit",
    "MedicalDataset", "SegmentationSplit", "fraction_bounds", "group_split_indices", "harmofl_bounds",
    "load_abide", "load_camelyon17", "load_camelyon17_pool", "load_fed_isic2019", "load_medical_domain",
    "load_nuclei", "load_prostate", "load_unifed_camelyon17", "medical_domain_names", "prepare_abide",
    "prepare_abide_vectors", "prepare_camelyon17", "prepare_fed_isic2019", "prepare_nuclei", "prepare_prostate",
    "read_nifti", "split_indices", "standardize_features", "truncate_train_to_smallest",
]
