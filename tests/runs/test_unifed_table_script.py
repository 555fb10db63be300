"""benchmarks/unifed_table.py (the UniFed tables beside the paper's): its columns and folds for both corrupted
benchmarks, so a fold of the released CIFAR-10-C does not stop `benchmarks/unifed.sh` after its first run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "unifed_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("unifed_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corruption_columns_and_held_out_types_of_both_benchmarks(table):
    assert table.column_name("corrupt/fog/3/mnistm:global") == "fog:global"
    assert table.column_name("cifar10c/fog/3:test_time_bn") == "fog:test_time_bn"
    assert table.column_name("cifar10c/zoom_blur/5") == "zoom_blur"
    assert table.column_name("mnist") == "mnist"
    for names in (["corrupt/gaussian_noise/3/mnistm", "corrupt/shot_noise/3/mnistm", "corrupt/impulse_noise/3/mnistm"],
                  ["cifar10c/gaussian_noise/3", "cifar10c/shot_noise/3", "cifar10c/impulse_noise/3"]):
        assert table.held_out_type([f"{n}:{mode}" for n in names for mode in ("global", "test_time_bn")]) == "noise"
    with pytest.raises(SystemExit, match="leave-one-corruption-type-out"):
        table.held_out_type(["cifar10c/fog/3:global"])
