"""Prostate MRI: reading NIfTI volumes, tiny volumes in the SAML layout, HarmoFL's slice extraction and split."""

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


def test_nifti_reader_reads_files_built_from_the_spec(tmp_path):
    """Files written byte by byte from the NIfTI-1 spec (helpers.write_nifti, no nibabel): the file's
    datatype is kept when unscaled, float64 when scl_slope / scl_inter are set."""
    vol = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    plain = read_nifti(write_nifti(tmp_path / "a.nii.gz", vol))
    assert plain.dtype == np.int16 and np.array_equal(plain, vol)
    scaled = read_nifti(write_nifti(tmp_path / "b.nii", vol, slope=2.0, inter=1.0))
    assert scaled.dtype == np.float64 and np.array_equal(scaled, vol * 2.0 + 1.0)
    scaled = read_nifti(write_nifti(tmp_path / "c.nii", vol.astype(np.float32), slope=0.5, inter=-3.0))
    assert scaled.dtype == np.float64 and np.array_equal(scaled, vol * 0.5 - 3.0)
    mask = (np.arange(4 * 5 * 6) % 3).astype(np.uint8).reshape(4, 5, 6)
    read = read_nifti(write_nifti(tmp_path / "m.nii.gz", mask))
    assert read.dtype == np.uint8 and np.array_equal(read, mask)
    squeezed = read_nifti(write_nifti(tmp_path / "f.nii", vol[..., None].astype(np.float32)))
    assert squeezed.shape == (2, 3, 4) and squeezed.dtype == np.float32 and np.array_equal(squeezed, vol)


def test_nifti_volumes_are_read_in_ijk_order_with_scaling(tmp_path):
    nib = pytest.importorskip("nibabel")
    raw = np.arange(3 * 4 * 5, dtype=np.int16).reshape(3, 4, 5) * 7 - 100  # distinct values, no two axes alike
    img = nib.Nifti1Image(raw, np.eye(4))
    img.header.set_slope_inter(2.0, 1.0)
    path = tmp_path / "scaled.nii.gz"
    nib.save(img, path)
    on_disk = nib.load(path)  # the file holds the raw voxels and the scaling in its header
    assert on_disk.header["sizeof_hdr"] == 348 and on_disk.header["dim"][0] == 3
    assert (on_disk.dataobj.slope, on_disk.dataobj.inter) == (2.0, 1.0)
    assert np.array_equal(on_disk.dataobj.get_unscaled(), raw)
    vol = read_nifti(path)
    assert vol.shape == (3, 4, 5) and vol.dtype == np.float64
    assert np.array_equal(vol, 2.0 * raw + 1.0)
    assert vol[2, 1, 0] == 2 * raw[2, 1, 0] + 1 and vol[0, 3, 4] == 2 * raw[0, 3, 4] + 1  # [i, j, k]

    values = np.random.default_rng(0).normal(size=(4, 3, 5)).astype(np.float32)
    path2 = tmp_path / "four_d.nii"
    nib.save(nib.Nifti2Image(values[..., None], np.eye(4)), path2)
    on_disk = nib.load(path2)
    assert isinstance(on_disk, nib.Nifti2Image) and on_disk.header["sizeof_hdr"] == 540
    assert on_disk.shape == (4, 3, 5, 1)
    vol = read_nifti(path2)
    assert vol.shape == (4, 3, 5) and vol.dtype == np.float32
    assert np.array_equal(vol, values)
    path3 = tmp_path / "four_d.nii.gz"  # NIfTI-2 gzipped
    nib.save(nib.Nifti2Image(values[..., None], np.eye(4)), path3)
    assert np.array_equal(read_nifti(path3), values)


def test_big_endian_nifti_comes_back_in_native_byte_order(tmp_path):
    nib = pytest.importorskip("nibabel")
    vol = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    header = nib.Nifti1Header(endianness=">")
    header.set_data_dtype(np.int16)
    nib.save(nib.Nifti1Image(vol, np.eye(4), header=header), tmp_path / "be.nii")
    assert (tmp_path / "be.nii").read_bytes()[:4] == (348).to_bytes(4, "big")
    read = read_nifti(tmp_path / "be.nii")
    assert read.dtype.isnative and np.array_equal(read, vol)


