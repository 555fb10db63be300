"""Fed-ISIC2019: FLamby's train_test_split CSV + JPGs (preprocessed folder, raw folder or raw zip)."""

from __future__ import annotations

import csv
import io
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from fednorm.data.domain import DataError
from fednorm.data.medical import ISIC_CENTERS, load_fed_isic2019, prepare_fed_isic2019
from fednorm.data.medical import isic2019 as isic

from .helpers import manifest, write_image

CLASSES = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC", "UNK"]


def _split_csv(root, per_center=(3, 1)):
    """FLamby's columns; per center ``per_center`` (train, test) images (or one such pair per center); returns the
    rows."""
    rows = []
    for c in range(6):
        for fold, n in zip(("train", "test"), per_center[c] if isinstance(per_center[0], tuple) else per_center):
            for k in range(n):
                target = (c + k) % 8
                onehot = ["1.0" if i == target else "0.0" for i in range(9)]
                suffix = "_downsampled" if c == 4 else ""
                rows.append([f"ISIC_{c}{fold[:2]}{k:04d}{suffix}", *onehot, target, c, fold, f"{fold}_{c}"])
    root.mkdir(parents=True, exist_ok=True)
    with (root / "train_test_split").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["image", *CLASSES, "target", "center", "fold", "fold2"])
        w.writerows(rows)
    return rows


def _shades_of_gray(img):
    """FLamby's color_constancy (Shades of Gray, power 6, gamma None), written out, clipped to uint8."""
    f = img.astype(np.float32)
    rgb = np.power(np.mean(np.power(f, 6), (0, 1)), 1 / 6)
    rgb = rgb / np.sqrt(np.sum(rgb ** 2.0))
    return np.clip(f * (1 / (rgb * np.sqrt(3))), 0, 255).astype(np.uint8)


def _images(folder, rows, shape):
    rng = np.random.default_rng(0)
    for r in rows:
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        write_image(folder / f"{r[0]}.jpg", img, quality=95)


def test_prepare_from_flamby_preprocessed_folder(tmp_path):
    raw = tmp_path / "raw"
    rows = _split_csv(raw)
    _images(raw / isic.PREPROCESSED_DIR, rows, (224, 260, 3))  # shorter side 224, as FLamby writes them
    data = tmp_path / "data"
    paths = prepare_fed_isic2019(data, raw_dir=raw, download=False, check_counts=False)
    assert [p.name for p in paths] == [f"{c}.npz" for c in ISIC_CENTERS]
    with np.load(data / "fed_isic2019" / "msk.npz") as f:
        assert f["x_train"].shape == (3, 224, 224, 3) and f["x_test"].shape == (1, 224, 224, 3)
        assert f["y_train"].tolist() == [4, 5, 6] and f["names_test"].tolist() == ["ISIC_4te0000_downsampled"]
        # FLamby's images already have short side 224: only the centre 224 x 224 is taken (columns 18..242 of 260)
        names = [r[0] for r in rows if r[-3] == 4 and r[-2] == "train"]
        for x, name in zip(f["x_train"], names, strict=True):
            img = np.asarray(Image.open(raw / isic.PREPROCESSED_DIR / f"{name}.jpg").convert("RGB"))
            assert np.array_equal(x, img[:, 18:242]), name
    assert "FLamby" in manifest(data)["fed_isic2019_bcn"]["source"]
    dom = load_fed_isic2019(0, data)
    assert dom.name == "fed_isic2019/bcn" and dom.num_classes == 8 and dom.val is None
    assert dom.train.x.shape == (3, 3, 224, 224) and dom.train.x.dtype == torch.uint8
    assert dom.train.y.dtype == torch.int64 and dom.test.y.tolist() == [0]
    with_val = load_fed_isic2019("rosendahl", data, val_fraction=0.34)
    assert (len(with_val.train), len(with_val.val)) == (2, 1)
    with pytest.raises(ValueError, match="center"):
        load_fed_isic2019(6, data)


def test_prepare_from_raw_folder_and_zip_applies_flamby_preprocessing(tmp_path):
    raw = tmp_path / "raw"
    rows = _split_csv(raw, per_center=(1, 1))
    _images(raw / isic.RAW_DIR, rows, (300, 450, 3))  # raw ISIC sizes vary; 300 x 450 -> 224 x 336
    prepare_fed_isic2019(tmp_path / "d1", raw_dir=raw, download=False, check_counts=False, centers=("bcn",))
    with np.load(tmp_path / "d1" / "fed_isic2019" / "bcn.npz") as f:
        x1 = f["x_train"]
    assert x1.shape == (1, 224, 224, 3)
    # FLamby's preprocessing by hand: short side to 224 (bilinear, 450 x 300 -> 336 x 224), colour constancy,
    # a JPEG save at PIL's default quality, then the centre 224 x 224 (columns 56..280)
    src = Image.open(raw / isic.RAW_DIR / f"{rows[0][0]}.jpg").convert("RGB")
    buf = io.BytesIO()
    Image.fromarray(_shades_of_gray(np.asarray(src.resize((336, 224), Image.BILINEAR)))).save(buf, format="JPEG")
    preprocessed = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert preprocessed.shape == (224, 336, 3)
    assert np.array_equal(x1[0], preprocessed[:, 56:280])

    raw2 = tmp_path / "raw2"
    _split_csv(raw2, per_center=(1, 1))
    with zipfile.ZipFile(raw2 / isic.ISIC_ZIP.filename, "w") as zf:
        for p in sorted((raw / isic.RAW_DIR).glob("*.jpg")):
            zf.write(p, f"{isic.RAW_DIR}/{p.name}")
    prepare_fed_isic2019(tmp_path / "d2", raw_dir=raw2, download=False, check_counts=False, centers=("bcn",), size=200)
    with np.load(tmp_path / "d2" / "fed_isic2019" / "bcn.npz") as f:
        assert f["x_train"].shape == (1, 200, 200, 3)
        assert np.array_equal(f["x_train"][0], preprocessed[12:212, 68:268])  # the centre 200 x 200


