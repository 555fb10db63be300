"""benchmarks/unifed_table.py (the UniFed tables beside the paper's): its columns and folds for both corrupted
benchmarks, so a fold of the released CIFAR-10-C does not stop `benchmarks/unifed.sh` after its first run, and
the numbers of its tables (internal mean, seeds, the add-on's gain, Table III's type means)."""

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


def _cell(run, method, seed, scores):
    """A finished cell's summary.json: ``scores`` maps client name -> final test accuracy; ':' marks an external."""
    import json

    clients = [{"name": name, "test": {"final_acc": acc}, **({"external": True} if ":" in name else {})}
               for name, acc in scores.items()]
    folder = run / method / f"seed{seed}"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"method": method, "seed": seed, "clients": clients}))


def test_the_table_averages_internal_clients_then_seeds_and_the_gain_is_by_seed(table, tmp_path, monkeypatch,
                                                                               capsys):
    fog = "corrupt/fog/3/mnistm:global"
    for seed, run, plain, ours in ((0, tmp_path / "s0", (0.5, 0.7, 0.3), (0.9, 0.9, 0.5)),
                                   (1, tmp_path / "s1", (0.8, 0.9, 0.4), (0.8, 1.0, 0.6))):
        _cell(run, "fedavg", seed, dict(zip(("a", "b", fog), plain)))
        _cell(run, "fedavg+ours", seed, dict(zip(("a", "b", fog), ours)))
    monkeypatch.setattr("sys.argv", ["unifed_table.py", str(tmp_path / "s0"), str(tmp_path / "s1"), "--gain"])
    table.main()
    out = capsys.readouterr().out
    # internal: the mean over internal clients per seed (0.60, 0.85), then over seeds; externals likewise
    assert "| method | internal | fog:global |" in out
    assert "| fedavg | 72.50 | 35.00 |" in out and "| fedavg+ours | 90.00 | 55.00 |" in out
    # the gain seed by seed (+30, +5): mean (sample std)
    assert "| fedavg | 0, 1 | 72.50 (17.68) | 90.00 (0.00) | +17.50 (17.68) | +30.00 / +5.00 |" in out
    # UniFed Table III's means over the noise columns (N1-N3) for FedAvg: global and +Ours
    global_mean, ours_mean = table.paper_type_means("noise")["fedavg"]
    assert global_mean == pytest.approx((58.30 + 71.09 + 30.46) / 3)
    assert ours_mean == pytest.approx((92.99 + 94.20 + 79.68) / 3)
