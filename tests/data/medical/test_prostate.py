"""Prostate MRI: tiny NIfTI-1 volumes in the SAML layout, HarmoFL's slice extraction and split."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from fednorm.data.domain import DataError
from fednorm.data.medical import load_prostate, prepare_prostate, read_nifti
from fednorm.data.medical import prostate as pro

from .helpers import manifest, write_nifti

IJ = 16  # in-plane voxels of the test volumes (the release has 384)


def _volume(rng, depth, empty=(0, 3)):
    """(image, mask) indexed [i, j, k] like the files; mask slices in ``empty`` have no prostate."""
    image = rng.normal(500, 100, (IJ, IJ, depth)).astype(np.float32)
    mask = np.zeros((IJ, IJ, depth), dtype=np.uint8)
    for k in range(depth):
        if k not in empty:
            mask[4:9, 3:12, k] = 1
            mask[5, 5, k] = 2  # labels > 1 become 1
    return image, mask


def _site(root, site, depths, seed=0, capital=False):
    rng = np.random.default_rng(seed)
    for c, depth in enumerate(depths):
        image, mask = _volume(rng, depth)
        write_nifti(root / site / f"Case{c:02d}.nii.gz", image)
        suffix = "_Segmentation" if capital else "_segmentation"
        write_nifti(root / site / f"Case{c:02d}{suffix}.nii.gz", mask)


def _expected_count(depths, empty=(0, 3)):
    return sum(sum(1 for k in range(1, d - 1) if k not in empty) for d in depths)


def test_nifti_reader_matches_the_spec_and_nibabel(tmp_path):
    vol = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    assert np.array_equal(read_nifti(write_nifti(tmp_path / "a.nii.gz", vol)), vol)
    scaled = read_nifti(write_nifti(tmp_path / "b.nii", vol, slope=2.0, inter=1.0))
    assert np.array_equal(scaled, vol * 2.0 + 1.0)
    nib = pytest.importorskip("nibabel")
    assert np.array_equal(np.asarray(nib.load(tmp_path / "a.nii.gz").dataobj), vol)
    img = nib.Nifti1Image(np.random.default_rng(0).normal(size=(5, 6, 7)).astype(np.float32), np.eye(4))
    nib.save(img, tmp_path / "c.nii.gz")
    assert np.array_equal(read_nifti(tmp_path / "c.nii.gz"), img.get_fdata(dtype=np.float32))


def test_nifti_errors_name_the_file(tmp_path):
    path = write_nifti(tmp_path / "v.nii.gz", np.zeros((4, 4, 4), np.float32))
    data = gzip.decompress(path.read_bytes())
    (tmp_path / "short.nii").write_bytes(data[:500])
    with pytest.raises(DataError, match="truncated") as info:
        read_nifti(tmp_path / "short.nii")
    assert "short.nii" in str(info.value)
    (tmp_path / "bad.nii.gz").write_bytes(path.read_bytes()[:30])
    with pytest.raises(DataError, match="bad.nii.gz"):
        read_nifti(tmp_path / "bad.nii.gz")
    (tmp_path / "text.nii").write_bytes(b"x" * 400)
    with pytest.raises(DataError, match="not a NIfTI-1"):
        read_nifti(tmp_path / "text.nii")


def test_volume_slices_follow_harmofl_exactly():
    rng = np.random.default_rng(1)
    image, mask = _volume(rng, 6, empty=(2,))
    x, y, k = pro.volume_slices(image, mask, "test", size=IJ)
    assert k.tolist() == [1, 3, 4]  # slices 1..D-2 with a non-empty mask
    # reference: SimpleITK order [k, j, i], convert_from_nii_to_png, channels i-1, i, i+1
    arr = np.transpose(image, (2, 1, 0)).astype(np.float64)
    high, low = np.quantile(arr, 0.99), arr.min()
    ref = ((np.where(arr > high, high, arr) - low) / (high - low) * 255).astype(np.uint8)
    for n, i in enumerate(k):
        assert np.array_equal(x[n], np.transpose(ref[i - 1:i + 2], (1, 2, 0)))
        assert np.array_equal(y[n], np.minimum(np.transpose(mask, (2, 1, 0))[i], 1))
    assert x.dtype == np.uint8 and y.max() == 1


def test_prepare_and_load_with_seeded_order(tmp_path):
    raw = tmp_path / "raw"
    _site(raw, "BIDMC", [15, 14])
    _site(raw, "HK", [8], seed=2, capital=True)
    data = tmp_path / "data"
    paths = prepare_prostate(data, raw_dir=raw, download=False, harmofl_order=False, sites=("BIDMC", "HK"))
    assert [p.name for p in paths] == ["BIDMC.npz", "HK.npz"]
    n = _expected_count([15, 14])
    assert n == 23
    with np.load(paths[0]) as f:
        assert f["x"].shape == (n, 384, 384, 3) and f["y"].shape == (n, 384, 384)
        assert f["x"].dtype == np.uint8 and f["y"].dtype == np.uint8 and set(np.unique(f["y"])) == {0, 1}
        assert f["cases"].tolist() == ["Case00.nii.gz", "Case01.nii.gz"] and "harmofl_index" not in f
    assert manifest(data)["prostate_BIDMC"]["arrays"]["x"] == [n, 384, 384, 3]
    dom = load_prostate("BIDMC", data, seed=0)
    a, b = pro.harmofl_bounds(n)
    assert (len(dom.train), len(dom.val), len(dom.test)) == (a, b - a, n - b) == (14, 4, 5)
    assert dom.train.x.shape[1:] == (3, 384, 384) and dom.train.y.shape[1:] == (384, 384)
    assert dom.train.y.dtype == torch.uint8 and dom.num_classes == 2 and "seeded" in dom.description
    by_case = load_prostate("BIDMC", data, split_by="case")
    with np.load(paths[0]) as f:  # each loaded slice found among the stored ones: which case it belongs to
        row = {img.tobytes(): i for i, img in enumerate(f["x"])}
        case_of = f["case"]
    assert len(row) == n
    found = [[row[img.permute(1, 2, 0).numpy().tobytes()] for img in split.x]
             for split in (by_case.train, by_case.val, by_case.test)]
    assert sorted(sum(found, [])) == list(range(n))  # every slice once
    cases = [{case_of[i].item() for i in rows} for rows in found]
    assert sum(len(c) for c in cases) == len(set(case_of.tolist())) == 2  # no patient in two splits
    with pytest.raises(DataError, match="harmofl_order=True"):
        load_prostate("BIDMC", data, order="harmofl")
    hk = load_prostate("HK", data)  # "_Segmentation" masks; 5 slices: 3 / 1 / 1
    assert (len(hk.train), len(hk.val), len(hk.test)) == (3, 1, 1)


def test_prepare_in_harmofl_order_reproduces_the_official_split(tmp_path):
    raw = tmp_path / "raw"
    _site(raw, "UCL", [10, 7, 9])
    # the authors' os.listdir order, images and masks mixed; cases taken in this order
    listing = ["Case02_segmentation.nii.gz", "Case00.nii.gz", "Case00_segmentation.nii.gz",
               "Case01_segmentation.nii.gz", "Case02.nii.gz", "Case01.nii.gz"]
    n = _expected_count([10, 7, 9])
    perm = np.random.default_rng(5).permutation(n)
    (raw / "harmofl").mkdir()
    np.save(raw / "harmofl" / "UCL-dir.npy", np.array(listing))
    np.save(raw / "harmofl" / "UCL-index.npy", perm)
    data = tmp_path / "data"
    prepare_prostate(data, raw_dir=raw, download=False, sites=("UCL",))
    with np.load(data / "prostate" / "UCL.npz") as f:
        assert f["cases"].tolist() == ["Case02.nii.gz", "Case00.nii.gz", "Case01.nii.gz"]
        assert np.array_equal(f["harmofl_index"], perm)
        x_all, y_all = f["x"], f["y"]
    dom = load_prostate("UCL", data)
    assert "order harmofl" in dom.description
    a, b = pro.harmofl_bounds(n)
    assert torch.equal(dom.train.x, torch.from_numpy(x_all[perm[:a]]).permute(0, 3, 1, 2))
    assert torch.equal(dom.test.y, torch.from_numpy(y_all[perm[b:]]))
    assert "med-air/HarmoFL" in manifest(data)["prostate_UCL"]["source"]

    np.save(raw / "harmofl" / "UCL-index.npy", perm[:-1])
    with pytest.raises(DataError, match="not a permutation"):
        prepare_prostate(tmp_path / "d2", raw_dir=raw, download=False, sites=("UCL",))


def test_missing_files_say_what_to_download(tmp_path):
    raw = tmp_path / "raw"
    with pytest.raises(DataError, match="liuquande.github.io/SAML") as info:
        prepare_prostate(tmp_path / "data", raw_dir=raw, download=False, sites=("ISBI",))
    assert str(raw / "ISBI") in str(info.value)
    _site(raw, "ISBI", [6])
    with pytest.raises(DataError, match="raw.githubusercontent.com/med-air/HarmoFL") as info:
        prepare_prostate(tmp_path / "data", raw_dir=raw, download=False, sites=("ISBI",))
    assert "harmofl_order=False" in str(info.value)
    (raw / "ISBI" / "Case00.nii.gz").unlink()
    with pytest.raises(DataError, match="Case00.nii.gz"):
        prepare_prostate(tmp_path / "data", raw_dir=raw, download=False, harmofl_order=False, sites=("ISBI",))
    with pytest.raises(ValueError, match="prostate site"):
        prepare_prostate(tmp_path / "data", raw_dir=raw, download=False, sites=("Prostate",))
