"""Nuclei segmentation: the documented folder layout (mask images or MoNuSeg XML) and TNBC's release."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch

from fednorm.data.domain import DataError
from fednorm.data.medical import load_nuclei, prepare_nuclei
from fednorm.data.medical import nuclei as nuc

from .helpers import manifest, write_image

XML = """<?xml version="1.0"?>
<Annotations><Annotation Id="1"><Regions>
<Region Id="1"><Vertices><Vertex X="10" Y="10"/><Vertex X="30" Y="10"/><Vertex X="30" Y="20"/><Vertex X="10" Y="20"/></Vertices></Region>
<Region Id="2"><Vertices><Vertex X="40.5" Y="5"/><Vertex X="50" Y="5"/><Vertex X="50" Y="15"/></Vertices></Region>
</Regions></Annotation></Annotations>
"""


def _pair(folder, name, rng, h=48, w=64, xml=False):
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    write_image(folder / "images" / f"{name}.tif", img)
    if xml:
        (folder / "masks").mkdir(parents=True, exist_ok=True)
        (folder / "masks" / f"{name}.xml").write_text(XML)
    else:
        mask = np.zeros((h, w), np.uint8)
        mask[5:20, 8:30] = 255  # instance/0-255 masks are binarized
        write_image(folder / "masks" / f"{name}.png", mask)
    return img


def test_documented_layout_with_png_and_xml_masks(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    raw = tmp_path / "raw"
    train_images = [_pair(raw / "monuseg2018" / "train", f"TCGA-{i:02d}", rng, xml=True) for i in range(10)]
    for i in range(3):
        _pair(raw / "monuseg2018" / "test", f"TCGA-T{i}", rng, xml=True)
    for i in range(5):
        _pair(raw / "monusac2020_lung" / "train", f"L{i}", rng)
    data = tmp_path / "data"
    prepare_nuclei(data, raw_dir=raw, download=False, clients=("monuseg2018", "monusac2020_lung"))
    with np.load(data / "nuclei" / "monuseg2018.npz") as f:
        assert f["x_train"].shape == (10, 256, 256, 3) and f["y_train"].shape == (10, 256, 256)
        assert f["x_test"].shape == (3, 256, 256, 3)
        assert f["names_test"].tolist() == [f"TCGA-T{i}.tif" for i in range(3)]
        assert f["names_train"].tolist() == [f"TCGA-{i:02d}.tif" for i in range(10)]
        for x, img in zip(f["x_train"], train_images):  # each image itself, bilinear to 256 x 256
            assert np.array_equal(x, np.asarray(Image.fromarray(img).resize((256, 256), Image.BILINEAR)))
        assert set(np.unique(f["y_train"])) == {0, 1}
        # the rectangle X 10..30, Y 10..20 of a 64 x 48 image, scaled to 256 x 256
        assert f["y_train"][0, 60, 80] == 1 and f["y_train"][0, 200, 80] == 0
    assert manifest(data)["nuclei_monuseg2018"]["file"] == "nuclei/monuseg2018.npz"
    dom = load_nuclei("monuseg2018", data)
    assert (len(dom.train), len(dom.val), len(dom.test)) == (8, 2, 3)
    assert dom.train.x.shape[1:] == (3, 256, 256) and dom.train.y.dtype == torch.uint8 and dom.num_classes == 2
    lung = load_nuclei("monusac2020_lung", data)  # no test/ folder: a seeded 20 % held out
    assert len(lung.train) + len(lung.val) + len(lung.test) == 5 and len(lung.test) == 1


def test_rasterize_xml_fills_every_region():
    mask = nuc.rasterize_xml(XML.encode(), 48, 64, "test.xml")
    assert mask.shape == (48, 64) and mask[15, 20] == 1 and mask[6, 49] == 1 and mask[40, 5] == 0
    with pytest.raises(DataError, match="no Region"):
        nuc.rasterize_xml(b"<Annotations/>", 4, 4, "empty.xml")
    with pytest.raises(DataError, match="Cannot parse"):
        nuc.rasterize_xml(b"<Annotations>", 4, 4, "broken.xml")


def test_tnbc_release_zip_and_folders(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    staging = tmp_path / "TNBC_NucleiSegmentation"
    images = {}
    for slide in (1, 2):
        for k in range(5):
            img = rng.integers(0, 256, (32, 32, 4), dtype=np.uint8)  # TNBC slides are RGBA PNGs
            img[..., 3] = 255
            images[f"{slide:02d}_{k}.png"] = img[..., :3]
            write_image(staging / f"Slide_{slide:02d}" / f"{slide:02d}_{k}.png", img)
            mask = np.zeros((32, 32), np.uint8)
            mask[k:k + 8, 4:12] = 255
            write_image(staging / f"GT_{slide:02d}" / f"{slide:02d}_{k}.png", mask)
    raw = tmp_path / "raw"
    raw.mkdir()
    with zipfile.ZipFile(raw / "TNBC_NucleiSegmentation.zip", "w") as zf:
        for p in sorted(staging.rglob("*.png")):
            zf.write(p, p.relative_to(tmp_path).as_posix())
        # what macOS's Archive Utility adds: AppleDouble files that match Slide_nn/*.png but are not PNGs
        zf.writestr("__MACOSX/TNBC_NucleiSegmentation/Slide_01/._01_0.png", b"\x00\x05\x16\x07")
        zf.writestr("TNBC_NucleiSegmentation/Slide_02/._02_1.png", b"\x00\x05\x16\x07")
    data = tmp_path / "data"
    prepare_nuclei(data, raw_dir=raw, download=False, clients=("tnbc",))
    with np.load(data / "nuclei" / "tnbc.npz") as f:
        assert f["x_train"].shape == (8, 256, 256, 3) and f["x_test"].shape == (2, 256, 256, 3)
        names = set(f["names_train"].tolist()) | set(f["names_test"].tolist())
        assert len(names) == 10 and all("Slide_" in n for n in names)
        # each image with its own GT mask: the image bilinear to 256 x 256, the mask (rows k..k+8, columns 4..12
        # of 32 x 32) nearest-neighbour, i.e. each pixel an 8 x 8 block
        for split in ("train", "test"):
            for name, x, y in zip(f[f"names_{split}"], f[f"x_{split}"], f[f"y_{split}"]):
                base = str(name).rsplit("/", 1)[-1]
                k = int(base[3])
                want_x = np.asarray(Image.fromarray(images[base]).resize((256, 256), Image.BILINEAR))
                want_y = np.zeros((256, 256), np.uint8)
                want_y[8 * k: 8 * k + 64, 32:96] = 1
                assert np.array_equal(x, want_x) and np.array_equal(y, want_y), name
    assert "zenodo" in manifest(data)["nuclei_tnbc"]["source"]
    # the unzipped folders give the same arrays
    staging.rename(raw / "tnbc")
    prepare_nuclei(tmp_path / "data2", raw_dir=raw, download=False, clients=("tnbc",))
    with np.load(data / "nuclei" / "tnbc.npz") as a, np.load(tmp_path / "data2" / "nuclei" / "tnbc.npz") as b:
        assert np.array_equal(a["y_train"], b["y_train"]) and np.array_equal(a["x_test"], b["x_test"])


def test_missing_and_corrupt_files(tmp_path):
    raw = tmp_path / "raw"
    with pytest.raises(DataError, match="registration") as info:
        prepare_nuclei(tmp_path / "data", raw_dir=raw, download=False, clients=("monusac2020_breast",))
    assert str(raw / "monusac2020_breast") in str(info.value) and "NucSeg" in str(info.value)
    with pytest.raises(DataError, match="zenodo.org/record/1175282"):
        prepare_nuclei(tmp_path / "data", raw_dir=raw, download=False, clients=("tnbc",))
    rng = np.random.default_rng(2)
    _pair(raw / "monuseg2018" / "train", "a", rng)
    write_image(raw / "monuseg2018" / "train" / "images" / "b.png", np.zeros((8, 8, 3)))
    with pytest.raises(DataError, match="has no mask"):
        prepare_nuclei(tmp_path / "data", raw_dir=raw, download=False, clients=("monuseg2018",))
    write_image(raw / "monuseg2018" / "train" / "masks" / "b.png", np.zeros((8, 9)))
    with pytest.raises(DataError, match="mask of"):
        prepare_nuclei(tmp_path / "data", raw_dir=raw, download=False, clients=("monuseg2018",))
    (raw / "monuseg2018" / "train" / "images" / "b.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="Cannot decode"):
        prepare_nuclei(tmp_path / "data", raw_dir=raw, download=False, clients=("monuseg2018",))
    with pytest.raises(ValueError, match="nuclei client"):
        load_nuclei("monusac", tmp_path / "data")
