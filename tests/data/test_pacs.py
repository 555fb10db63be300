import math

import numpy as np
import pytest
import torch

from fednorm.data.domain import DataError
from fednorm.data.federation import build_clients, image_size, num_classes
from fednorm.data.pacs import PACS_DOMAINS, load_pacs_pool

from ..conftest import real_data_dir, write_data_folder


def fake_pacs(n=40, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {"classes": np.array(["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"])}
    for i, d in enumerate(PACS_DOMAINS):
        arrays[f"x_{d}"] = rng.integers(0, 256, (n + i, 64, 64, 3), dtype=np.uint8)
        arrays[f"y_{d}"] = (np.arange(n + i) % 7).astype(np.uint8)
    return arrays


def test_loads_a_domain_as_nchw_uint8(tmp_path):
    arrays = fake_pacs()
    folder = write_data_folder(tmp_path, {"pacs/pacs64.npz": arrays})
    x, y = load_pacs_pool("cartoon", folder)
    assert x.shape == (41, 3, 64, 64) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(x[5], torch.from_numpy(arrays["x_cartoon"][5]).permute(2, 0, 1))
    assert y.tolist() == (np.arange(41) % 7).tolist()


def test_federation_of_pacs_domains_has_seven_classes_and_stratified_clients(tmp_path):
    folder = write_data_folder(tmp_path, {"pacs/pacs64.npz": fake_pacs(n=70)})
    domains = [f"pacs/{d}" for d in PACS_DOMAINS]
    assert num_classes(domains) == 7 and image_size(domains) == 64
    clients = build_clients(domains, data_dir=folder, percent=1.0, pool_size=50)
    assert [c.name for c in clients] == domains
    for i, c in enumerate(clients):
        assert c.num_train == 50 and c.train.x.shape[1:] == (3, 64, 64)
        # stratified: the domain's 70 + i images, classes cycling; the test split is sklearn's ceil(0.2 n) images
        # (the official code's rounding: 14, 15, 15, 15), each class giving a fifth of its images rounded either way
        n = 70 + i
        per_class = np.bincount(np.arange(n) % 7)
        test = torch.bincount(c.test.y, minlength=7).numpy()
        assert test.sum() == math.ceil(0.2 * n) and (np.abs(test - 0.2 * per_class) < 1).all()
    with pytest.raises(ValueError, match="mix"):
        num_classes(["mnist", "pacs/photo"])


def test_corrupt_or_incomplete_file_names_the_file(tmp_path):
    arrays = fake_pacs()
    del arrays["y_sketch"]
    folder = write_data_folder(tmp_path, {"pacs/pacs64.npz": arrays})
    with pytest.raises(DataError, match="pacs64.npz"):
        load_pacs_pool("sketch", folder)
    (folder / "pacs" / "pacs64.npz").write_bytes(b"broken")
    with pytest.raises(DataError, match="pacs64.npz"):
        load_pacs_pool("photo", folder)


@pytest.mark.integration
def test_real_pacs_file_has_the_documented_domain_sizes():
    folder = real_data_dir()
    sizes = {d: len(load_pacs_pool(d, folder)[1]) for d in PACS_DOMAINS}
    assert sizes == {"art_painting": 2048, "cartoon": 2344, "photo": 1670, "sketch": 3929}
