"""What data a Flower node needs: the files of the clients it holds, and no other domain's."""

import numpy as np
import pytest
import torch

from fednorm.data.domain import DataError
from fednorm.engines.flower.node import _client_at
from fednorm.runs.runner import build_federation_data

from ...conftest import write_data_folder
from .conftest import tiny_config


def _digits(rng, n, side):
    return {"x_train": rng.integers(0, 256, size=(n, side, side), dtype=np.uint8),
            "y_train": rng.integers(0, 10, size=n).astype(np.uint8),
            "x_test": rng.integers(0, 256, size=(n // 2, side, side), dtype=np.uint8),
            "y_test": rng.integers(0, 10, size=n // 2).astype(np.uint8)}


def test_a_node_holding_only_an_external_client_needs_only_its_domain_file(tmp_path):
    rng = np.random.default_rng(0)
    files = {"digits/mnist.npz": _digits(rng, 120, 28), "digits/usps.npz": _digits(rng, 120, 16)}
    full = write_data_folder(tmp_path / "full", files)
    only_usps = write_data_folder(tmp_path / "node", {"digits/usps.npz": files["digits/usps.npz"]})
    config = tiny_config("data.domains=[mnist]", "external.domains=[usps]", "data.clients_per_domain=1",
                         "data.percent=1.0", "data.pool_size=100")
    external = _client_at(config, 1, str(only_usps))  # index 1: after the one internal client
    assert external.name == "usps" and external.meta.get("external")
    # the same client as the whole federation builds from the complete folder
    expected = build_federation_data(config, full)[1]
    assert torch.equal(external.test.x, expected.test.x) and torch.equal(external.test.y, expected.test.y)
    # the internal client does need its own file
    with pytest.raises(DataError, match="mnist"):
        _client_at(config, 0, str(only_usps))


def test_a_node_config_is_read_and_a_bad_value_named():
    from fednorm.engines.flower.node import NodeConfigError, NodeSpec

    spec = NodeSpec.from_node_config({"client-index": "0,2", "state-dir": "/s", "share-labels": "False"})
    assert (spec.indexes, spec.state_dir, spec.share_labels) == ((0, 2), "/s", False)
    assert NodeSpec.from_node_config({"partition-id": 1, "num-partitions": 2}).share_labels is True
    with pytest.raises(NodeConfigError, match="share-labels='maybe' must be true or false"):
        NodeSpec.from_node_config({"client-index": 0, "share-labels": "maybe"})
    with pytest.raises(NodeConfigError, match="client-index='x' must be an integer"):
        NodeSpec.from_node_config({"client-index": "x"})
    with pytest.raises(NodeConfigError, match="does not say which clients it holds"):
        NodeSpec.from_node_config({"data-dir": "/d"})
