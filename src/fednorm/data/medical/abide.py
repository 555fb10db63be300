"""ABIDE I functional connectomes as four site domains: FedBN's real-world non-image benchmark.

FedBN (Sec. 5.2, App. D) uses the rs-fMRI ROI time series of the four largest ABIDE I sites from
the Preprocessed Connectomes Project (CPAC pipeline, Harvard-Oxford atlas), sliding windows of 32
frames (stride 1) as augmentation, and one 5,995-dimensional connectome vector per window
(5995 = 110 * 109 / 2), ASD vs control. The paper states neither the connectivity estimator nor
the split; its first author's earlier code (xxlya/Fed_ABIDE, ``preprocess/``) does, and is followed:

* time series: ``Outputs/cpac/filt_noglobal/rois_ho/<FILE_ID>_rois_ho.1D`` (public S3, no
  registration) for sites ``NYU``, ``UM_1``, ``USM``, ``UCLA_1``; labels from the phenotype file
  (``DX_GROUP`` 1 = autism -> 1, 2 = control -> 0, i.e. ``DX_GROUP % 2``); subjects whose
  ``FILE_ID`` is ``no_filename`` are skipped (FedBN Table 10);
* per window: nilearn's ``ConnectivityMeasure(kind="correlation")`` of that code = columns
  centred and scaled to unit norm, Ledoit-Wolf shrunk covariance, converted to correlation
  (``estimator="ledoit_wolf"``; ``"pearson"`` is the plain alternative); Fisher z (``arctanh``),
  diagonal 0;
* vector: the upper triangle (k=1); negative values set to 0 (``tri[tri < 0] = 0`` in
  ``create_vector.py``; ``clip_negative``). That code also drops exact zeros, which removes an
  ROI whose time series is constant (zero): CPAC's HO atlas has 111 ROIs, and dropping such an
  ROI is how 6105 becomes FedBN's 5995. Here ROIs constant in any subject of the prepared sites
  are dropped for every subject (``drop_rois="constant"``), so all vectors share one layout;
  the kept ROI indices are stored.

Splits (:func:`load_abide`): not stated by FedBN; Fed_ABIDE uses 5 subject-level folds. Here a
stratified (by diagnosis) seeded 5-fold split of each site's subjects, ``fold`` selects the test
fold; all windows of a subject stay in one split (``groups`` = subject). Fed_ABIDE standardizes
features with the training mean/std per site (:func:`standardize_features`).

Data folder format, ``abide/abide_ho_w32.npz``: per site ``x_<site>`` (N, D) float32,
``y_<site>`` (N,) uint8, ``subject_<site>`` (N,) int32 (index into ``file_ids_<site>``), plus
``rois`` (kept ROI indices) and ``window``. Sites: ``NYU``, ``USM``, ``UM``, ``UCLA`` (FedBN's
names, Table 1 order). Vectors computed elsewhere can be stored in the same format with
:func:`prepare_abide_vectors`.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..datafolder import load_npz
from ..domain import DataError, Domain
from ._common import FeatureSplit, RawFile, check_choice, fetch, write_dataset_file

ABIDE_SITES = ("NYU", "USM", "UM", "UCLA")
ABIDE_SITE_IDS = {"NYU": "NYU", "USM": "USM", "UM": "UM_1", "UCLA": "UCLA_1"}  # ABIDE's SITE_ID
FEDBN_SUBJECTS = {"NYU": 167, "USM": 52, "UM": 88, "UCLA": 63}  # FedBN Table 10
FEDBN_NUM_FEATURES = 5995
ABIDE_WINDOW = 32
ABIDE_FILE = "abide/abide_ho_w32.npz"
_S3 = "https://s3.amazonaws.com/fcp-indi/data/Projects/ABIDE_Initiative"
# No digests are published for these files: url only.
ABIDE_PHENOTYPE = RawFile(f"{_S3}/Phenotypic_V1_0b_preprocessed1.csv", "Phenotypic_V1_0b_preprocessed1.csv")
ABIDE_ROI_URL = _S3 + "/Outputs/cpac/filt_noglobal/rois_ho/{file_id}_rois_ho.1D"
_EPS = np.finfo(np.float64).eps


def read_phenotype(path: Path, sites: Sequence[str] = ABIDE_SITES) -> dict[str, list[tuple[str, int]]]:
    """``{site: [(FILE_ID, label), ...]}`` from the PCP phenotype CSV (label 1 = autism)."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in ("SITE_ID", "FILE_ID", "DX_GROUP") if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(f"{path} lacks the column(s) {missing}. Is it {ABIDE_PHENOTYPE.filename}?")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"Cannot read {path} ({exc}). Get {ABIDE_PHENOTYPE.url} again.") from exc
    out: dict[str, list[tuple[str, int]]] = {s: [] for s in sites}
    wanted = {ABIDE_SITE_IDS[s]: s for s in sites}
    for i, row in enumerate(rows):
        site = wanted.get(row["SITE_ID"].strip())
        file_id = row["FILE_ID"].strip()
        if site is None or file_id in ("", "no_filename"):
            continue
        try:
            dx = int(float(row["DX_GROUP"]))
        except ValueError as exc:
            raise DataError(f"{path}, data row {i + 1}: DX_GROUP {row['DX_GROUP']!r} is not 1 or 2.") from exc
        if dx not in (1, 2):
            raise DataError(f"{path}, data row {i + 1}: DX_GROUP must be 1 (autism) or 2 (control), got {dx}.")
        out[site].append((file_id, dx % 2))
    return out


