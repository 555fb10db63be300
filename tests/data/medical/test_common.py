"""Split types and split rules shared by the medical datasets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fednorm.data.domain import Domain, Split
from fednorm.data.medical import (FeatureSplit, SegmentationSplit, fraction_bounds, group_split_indices, harmofl_bounds,
                                  split_indices, truncate_train_to_smallest)


def test_harmofl_bounds_are_the_official_code_rounding():
    assert harmofl_bounds(100) == (64, 80)  # 64 / 16 / 20
    assert harmofl_bounds(25) == (16, 20)  # 16 / 4 / 5
    for n in range(0, 3000):
        trainlen = 0.8 * n * 0.8  # med-air/HarmoFL utils/dataset.py, Prostate
        vallen = 0.8 * n - trainlen
        assert harmofl_bounds(n) == (int(trainlen), int(trainlen + vallen))


def test_split_indices_partition_and_are_seeded():
    tr, va, te = split_indices(100, "harmofl", seed=3)
    assert (len(tr), len(va), len(te)) == (64, 16, 20)
    assert sorted(np.concatenate([tr, va, te]).tolist()) == list(range(100))
    assert np.array_equal(tr, split_indices(100, "harmofl", seed=3)[0])
    assert not np.array_equal(tr, split_indices(100, "harmofl", seed=4)[0])
    assert [len(p) for p in split_indices(100, (0.7, 0.1, 0.2), seed=0)] == [70, 10, 20]
    # the decimal fractions' products, not binary floating point's: (0.7 + 0.1) * 10 is 7.999999999999999
    assert [len(p) for p in split_indices(10, (0.7, 0.1, 0.2), seed=0)] == [7, 1, 2]
    assert fraction_bounds(100, (0.29, 0.01, 0.7)) == (29, 30)  # 0.29 * 100 is 28.999999999999996
    with pytest.raises(ValueError, match="sum"):
        fraction_bounds(10, (0.5, 0.5, 0.5))


def test_group_split_keeps_groups_whole():
    groups = np.repeat(np.arange(20), 5)
    parts = group_split_indices(groups, "harmofl", seed=1)
    assert sorted(np.concatenate(parts).tolist()) == list(range(100))
    sets = [set(groups[p].tolist()) for p in parts]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert [len(p) for p in parts] == [65, 15, 20]  # whole groups of 5 until each share is reached


def test_segmentation_split_checks_and_subsets():
    s = SegmentationSplit(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.ones(4, 8, 8, dtype=torch.uint8))
    assert len(s) == 4 and len(s.subset(torch.tensor([0, 2]))) == 2
    assert len(SegmentationSplit.concat([s, s])) == 8
    with pytest.raises(TypeError, match="uint8"):
        SegmentationSplit(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.ones(4, 8, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not match"):
        SegmentationSplit(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.ones(4, 8, 7, dtype=torch.uint8))


def test_feature_split_checks_and_keeps_groups():
    f = FeatureSplit(torch.zeros(5, 7), torch.zeros(5, dtype=torch.int64), torch.arange(5))
    sub = f.subset(torch.tensor([1, 3]))
    assert sub.groups.tolist() == [1, 3] and len(FeatureSplit.concat([f, sub])) == 7
    with pytest.raises(TypeError, match="float32"):
        FeatureSplit(torch.zeros(5, 7, dtype=torch.float64), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        FeatureSplit(torch.zeros(5, 7), torch.zeros(4, dtype=torch.int64))


def test_truncate_train_to_smallest_keeps_first_samples():
    def dom(n):
        x = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 2, 2).contiguous()
        split = Split(x, torch.arange(n))
        return Domain(name=f"d{n}", train=split, test=split)

    out = truncate_train_to_smallest([dom(10), dom(4), dom(7)])
    assert [len(d.train) for d in out] == [4, 4, 4] and [len(d.test) for d in out] == [10, 4, 7]
    assert out[0].train.y.tolist() == [0, 1, 2, 3]


def test_registry_lists_every_site_and_rejects_unknown_domains(tmp_path):
    from fednorm.data.medical import MEDICAL_DATASETS, load_medical_domain, medical_domain_names

    names = medical_domain_names()
    assert len(names) == 5 + 6 + 6 + 4 + 6 and "prostate/ISBI_1.5" in names and "abide/UCLA" in names
    assert MEDICAL_DATASETS["abide"].input_shape == (5995,) and MEDICAL_DATASETS["fed_isic2019"].num_classes == 8
    assert MEDICAL_DATASETS["camelyon17"].truncate_train and not MEDICAL_DATASETS["nuclei"].truncate_train
    with pytest.raises(ValueError, match="unknown medical domain"):
        load_medical_domain("prostate/MSD", tmp_path)
    from fednorm.data.domain import DataError

    with pytest.raises(DataError, match="prostate/HK.npz"):
        load_medical_domain("prostate/HK", tmp_path)