def test_nifti_errors_name_the_file(tmp_path):
    path = write_nifti(tmp_path / "v.nii.gz", np.zeros((4, 4, 4), np.float32))
    data = gzip.decompress(path.read_bytes())
    (tmp_path / "short.nii").write_bytes(data[:500])
    with pytest.raises(DataError, match="truncated") as info:
        read_nifti(tmp_path / "short.nii")
    assert "short.nii" in str(info.value) and "fednorm data prepare prostate" in str(info.value)
    (tmp_path / "bad.nii.gz").write_bytes(path.read_bytes()[:30])
    with pytest.raises(DataError, match="bad.nii.gz"):
        read_nifti(tmp_path / "bad.nii.gz")
    (tmp_path / "text.nii").write_bytes(b"x" * 400)
    with pytest.raises(DataError, match="not a readable NIfTI-1 or NIfTI-2") as info:
        read_nifti(tmp_path / "text.nii")
    assert "text.nii" in str(info.value)
    with pytest.raises(DataError, match="missing") as info:
        read_nifti(tmp_path / "absent.nii.gz")
    assert "absent.nii.gz" in str(info.value) and "fednorm data prepare prostate" in str(info.value)


def test_truncated_or_corrupt_nifti_raises_data_error_naming_the_file(tmp_path):
    nib = pytest.importorskip("nibabel")
    vol = np.random.default_rng(3).normal(500, 100, (32, 32, 12)).astype(np.int16)
    good = tmp_path / "good.nii.gz"
    nib.save(nib.Nifti1Image(vol, np.eye(4)), good)
    assert np.array_equal(read_nifti(good), vol)
    compressed = good.read_bytes()
    for name, content in [("cut.nii.gz", compressed[: len(compressed) * 2 // 3]),  # cut in the voxels
                          ("no_trailer.nii.gz", compressed[:-4]),  # voxels complete, gzip length missing
                          ("cut.nii", gzip.decompress(compressed)[:-100])]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match="truncated") as info:
            read_nifti(tmp_path / name)
        assert str(tmp_path / name) in str(info.value) and "fednorm data prepare prostate" in str(info.value)
    # one flipped byte in the voxels' deflate stream: nibabel alone reads it without error (wrong voxels)
    flipped = bytearray(compressed)
    flipped[len(flipped) // 2] ^= 0x01
    (tmp_path / "flipped.nii.gz").write_bytes(bytes(flipped))
    with pytest.raises(DataError, match="corrupt") as info:
        read_nifti(tmp_path / "flipped.nii.gz")
    assert "flipped.nii.gz" in str(info.value)
    nib.save(nib.Nifti1Pair(vol, np.eye(4)), tmp_path / "pair.img")  # two files: .hdr + .img
    with pytest.raises(DataError, match="not a single-file NIfTI") as info:
        read_nifti(tmp_path / "pair.hdr")
    assert "pair.hdr" in str(info.value)


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


def test_negative_mask_labels_name_the_mask_file(tmp_path):
    raw = tmp_path / "raw"
    _site(raw, "UCL", [6])
    rng = np.random.default_rng(0)
    image, mask = _volume(rng, 6)
    bad = mask.astype(np.int16)
    bad[0, 0, 2] = -1
    write_nifti(raw / "UCL" / "Case00_segmentation.nii.gz", bad)
    with pytest.raises(DataError, match="negative labels") as info:
        prepare_prostate(tmp_path / "data", raw_dir=raw, download=False, harmofl_order=False, sites=("UCL",))
    message = str(info.value)
    assert str(raw / "UCL" / "Case00_segmentation.nii.gz") in message
    assert "fednorm data prepare prostate" in message and "liuquande.github.io/SAML" in message
    with pytest.raises(DataError, match="the mask of vol"):
        pro.volume_slices(image, bad, "vol", size=IJ)