def read_roi_timeseries(path: Path) -> np.ndarray:
    """A CPAC ``.1D`` ROI time series: (frames, ROIs) float64; header lines start with ``#``."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"Cannot read the ROI time series {path} ({exc}). Get it again.") from exc
    rows = []
    for n, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            rows.append([float(v) for v in line.split()])
        except ValueError as exc:
            raise DataError(f"{path}, line {n + 1}: not a row of numbers. The file is corrupt: get it again.") from exc
    if not rows or len({len(r) for r in rows}) != 1:
        raise DataError(f"{path} must hold rows of equal length (one column per ROI); it is empty or ragged.")
    return np.asarray(rows, dtype=np.float64)


def _standardize(windows: np.ndarray) -> np.ndarray:
    """nilearn's ``_standardize(x, detrend=False, normalize=True)`` per window: centred columns
    of unit L2 norm (a constant column stays 0)."""
    x = windows - windows.mean(axis=-2, keepdims=True)
    norm = np.sqrt((x ** 2).sum(axis=-2, keepdims=True))
    norm[norm < _EPS] = 1.0
    return x / norm


def ledoit_wolf_covariance(x: np.ndarray) -> np.ndarray:
    """Ledoit-Wolf shrunk covariance of each (n, p) window in ``x`` (W, n, p): sklearn's
    ``covariance.ledoit_wolf`` (centred data, ``ledoit_wolf_shrinkage``), vectorized."""
    w, n, p = x.shape
    x = x - x.mean(axis=1, keepdims=True)
    x2 = x ** 2
    emp_cov = np.einsum("wni,wnj->wij", x, x) / n
    emp_trace = x2.sum(axis=1) / n  # (W, p)
    mu = emp_trace.sum(axis=1) / p  # (W,)
    beta_ = np.einsum("wni,wnj->w", x2, x2)
    delta_ = (emp_cov ** 2).sum(axis=(1, 2))  # = sum((X^T X)^2) / n^2
    beta = (beta_ / n - delta_) / (p * n)
    delta = (delta_ - 2.0 * mu * emp_trace.sum(axis=1) + p * mu ** 2) / p
    beta = np.minimum(beta, delta)
    shrinkage = np.divide(beta, delta, out=np.zeros_like(beta), where=beta != 0)
    cov = (1.0 - shrinkage)[:, None, None] * emp_cov
    idx = np.arange(p)
    cov[:, idx, idx] += (shrinkage * mu)[:, None]
    return cov


def window_connectomes(ts: np.ndarray, *, window: int = ABIDE_WINDOW, estimator: str = "ledoit_wolf",
                       rois: np.ndarray | None = None, clip_negative: bool = True) -> np.ndarray:
    """One float32 vector per sliding window (stride 1) of a (frames, ROIs) series: Fisher-z
    correlations of the kept ``rois`` (default all), upper triangle k=1, negatives 0 if asked."""
    check_choice(estimator, ("ledoit_wolf", "pearson"), "connectivity estimator")
    if ts.shape[0] < window:
        raise ValueError(f"the series has {ts.shape[0]} frames, fewer than the window of {window}")
    if rois is not None:
        ts = ts[:, rois]
    windows = np.lib.stride_tricks.sliding_window_view(ts, window, axis=0).transpose(0, 2, 1)  # (W, window, R)
    x = _standardize(windows)
    if estimator == "pearson":
        corr = np.einsum("wni,wnj->wij", x, x)
    else:
        cov = ledoit_wolf_covariance(x)
        d = np.sqrt(np.einsum("wii->wi", cov))
        d[d < _EPS] = 1.0  # an all-zero column with no shrinkage: correlation 0, not NaN
        corr = cov / d[:, :, None] / d[:, None, :]
    # arctanh(+-1) is infinite; off-diagonal values reach +-1 only without shrinkage.
    z = np.arctanh(np.clip(corr, -1 + 1e-7, 1 - 1e-7))
    iu = np.triu_indices(z.shape[-1], k=1)
    vec = z[:, iu[0], iu[1]]
    if clip_negative:
        vec = np.maximum(vec, 0.0)
    return vec.astype(np.float32)


def constant_rois(series: Sequence[np.ndarray]) -> np.ndarray:
    """Indices of ROIs whose time series is constant in at least one of ``series``."""
    bad = np.zeros(series[0].shape[1], dtype=bool)
    for ts in series:
        bad |= ts.std(axis=0) < 1e-12
    return np.flatnonzero(bad)


def _locate(raw_dir: Path, file_id: str, index: dict[str, Path], download: bool) -> Path:
    name = f"{file_id}_rois_ho.1D"
    if name in index:
        return index[name]
    src = RawFile(ABIDE_ROI_URL.format(file_id=file_id), name)
    manual = (f"Download it from {src.url} (public, no registration) into {raw_dir / 'rois_ho'}, e.g. with "
              "nilearn.datasets.fetch_abide_pcp(derivatives='rois_ho', pipeline='cpac', "
              "band_pass_filtering=True, global_signal_regression=False), or allow downloading.")
    return fetch(src, raw_dir / "rois_ho", download=download, progress=False, manual=manual)


def prepare_abide(data_dir: Path, *, raw_dir: Path | None = None, download: bool = True, progress: bool = True,
                  sites: Sequence[str] = ABIDE_SITES, window: int = ABIDE_WINDOW, estimator: str = "ledoit_wolf",
                  clip_negative: bool = True, drop_rois: str | Sequence[int] | None = "constant") -> Path:
    """Write ``abide/abide_ho_w32.npz`` from CPAC ``rois_ho`` time series and the phenotype CSV
    in ``raw_dir`` (default ``data_dir/raw/abide``; ``.1D`` files are found anywhere below it,
    e.g. nilearn's ``ABIDE_pcp/cpac/filt_noglobal``), downloading what is missing when allowed.

    ``drop_rois``: ``"constant"`` (ROIs constant in any subject), explicit indices, or None.
    """
    data_dir = Path(data_dir)
    raw_dir = Path(raw_dir) if raw_dir is not None else data_dir / "raw" / "abide"
    for s in sites:
        check_choice(s, ABIDE_SITES, "ABIDE site")
    manual = (f"Download {ABIDE_PHENOTYPE.url} (public) into {raw_dir}, or allow downloading.")
    phenotype = fetch(ABIDE_PHENOTYPE, raw_dir, download=download, progress=progress, manual=manual)
    subjects = read_phenotype(phenotype, sites)
    index = {p.name: p for p in raw_dir.rglob("*_rois_ho.1D")} if raw_dir.is_dir() else {}
    series: dict[str, list[np.ndarray]] = {}
    for site in sites:
        if not subjects[site]:
            raise DataError(f"{phenotype} lists no subject with a file for site {ABIDE_SITE_IDS[site]}.")
        series[site] = [read_roi_timeseries(_locate(raw_dir, f, index, download)) for f, _ in subjects[site]]
    widths = {ts.shape[1] for s in sites for ts in series[s]}
    if len(widths) != 1:
        raise DataError(f"The ROI time series have different ROI counts {sorted(widths)}; they must all be "
                        "CPAC rois_ho files.")
    n_rois = widths.pop()
    if drop_rois == "constant":
        dropped = constant_rois([ts for s in sites for ts in series[s]])
    else:
        dropped = np.asarray([] if drop_rois is None else list(drop_rois), dtype=np.int64)
    rois = np.setdiff1d(np.arange(n_rois), dropped).astype(np.int32)
    arrays: dict[str, np.ndarray] = {"rois": rois, "window": np.array(window, dtype=np.int32)}
    for site in sites:
        xs, ys, subj = [], [], []
        for k, ((file_id, label), ts) in enumerate(zip(subjects[site], series[site])):
            if ts.shape[0] < window:
                raise DataError(f"{file_id}_rois_ho.1D has {ts.shape[0]} frames, fewer than the window of {window}.")
            vec = window_connectomes(ts, window=window, estimator=estimator, rois=rois, clip_negative=clip_negative)
            xs.append(vec)
            ys.append(np.full(len(vec), label, dtype=np.uint8))
            subj.append(np.full(len(vec), k, dtype=np.int32))
        arrays[f"x_{site}"] = np.concatenate(xs)
        arrays[f"y_{site}"] = np.concatenate(ys)
        arrays[f"subject_{site}"] = np.concatenate(subj)
        arrays[f"file_ids_{site}"] = np.array([f for f, _ in subjects[site]], dtype=str)
    source = (f"ABIDE I PCP, CPAC filt_noglobal rois_ho ({_S3}); windows of {window}, {estimator} correlation, "
              f"Fisher z, upper triangle, clip_negative={clip_negative}, {len(rois)} of {n_rois} ROIs kept")
    return write_dataset_file(data_dir, ABIDE_FILE, arrays, key="abide", source=source)


def prepare_abide_vectors(data_dir: Path, folder: Path, *, sites: Sequence[str] = ABIDE_SITES) -> Path:
    """Store connectome vectors computed elsewhere: ``folder/<site>_x.npy`` (N, D) float,
    ``<site>_y.npy`` (N,) 0/1 and ``<site>_subject.npy`` (N,) int (required: windows of one
    subject must stay in one split), for each of ``sites``."""
    folder = Path(folder)
    arrays: dict[str, np.ndarray] = {}
    dims = set()
    for site in sites:
        check_choice(site, ABIDE_SITES, "ABIDE site")
        loaded = {}
        for part in ("x", "y", "subject"):
            path = folder / f"{site}_{part}.npy"
            if not path.is_file():
                raise DataError(f"{path} is missing: put {site}_x.npy, {site}_y.npy and {site}_subject.npy "
                                f"in {folder}.")
            try:
                loaded[part] = np.load(path, allow_pickle=False)
            except (OSError, ValueError, EOFError) as exc:
                raise DataError(f"Cannot read {path} as a .npy array ({exc}).") from exc
        x, y, s = loaded["x"], loaded["y"].reshape(-1), loaded["subject"].reshape(-1)
        if x.ndim != 2 or y.shape != (x.shape[0],) or s.shape != (x.shape[0],) or not np.isin(y, (0, 1)).all():
            raise DataError(f"{folder}: {site}_x must be (N, D) and {site}_y (0/1) and {site}_subject length N; got "
                            f"{x.shape}, {y.shape}, {s.shape}.")
        dims.add(x.shape[1])
        arrays[f"x_{site}"] = x.astype(np.float32)
        arrays[f"y_{site}"] = y.astype(np.uint8)
        arrays[f"subject_{site}"] = s.astype(np.int32)
    if len(dims) != 1:
        raise DataError(f"The sites' vectors have different lengths {sorted(dims)}.")
    return write_dataset_file(Path(data_dir), ABIDE_FILE, arrays, key="abide",
                              source=f"precomputed vectors from {folder}")


def load_abide(site: str, data_dir: Path, *, fold: int = 0, num_folds: int = 5, val_fraction: float = 0.0,
               seed: int = 0) -> Domain:
    """One site's :class:`FeatureSplit` s: subjects in ``num_folds`` stratified seeded folds,
    ``fold`` is the test fold; ``val_fraction`` of the remaining subjects (seeded) is validation
    (None when 0). ``groups`` holds the subject of every window."""
    from sklearn.model_selection import StratifiedKFold

    check_choice(site, ABIDE_SITES, "ABIDE site")
    if not 0 <= fold < num_folds:
        raise ValueError(f"fold must be in 0..{num_folds - 1}, got {fold}")
    path = Path(data_dir) / ABIDE_FILE
    arrays = load_npz(Path(data_dir), ABIDE_FILE, keys=[f"x_{site}", f"y_{site}", f"subject_{site}"])
    x, y, subject = arrays[f"x_{site}"], arrays[f"y_{site}"], arrays[f"subject_{site}"]
    if x.ndim != 2 or x.dtype.kind != "f" or y.shape != (x.shape[0],) or subject.shape != (x.shape[0],):
        raise DataError(f"In {path}, x_{site} must be float (N, D) with N labels and subjects. Prepare it again.")
    subjects, first = np.unique(subject, return_index=True)
    labels = y[first].astype(np.int64)
    if len(subjects) < num_folds or np.bincount(labels, minlength=2).min() < num_folds:
        raise DataError(f"{site} has {len(subjects)} subjects ({np.bincount(labels, minlength=2).tolist()} per class), "
                        f"too few for {num_folds} stratified folds.")
    folds = list(StratifiedKFold(num_folds, shuffle=True, random_state=seed).split(subjects, labels))
    train_subj, test_subj = subjects[folds[fold][0]], subjects[folds[fold][1]]
    val_subj = np.zeros(0, dtype=subjects.dtype)
    if val_fraction > 0:
        perm = np.random.default_rng(seed).permutation(train_subj)
        n_val = max(1, int(len(perm) * val_fraction))
        val_subj, train_subj = perm[:n_val], perm[n_val:]
    xt = torch.from_numpy(x.astype(np.float32))
    yt, gt = torch.from_numpy(y.astype(np.int64)), torch.from_numpy(subject.astype(np.int64))

    def part(members):
        idx = torch.from_numpy(np.flatnonzero(np.isin(subject, members)))
        return FeatureSplit(xt[idx], yt[idx], gt[idx])

    return Domain(name=f"abide/{site}", train=part(train_subj), test=part(test_subj),
                  val=part(val_subj) if val_fraction > 0 else None, num_classes=2, origin="real",
                  description=f"ABIDE I {site} connectomes, subject fold {fold}/{num_folds} (seed {seed})")


def standardize_features(train: FeatureSplit, *others: FeatureSplit | None, eps: float = 1e-8):
    """``train`` and ``others`` standardized with the training mean/std per feature (Fed_ABIDE's
    ``sepnorm``: each site with its own training statistics)."""
    mean = train.x.mean(0, keepdim=True)
    std = train.x.std(0, keepdim=True).clamp_min(eps)

    def norm(s):
        return None if s is None else FeatureSplit((s.x - mean) / std, s.y, s.groups)

    return (norm(train), *(norm(s) for s in others))
