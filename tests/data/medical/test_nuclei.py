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


def _monuseg_xml(x0, y0, x1, y1):
    """One rectangle nucleus in the official MoNuSeg 2018 annotation format (Aperio ImageScope XML: the
    attribute headers, region attributes and Z coordinates of the released files)."""
    vertices = "".join(f'<Vertex X="{x}" Y="{y}" Z="0"/>\n' for x, y in ((x0, y0), (x1, y0), (x1, y1), (x0, y1)))
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<Annotations MicronsPerPixel="0.252100">\n'
            '<Annotation Id="1" Name="" ReadOnly="0" NameReadOnly="0" LineColorReadOnly="0" Incremental="0" Type="4" '
            'LineColor="65280" Visible="1" Selected="1" MarkupImagePath="" MacroName="">\n'
            '<Attributes>\n<Attribute Name="Description" Id="0" Value=""/>\n</Attributes>\n<Regions>\n'
            '<RegionAttributeHeaders>\n<AttributeHeader Id="9999" Name="Region" ColumnWidth="-1"/>\n'
            '<AttributeHeader Id="9997" Name="Length" ColumnWidth="-1"/>\n</RegionAttributeHeaders>\n'
            '<Region Id="1" Type="0" Zoom="0.5" Selected="0" ImageLocation="" ImageFocus="-1" Length="40.0" '
            'Area="96.0" LengthMicrons="10.1" AreaMicrons="6.1" Text="" NegativeROA="0" InputRegionId="0" Analyze="1" '
            f'DisplayId="1">\n<Attributes/>\n<Vertices>\n{vertices}</Vertices>\n</Region>\n</Regions>\n<Plots/>\n'
            '</Annotation>\n</Annotations>\n')


def test_monuseg_official_zips_are_read_as_extracted(tmp_path):
    """MoNuSeg 2018's two official zips unzipped as they are into raw/monuseg2018: the training zip's
    'MoNuSeg 2018 Training Data/Tissue Images/<name>.tif' + 'Annotations/<name>.xml' is the train split,
    the test zip's 'MoNuSegTestData/<name>.tif' beside '<name>.xml' the test split."""
    from PIL import Image

    rng = np.random.default_rng(3)
    client = tmp_path / "raw" / "monuseg2018"
    train_dir, test_dir = client / "MoNuSeg 2018 Training Data", client / "MoNuSegTestData"
    h, w = 48, 64
    expected = {}  # name -> (image, full-resolution 0/1 mask of its own rectangle)

    def sample(image_path, xml_path, k):
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        write_image(image_path, img)  # a real TIFF (PIL), as the official RGB .tif tissue images
        x0, y0, x1, y1 = 4 + 6 * k, 8 + 2 * k, 14 + 6 * k, 20 + 2 * k  # each image its own nucleus
        xml_path.parent.mkdir(parents=True, exist_ok=True)
        xml_path.write_text(_monuseg_xml(x0, y0, x1, y1))
        mask = np.zeros((h, w), np.uint8)
        mask[y0:y1 + 1, x0:x1 + 1] = 1
        expected[image_path.name] = (img, mask)

    train_names = [f"TCGA-A{k}-01Z-00-DX1.tif" for k in range(5)]
    test_names = [f"TCGA-T{k}-01Z-00-DX1.tif" for k in range(2)]
    for k, name in enumerate(train_names):
        stem = name[:-4]
        sample(train_dir / "Tissue Images" / name, train_dir / "Annotations" / f"{stem}.xml", k)
    for k, name in enumerate(test_names):
        sample(test_dir / name, test_dir / f"{name[:-4]}.xml", k + 5)
    data = tmp_path / "data"
    prepare_nuclei(data, raw_dir=tmp_path / "raw", download=False, clients=("monuseg2018",))

    with np.load(data / "nuclei" / "monuseg2018.npz") as f:
        assert f["names_train"].tolist() == train_names and f["names_test"].tolist() == test_names
        assert f["x_train"].shape == (5, 256, 256, 3) and f["x_test"].shape == (2, 256, 256, 3)
        for split in ("train", "test"):
            for name, x, y in zip(f[f"names_{split}"], f[f"x_{split}"], f[f"y_{split}"]):
                img, mask = expected[str(name)]
                assert np.array_equal(x, np.asarray(Image.fromarray(img).resize((256, 256), Image.BILINEAR))), name
                want = np.asarray(Image.fromarray(mask).resize((256, 256), Image.NEAREST))
                assert want.sum() > 0 and np.array_equal(y, want), name  # the polygon filled, nothing else
    dom = load_nuclei("monuseg2018", data)
    assert (len(dom.train) + len(dom.val), len(dom.test)) == (5, 2) and len(dom.val) == 1
    for k, y in enumerate(dom.test.y):  # the test split is MoNuSegTestData's, masks nonzero inside the polygons
        x0, y0 = 4 + 6 * (k + 5), 8 + 2 * (k + 5)
        row, col = int((y0 + 5) * 256 / h), int((x0 + 5) * 256 / w)
        assert y[row, col] == 1 and y[5, 5] == 0 and y.sum() > 0
    assert manifest(data)["nuclei_monuseg2018"]["file"] == "nuclei/monuseg2018.npz"


