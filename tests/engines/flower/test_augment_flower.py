"""training.augment on Flower nodes: the client seed travels in the round's instructions, so the nodes augment their
training batches exactly as the in-process engine does (HarmoFL's amplitude included)."""

from .conftest import tiny_config
from .test_equivalence import in_process_and_flower, metrics


def test_augmented_training_on_flower_nodes_gives_the_in_process_numbers(tmp_path):
    config = tiny_config("methods=[fedbn, harmofl]", "training.augment=fedbn_objects", "federation.rounds=2",
                         "federation.eval_every=1")
    nodes = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    in_process_and_flower(tmp_path, config, nodes)
    assert metrics(tmp_path / "flower", config) == metrics(tmp_path / "in_process", config)


def test_augmented_validation_on_flower_nodes_gives_the_in_process_numbers(tmp_path):
    """training.augment_validation: each evaluation's draws come from the run seed, the rounds completed and the
    client's name, so a node scores its client's augmented validation images as the in-process engine does."""
    config = tiny_config("methods=[fedbn]", "training.augment=fedbn_objects", "training.augment_validation=true",
                         "data.val_fraction=0.25", "federation.rounds=2", "federation.eval_every=1")
    nodes = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    in_process_and_flower(tmp_path, config, nodes)
    records = metrics(tmp_path / "flower", config)
    assert records == metrics(tmp_path / "in_process", config)
    assert any(r.get("split") == "val" for r in records["fedbn"])