def test_flamby_truncated_short_side_still_gives_the_full_crop(tmp_path):
    """FLamby's int() resize gives 1024 x 767 a 223-px short side; the prepared image is still 224 x 224."""
    src = np.random.default_rng(1).integers(0, 256, (767, 1024, 3), dtype=np.uint8)
    assert isic.flamby_preprocess(src).shape == (223, 299, 3)
    raw = tmp_path / "raw"
    rows = _split_csv(raw, per_center=(1, 1))
    _images(raw / isic.RAW_DIR, rows, (767, 1024, 3))
    prepare_fed_isic2019(tmp_path / "d", raw_dir=raw, download=False, check_counts=False, centers=("bcn",))
    with np.load(tmp_path / "d" / "fed_isic2019" / "bcn.npz") as f:
        assert f["x_train"].shape == (1, 224, 224, 3)
    with pytest.raises(DataError, match="222 x 222, smaller than the 224 x 224"):
        isic.center_crop(np.zeros((222, 222, 3), np.uint8), 224, "x")


def test_color_constancy_is_flambys_formula_clipped():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 200, (20, 30, 3), dtype=np.uint8)
    assert np.array_equal(isic.color_constancy(img), _shades_of_gray(img))
    assert isic.color_constancy(np.zeros((4, 4, 3), np.uint8)).max() == 0


def test_split_file_checks_and_missing_files(tmp_path):
    raw = tmp_path / "raw"
    with pytest.raises(DataError, match="raw.githubusercontent.com/owkin/FLamby") as info:
        prepare_fed_isic2019(tmp_path / "data", raw_dir=raw, download=False)
    assert str(raw / "train_test_split") in str(info.value)
    rows = _split_csv(raw)
    with pytest.raises(DataError, match="does not hold FLamby's split"):
        prepare_fed_isic2019(tmp_path / "data", raw_dir=raw, download=False)
    with pytest.raises(DataError, match="ISIC_2019_Training_Input.zip") as info:
        prepare_fed_isic2019(tmp_path / "data", raw_dir=raw, download=False, check_counts=False)
    assert isic.PREPROCESSED_DIR in str(info.value)
    _images(raw / isic.PREPROCESSED_DIR, rows[:-1], (224, 224, 3))
    with pytest.raises(DataError, match="missing") as info:
        prepare_fed_isic2019(tmp_path / "data", raw_dir=raw, download=False, check_counts=False)
    assert rows[-1][0] in str(info.value)
    _images(raw / isic.PREPROCESSED_DIR, rows[-1:], (100, 224, 3))
    with pytest.raises(DataError, match="smaller than"):
        prepare_fed_isic2019(tmp_path / "data", raw_dir=raw, download=False, check_counts=False)
    text = (raw / "train_test_split").read_text().replace(",train,train_0", ",train,train_3", 1)
    (raw / "train_test_split").write_text(text)
    with pytest.raises(DataError, match="fold2"):
        prepare_fed_isic2019(tmp_path / "data", raw_dir=raw, download=False, check_counts=False)


def test_a_split_with_the_papers_per_center_counts_is_accepted_and_one_image_moved_is_refused(tmp_path):
    # FedWon App. B.1 (FLamby's Fed-ISIC2019): center, train, test, in FLamby's center order
    paper = [("bcn", 9930, 2483), ("vidir_molemax", 3163, 791), ("vidir_modern", 2691, 672),
             ("rosendahl", 1807, 452), ("msk", 655, 164), ("vienna_dias", 351, 88)]
    _split_csv(tmp_path, [(train, test) for _, train, test in paper])
    rows = isic.read_split_csv(tmp_path / "train_test_split")
    assert len(rows) == 23247  # the paper's total
    assert list(isic.ISIC_CENTERS) == [name for name, _, _ in paper]
    for c, (_, train, test) in enumerate(paper):
        assert sum(r["center"] == c and r["fold"] == "train" for r in rows) == train
        assert sum(r["center"] == c and r["fold"] == "test" for r in rows) == test
    text = (tmp_path / "train_test_split").read_text().replace(",test,test_5", ",train,train_5", 1)
    (tmp_path / "train_test_split").write_text(text)
    with pytest.raises(DataError, match=r"does not hold FLamby's split: .* 5: \(352, 87\)"):
        isic.read_split_csv(tmp_path / "train_test_split")