def test_monuseg_layout_errors_say_what_to_do(tmp_path):
    rng = np.random.default_rng(4)
    client = tmp_path / "raw" / "monuseg2018"
    (client / "MoNuSeg2018TrainingData").mkdir(parents=True)  # a misnamed folder: no accepted layout
    with pytest.raises(DataError, match="No nuclei layout was found") as info:
        prepare_nuclei(tmp_path / "data", raw_dir=tmp_path / "raw", download=False, clients=("monuseg2018",))
    msg = str(info.value)
    assert str(client) in msg and "MoNuSeg 2018 Training Data/Tissue Images/<name>.tif" in msg
    assert "MoNuSegTestData/<name>.xml" in msg and "unzip the official MoNuSeg 2018 training and test zips" in msg
    assert "fednorm data prepare nuclei --domains monuseg2018" in msg and "'train/'" in msg and "'masks/'" in msg
    (client / "MoNuSeg2018TrainingData").rmdir()
    test_dir = client / "MoNuSegTestData"
    write_image(test_dir / "T0.tif", rng.integers(0, 256, (8, 8, 3)))
    (test_dir / "T0.xml").write_text(XML)
    with pytest.raises(DataError, match="no training folder") as info:  # only the test zip unzipped
        prepare_nuclei(tmp_path / "data", raw_dir=tmp_path / "raw", download=False, clients=("monuseg2018",))
    assert "MoNuSeg 2018 Training Data/" in str(info.value)
    train = client / "MoNuSeg 2018 Training Data"
    write_image(train / "Tissue Images" / "A.tif", rng.integers(0, 256, (48, 64, 3)))
    (train / "Annotations").mkdir()
    with pytest.raises(DataError, match="has no mask") as info:
        prepare_nuclei(tmp_path / "data", raw_dir=tmp_path / "raw", download=False, clients=("monuseg2018",))
    assert str(train / "Tissue Images" / "A.tif") in str(info.value) and "A.xml" in str(info.value)
    assert "unzip the official zips" in str(info.value)
    (train / "Annotations" / "A.xml").write_text(XML)
    (train / "Annotations" / "B.xml").write_text(XML)  # an annotation without its image
    with pytest.raises(DataError, match="has no image") as info:
        prepare_nuclei(tmp_path / "data", raw_dir=tmp_path / "raw", download=False, clients=("monuseg2018",))
    assert str(train / "Annotations" / "B.xml") in str(info.value) and "Tissue Images" in str(info.value)
    (train / "Annotations" / "B.xml").unlink()
    (test_dir / "T0.xml").unlink()  # an image of MoNuSegTestData without its annotation beside it
    (test_dir / "T1.xml").write_text(XML)
    with pytest.raises(DataError, match="has no mask") as info:
        prepare_nuclei(tmp_path / "data", raw_dir=tmp_path / "raw", download=False, clients=("monuseg2018",))
    assert str(test_dir / "T0.tif") in str(info.value) and str(test_dir / "T0.xml") in str(info.value)
    (test_dir / "T0.xml").write_text(XML)
    (test_dir / "T1.xml").unlink()
    prepare_nuclei(tmp_path / "data", raw_dir=tmp_path / "raw", download=False, clients=("monuseg2018",))
    dom = load_nuclei("monuseg2018", tmp_path / "data", val_fraction=0.0)
    assert (len(dom.train), len(dom.test)) == (1, 1)


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
