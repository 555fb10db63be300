"""The on-disk layout of a run, written so that nothing computed is lost.

```
RUN_DIR/
  config.yaml                 resolved experiment config
  run.json, partitions.json   where and how it ran (its sessions: each run or resume that trained, its host, CPU
                              kernels and threads, each cell's starting round); what every client holds (checked on resume)
  .lock                       held by the process running it (a second run or resume is refused)
  results.md, results.json    the comparison table (methods x clients, mean (std) over seeds)
  comparison.png              average test accuracy and training loss over rounds, one line per method
  diagnostics.png             drift and gradient dissimilarity per round (runs with diagnostics on)
  flower.json                 which Flower nodes held which client (Flower runs)
  unifed_ablation{,_selected}.{json,md,png}  `fednorm external-ablation`'s test-time BN grid
  rescore_bn.{json,md}        `fednorm rescore`: BN statistics as stored and recomputed
  <method>/seed<k>/
    metrics.jsonl             one line per round per client and split
    checkpoint.pt             engine state after the last completed round (atomic replace)
    selected.pt               engine state at the round of the best mean validation score (runs with validation
                              data; written with the checkpoint, so both belong to one history)
    summary.json              final and best per-client metrics (written when the cell ends)
    summary.damaged-<k>.json  a summary.json a resume found damaged (the resume writes the summary again)
    metrics.no-checkpoint-<k>.jsonl  metrics of a history whose checkpoint was gone on resume (the cell trained
                              again from round 0; kept, never overwritten)
    metrics.damaged-<k>.jsonl  metrics.jsonl as it was on a resume that found damaged lines in it (the resumed file
                              leaves them out; kept, never overwritten)
    accuracy.png, loss.png    per-client curves
    drift.png, dissimilarity.png  per-client drift and gradient dissimilarity (diagnostics on)
    landscape[-span<s>].{json,png}  loss-landscape slice (diagnostics.landscape, `fednorm landscape`)
    participation.jsonl       per round, which clients replied (Flower runs)
```
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.pt"
SELECTED_FILE = "selected.pt"
SUMMARY_FILE = "summary.json"
# written by the Flower engine only: which nodes held which client (at the end), and per round who took part
FLOWER_INFO_FILE = "flower.json"
PARTICIPATION_FILE = "participation.jsonl"


def cell_dir(run_dir: Path, label: str, seed: int) -> Path:
    return Path(run_dir) / label / f"seed{seed}"


_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: os.umask can only be read by setting it


def atomic_write_bytes(path: Path, write) -> None:
    """Write through a temporary file and rename, so a kill leaves the old or the new file, never half."""
    # a name of its own per write: two processes writing one file never rename each other's half-written file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; run files are read by others as any file written here
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: Path, state: dict) -> None:
    atomic_write_bytes(path, lambda fh: torch.save(state, fh))


class CorruptFileError(RuntimeError):
    """A file of a run folder cannot be read back; the message names it and what to do."""


def read_json(path: Path, remedy: str):
    """A JSON file of a run folder; a damaged one (not JSON) is a CorruptFileError naming it and ``remedy``."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFileError(f"{path} is damaged (not JSON: {exc}); {remedy}") from None


def load_checkpoint(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint gets the same advice
        finished = (path.parent / SUMMARY_FILE).exists()
        raise CorruptFileError(
            f"checkpoint {path} is unreadable ({exc}); restore it (e.g. from a copy of the run folder), or delete it"
            + (f" and the cell's {SUMMARY_FILE} to train the cell again from round 0 on resume (its metrics are kept "
               "aside; with its summary kept the cell stays finished, but nothing can score or extend it)"
               if finished else " to train the cell again from round 0 on resume (its metrics are kept aside)")
        ) from exc


def finite_or_null(obj):
    """``obj`` with every non-finite float (the loss of a diverged round, an overflowed score) replaced by None.

    JSON has no NaN or Infinity: Python's ``json`` writes them as bare ``NaN``, which JavaScript, jq and most
    other languages' parsers reject. Run files hold ``null`` instead; :func:`read_metrics` turns a metric record's
    nulls back into NaN (its values are all numbers or names, so a null can only have been a non-finite float)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    """Strict JSON (see :func:`finite_or_null`): every file of a run folder is readable outside Python too."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kwargs)


def append_metrics(path: Path, records: list[dict]) -> None:
    with open(path, "a") as fh:
        for rec in records:
            fh.write(dumps(rec) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _metric_lines(path: Path) -> tuple[list[dict], list[int]]:
    """The records of a metrics file, and the (1-based) numbers of its lines that are not JSON records, other than
    a last line cut by a kill (appends are whole lines, fsynced: only the last can be cut short)."""
    if not path.exists():
        return [], []
    records, damaged = [], []
    lines = path.read_text(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)  # (bare NaN too: files written before 2026-11-26 have it)
            if not isinstance(record, dict) or "round" not in record:
                raise ValueError("not a metrics record")
        except ValueError:  # json.JSONDecodeError is a ValueError
            if i != last:
                damaged.append(i + 1)
            continue  # only this line is lost, not the records after it
        records.append({k: math.nan if v is None else v for k, v in record.items()})
    return records, damaged


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics file; a line that is not a record (a kill's cut last line, or damage) is skipped
    (:func:`truncate_metrics` keeps a copy of a damaged file before it rewrites it)."""
    return _metric_lines(path)[0]


def truncate_metrics(path: Path, last_round: int) -> Path | None:
    """Keep only the records of rounds <= ``last_round`` (the checkpoint's), dropping a partial tail. A file with
    damaged lines (not JSON records, other than a cut last line) is first copied to ``metrics.damaged-<k>.jsonl``
    beside it (never overwritten), whose path is returned: the rewrite leaves those lines out."""
    records, damaged = _metric_lines(path)
    backup = None
    if damaged:
        stem, suffix = path.name.split(".", 1)[0], "".join(path.suffixes)
        k = 1
        while (backup := path.with_name(f"{stem}.damaged-{k}{suffix}")).exists():
            k += 1
        shutil.copy2(path, backup)
    kept = [r for r in records if r["round"] <= last_round]
    atomic_write_bytes(path, lambda fh: fh.write("".join(dumps(r) + "\n" for r in kept).encode()))
    return backup


def external_clients(cell: Path) -> set[str]:
    """The external (never trained) client entries of a finished cell, as its summary names them (a cell without
    a summary yet: none known)."""
    path = cell / SUMMARY_FILE
    if not path.exists():
        return set()
    return {e["name"] for e in json.loads(path.read_text())["clients"] if e.get("external")}


def damaged_metric_lines(path: Path) -> list[int]:
    """The numbers of a metrics file's damaged lines (see :func:`truncate_metrics`)."""
    return _metric_lines(path)[1]


def write_json(path: Path, data) -> None:
    atomic_write_bytes(path, lambda fh: fh.write(dumps(data, indent=2).encode()))


def write_text(path: Path, text: str) -> None:
    """A text file (config.yaml) written atomically: a kill leaves the old or the new one, never a cut-off one."""
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))
