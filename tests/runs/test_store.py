"""Run files are strict JSON: a diverged round's NaN loss is readable outside Python, and comes back as NaN."""

import json
import math

import pytest

from fednorm.runs import store


def strict_loads(text: str):
    """JSON as JavaScript, jq or Go read it: bare NaN / Infinity are errors."""
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


def test_a_diverged_rounds_nan_loss_is_written_as_null_and_read_back_as_nan(tmp_path):
    path = tmp_path / store.METRICS_FILE
    store.append_metrics(path, [
        {"round": 1, "client": "mnist", "split": "test", "acc": 0.9, "loss": 0.3, "n": 10, "metric": "accuracy"},
        {"round": 2, "client": "mnist", "split": "test", "acc": 0.1, "loss": math.nan, "n": 10, "metric": "accuracy",
         "diverged": True},
        {"round": 2, "client": "usps", "split": "train", "loss": math.inf, "steps": 3, "n": 10},
    ])
    lines = [strict_loads(line) for line in path.read_text().splitlines()]
    assert [line["loss"] for line in lines] == [0.3, None, None]
    records = store.read_metrics(path)
    assert records[0] == lines[0]  # finite records unchanged
    assert math.isnan(records[1]["loss"]) and records[1]["acc"] == 0.1 and records[1]["diverged"] is True
    assert math.isnan(records[2]["loss"])  # null does not say which: NaN for both, "not a number we can use"


def test_truncation_keeps_the_strict_form(tmp_path):
    path = tmp_path / store.METRICS_FILE
    store.append_metrics(path, [{"round": r, "client": "a", "split": "train", "loss": math.nan if r == 1 else 0.5}
                                for r in (1, 2, 3)])
    store.truncate_metrics(path, 2)
    assert [strict_loads(line)["loss"] for line in path.read_text().splitlines()] == [None, 0.5]


def test_metrics_files_written_before_strict_json_still_read(tmp_path):
    path = tmp_path / store.METRICS_FILE
    path.write_text('{"round": 1, "client": "a", "split": "test", "acc": 0.1, "loss": NaN}\n')
    [record] = store.read_metrics(path)
    assert math.isnan(record["loss"])


def test_summaries_and_nested_values_are_strict_json(tmp_path):
    summary = {"clients": [{"name": "a", "test": {"final_acc": 0.1, "final_loss": math.nan}}],
               "spread": (math.inf, -math.inf, 1.5), "mean_final_test_acc": 0.1}
    store.write_json(tmp_path / store.SUMMARY_FILE, summary)
    back = strict_loads((tmp_path / store.SUMMARY_FILE).read_text())
    assert back == {"clients": [{"name": "a", "test": {"final_acc": 0.1, "final_loss": None}}],
                    "spread": [None, None, 1.5], "mean_final_test_acc": 0.1}


def test_landscape_results_with_an_overflowed_loss_round_trip(tmp_path):
    from fednorm.diagnostics.landscape import RESULT_FILE, read_result, sharpness, save

    result = {"coords": [-1.0, 0.0, 1.0], "round": 3, "span": 1.0,
              "clients": {"a": [[9.0, 4.0, math.inf], [3.0, 1.0, 2.0], [5.0, 2.5, 6.0]]}}
    save(result, tmp_path)  # the plot leaves the overflowed corner blank
    assert (tmp_path / "landscape.png").stat().st_size > 0
    raw = strict_loads((tmp_path / RESULT_FILE).read_text())
    assert raw["clients"]["a"][0][2] is None
    back = read_result(tmp_path / RESULT_FILE)
    assert back["clients"]["a"][0][2] == math.inf and back["clients"]["a"][1] == [3.0, 1.0, 2.0]
    sharp = sharpness(back)["a"]  # the overflowed corner is a high point: not the minimum, and not flat
    assert sharp["centre"] == sharp["minimum"] == 1.0 and sharp["minimum_offset"] == 0.0
    assert sharp["mean_rise"] == math.inf


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_dumps_never_writes_a_bare_constant(value):
    assert strict_loads(store.dumps({"x": [value, {"y": value}]})) == {"x": [None, {"y": None}]}


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    """A kill or an error during a write leaves the previous file whole (resume reads it), never half a file."""
    path = tmp_path / "summary.json"
    path.write_text("old")

    def half_then_fail(fh):
        fh.write(b"half")
        raise ZeroDivisionError("stopped midway")

    with pytest.raises(ZeroDivisionError):
        store.atomic_write_bytes(path, half_then_fail)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    checkpoint = tmp_path / "checkpoint.pt"
    store.save_checkpoint(checkpoint, {"round": 1})

    class Unpicklable:
        def __reduce__(self):
            raise ZeroDivisionError("cannot pickle")

    with pytest.raises(ZeroDivisionError):
        store.save_checkpoint(checkpoint, {"round": 2, "bad": Unpicklable()})
    assert store.load_checkpoint(checkpoint)["round"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "summary.json"]


def test_a_damaged_line_is_skipped_alone_and_truncation_keeps_the_file_as_it_was(tmp_path):
    path = tmp_path / store.METRICS_FILE
    records = [{"round": r, "client": "a", "split": "train", "loss": 0.5} for r in (1, 2, 3, 4)]
    store.append_metrics(path, records)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + '{"round": 2, "cli\n' + lines[2] + "[1, 2]\n" + lines[3] + '{"round": 5, "c')
    original = path.read_text()
    # the records after a damaged line are read; a cut last line (a kill) is not damage
    assert store.read_metrics(path) == [records[0], records[2], records[3]]
    assert store.damaged_metric_lines(path) == [2, 4]
    backup = store.truncate_metrics(path, 3)
    assert backup == tmp_path / "metrics.damaged-1.jsonl" and backup.read_text() == original
    assert store.read_metrics(path) == [records[0], records[2]] and store.damaged_metric_lines(path) == []
    # an intact file (or one with only a cut last line) is rewritten without a copy; copies are never overwritten
    path.write_text(lines[0] + '{"round": 2, "c')
    assert store.truncate_metrics(path, 3) is None and store.read_metrics(path) == [records[0]]
    path.write_text("oops\n" + lines[0])
    assert store.truncate_metrics(path, 3) == tmp_path / "metrics.damaged-2.jsonl"
    assert backup.read_text() == original


def test_an_unreadable_checkpoint_names_the_way_on_for_a_finished_and_an_unfinished_cell(tmp_path):
    path = tmp_path / store.CHECKPOINT_FILE
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(store.CorruptFileError, match=r"unreadable .* delete it to train the cell again from round 0 "
                                                     r"on resume \(its metrics are kept aside\)$"):
        store.load_checkpoint(path)
    (tmp_path / store.SUMMARY_FILE).write_text("{}")
    with pytest.raises(store.CorruptFileError, match=r"delete it and the cell's summary.json to train the cell again"):
        store.load_checkpoint(path)
