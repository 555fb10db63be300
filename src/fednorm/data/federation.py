"""Build a federation's clients from domain names: real files, rendered styles, corrupted copies.

Domain names (``docs/datasets.md`` has the full table):

* ``mnist``, ``mnistm``, ``usps``, ``semeion``, ``svhn``, ``synthdigits``: real digits from the
  data folder (the last two written there by ``fednorm data prepare``);
* ``rendered/<style>``: procedurally rendered digits, built in memory, no file needed;
* ``pacs/<domain>``: PACS at 64 x 64 from the data folder;
* ``office_caltech10/<domain>`` and ``domainnet/<domain>`` (``@<size>`` appended for a size other
  than 64, e.g. ``office_caltech10/amazon@256``): FedBN's object benchmarks, written by
  ``fednorm data prepare office_caltech10|domainnet``;
* ``cifar10/train``, ``cifar10/test``: one official CIFAR-10 split as a pool (``cifar10/test`` is
  what CIFAR-10-C corrupts);
* ``cifar10c/<corruption>/<severity>``: the released CIFAR-10-C files (:mod:`fednorm.data.cifar10c`),
  written by ``fednorm data prepare cifar10c``;
* ``corrupt/<corruption>/<severity>/<base domain>``: a base domain corrupted with one of the 15
  ImageNet-C corruptions (:mod:`fednorm.data.corrupt`);
* ``<dataset>/<site>`` for the medical datasets of :data:`fednorm.data.medical.MEDICAL_DATASETS`:
  ``camelyon17/hospital1..5``, ``prostate/BIDMC|HK|I2CVB|ISBI|ISBI_1.5|UCL``,
  ``nuclei/monusac2020_breast|..|monuseg2018|tnbc``, ``fed_isic2019/bcn|..|vienna_dias`` and
  ``abide/NYU|USM|UM|UCLA``, read from the files their ``prepare_*`` functions write.

Domains without an official split (digits, rendered, PACS, CIFAR-10 pools) go through the FedBN
digits protocol (:mod:`fednorm.data.protocol`): stratified 80/20 split, training pool of 7,438,
ten partitions, ``percent`` of the pool per client. Office-Caltech10 and DomainNet keep FedBN's
train/test lists and go through its object protocol (:func:`fedbn_object_clients`). Medical sites
keep the train/val/test splits of their loaders, one client per site (:func:`medical_clients`):
nothing is re-split, ``percent`` and ``pool_size`` do not apply, and HarmoFL's truncation of every
training split to the smallest site's is an option (``truncate_train``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .domain import ClientData, DataError, Domain, Split
from .protocol import even_domain_clients, fedbn_domain_clients, fedbn_object_clients

PARTITIONS = ("fedbn", "even")

RENDERED_PREFIX = "rendered/"
PACS_PREFIX = "pacs/"
OFFICE_PREFIX = "office_caltech10/"
DOMAINNET_PREFIX = "domainnet/"
CIFAR10_PREFIX = "cifar10/"
CIFAR10C_PREFIX = "cifar10c/"
CORRUPT_PREFIX = "corrupt/"
CIFAR10_SPLITS = ("train", "test")
# Rendered pools default to USPS's size (7,291 + 2,007 = 9,298), so the 80/20 split gives exactly
# the FedBN training pool of 7,438 and a test set of 1,860.
DEFAULT_RENDERED_SIZE = 9298


@dataclass(frozen=True)
class DomainSpec:
    """What a domain name means: its benchmark (label space), image size and how it is split.

    ``benchmark`` names the label space (digits, pacs, office_caltech10, domainnet, cifar10);
    domains of different benchmarks cannot share a model. ``official_split``: the domain has fixed
    train/test lists (FedBN's object protocol), else it is one pool re-split by the digits protocol.
    """

    name: str
    benchmark: str
    num_classes: int
    image_size: int
    origin: str  # "real" or "rendered"
    official_split: bool = False
    file: str | None = None  # the data-folder file it reads (None: generated)
    base: "DomainSpec | None" = None  # corrupted domains: the domain they corrupt
    corruption: str | None = None
    severity: int | None = None
    # what the domain's samples are: "classification" (images with one label), "segmentation" (images with
    # class masks) or "features" (float vectors with one label: ABIDE); selects the task and the model input
    task: str = "classification"
    input_shape: tuple[int, ...] | None = None  # per sample, (C, H, W) or (D,) (medical domains)
    medical: bool = False  # a site of fednorm.data.medical: official splits, one client per site


def medical_file(dataset: str, site: str) -> str:
    """The data-folder file of one medical site (the one its ``prepare_*`` writes)."""
    from .medical import abide, camelyon17, isic2019, nuclei, prostate

    files = {"camelyon17": camelyon17.camelyon17_file, "prostate": prostate.prostate_file,
             "nuclei": nuclei.nuclei_file, "fed_isic2019": isic2019.isic_file,
             "abide": lambda site: abide.ABIDE_FILE}
    return files[dataset](site)


def _medical_spec(name: str) -> DomainSpec | None:
    from .medical import MEDICAL_DATASETS

    dataset, _, site = name.partition("/")
    ds = MEDICAL_DATASETS.get(dataset)
    if ds is None or site not in ds.sites:
        return None
    # image_size 0: feature vectors have no image side (models taking an image size ignore it)
    size = ds.input_shape[-1] if len(ds.input_shape) == 3 else 0
    return DomainSpec(name, dataset, ds.num_classes, size, "real", official_split=True,
                      file=medical_file(dataset, site), task=ds.task, input_shape=tuple(ds.input_shape), medical=True)


def parse_domain(name: str) -> DomainSpec:
    """The :class:`DomainSpec` of a domain name; ValueError naming the valid choices otherwise."""
    from .cifar10 import CIFAR10_CLASSES, CIFAR10_FILE
    from .digits import REAL_DIGIT_DOMAINS
    from .objects import DEFAULT_SIZE, OBJECT_DATASETS, check_size
    from .pacs import PACS_CLASSES, PACS_DOMAINS, PACS_FILE, PACS_SIZE
    from .rendered import RENDER_STYLES

    if not isinstance(name, str):
        raise ValueError(f"a domain name must be a string, got {name!r}")
    if name.startswith(CORRUPT_PREFIX):
        from .corrupt import parse_corrupt_name

        corruption, severity, base_name = parse_corrupt_name(name)
        base = parse_domain(base_name)
        if base.medical:
            raise ValueError(f"{name!r}: corrupted copies of medical domains are not supported (their shift is "
                             "the sites' own); use the site itself")
        return DomainSpec(name, base.benchmark, base.num_classes, base.image_size, base.origin, base.official_split,
                          None, base, corruption, severity)
    if name in REAL_DIGIT_DOMAINS:
        return DomainSpec(name, "digits", 10, 28, "real", file=REAL_DIGIT_DOMAINS[name])
    if name.startswith(RENDERED_PREFIX) and name[len(RENDERED_PREFIX):] in RENDER_STYLES:
        return DomainSpec(name, "digits", 10, 28, "rendered")
    if name.startswith(PACS_PREFIX) and name[len(PACS_PREFIX):] in PACS_DOMAINS:
        return DomainSpec(name, "pacs", len(PACS_CLASSES), PACS_SIZE, "real", file=PACS_FILE)
    if name.startswith(CIFAR10_PREFIX) and name[len(CIFAR10_PREFIX):] in CIFAR10_SPLITS:
        return DomainSpec(name, "cifar10", len(CIFAR10_CLASSES), 32, "real", file=CIFAR10_FILE)
    if name.startswith(CIFAR10C_PREFIX):
        from .cifar10c import cifar10c_file, parse_cifar10c_name

        corruption, _ = parse_cifar10c_name(name)
        return DomainSpec(name, "cifar10", len(CIFAR10_CLASSES), 32, "real", file=cifar10c_file(corruption))
    medical = _medical_spec(name)
    if medical is not None:
        return medical
    dataset, _, rest = name.partition("/")
    if dataset in OBJECT_DATASETS and rest:
        ds = OBJECT_DATASETS[dataset]
        domain, at, size_text = rest.partition("@")
        if domain in ds.domains:
            size = DEFAULT_SIZE
            if at:
                if not size_text.isdigit():
                    raise ValueError(f"{name!r}: the size after '@' must be an integer, e.g. {dataset}/{domain}@256")
                size = check_size(int(size_text))
            return DomainSpec(name, dataset, len(ds.classes), size, "real", official_split=True,
                              file=ds.file(domain, size))
    raise ValueError(f"unknown domain {name!r}; choose from {', '.join(known_domains())}, "
                     f"<dataset>/<domain>@<size> for office_caltech10 and domainnet, "
                     f"cifar10c/<corruption>/<severity> (the released CIFAR-10-C), or "
                     f"corrupt/<corruption>/<severity>/<domain>")


def name_is_cifar10c(domain: str) -> bool:
    """True for a released CIFAR-10-C domain ``cifar10c/<corruption>/<severity>``."""
    return domain.startswith(CIFAR10C_PREFIX)


def is_rendered(domain: str) -> bool:
    """True when the domain needs no data folder (rendered digits, or a corrupted copy of them)."""
    if domain.startswith(CORRUPT_PREFIX):
        try:
            spec = parse_domain(domain)
        except ValueError:
            return False
        while spec.base is not None:
            spec = spec.base
        return spec.name.startswith(RENDERED_PREFIX)
    return domain.startswith(RENDERED_PREFIX)


def known_domains() -> list[str]:
    """Every concrete domain name (object benchmarks at the default size). Corrupted domains are
    formed from these: ``corrupt/<corruption>/<severity>/<domain>``."""
    from .digits import REAL_DIGIT_DOMAINS
    from .medical import medical_domain_names
    from .objects import OBJECT_DATASETS
    from .pacs import PACS_DOMAINS
    from .rendered import RENDER_STYLES

    return (list(REAL_DIGIT_DOMAINS) + [RENDERED_PREFIX + s for s in RENDER_STYLES]
            + [PACS_PREFIX + d for d in PACS_DOMAINS]
            + [f"{ds.name}/{d}" for ds in OBJECT_DATASETS.values() for d in ds.domains]
            + [CIFAR10_PREFIX + s for s in CIFAR10_SPLITS] + medical_domain_names())


def domain_file(domain: str) -> str | None:
    """The data-folder file a domain reads (its base's, for a corrupted domain); None if generated."""
    spec = parse_domain(domain)
    while spec.base is not None:
        spec = spec.base
    return spec.file


# label names of the medical datasets (segmentation: the mask values); ABIDE: DX_GROUP % 2, 1 = autism
MEDICAL_CLASS_NAMES = {"camelyon17": ("normal", "tumor"), "prostate": ("background", "prostate"),
                       "nuclei": ("background", "nucleus"), "abide": ("control", "autism")}


def class_names(domain: str) -> tuple[str, ...]:
    """The label names of a domain, in label order."""
    from .cifar10 import CIFAR10_CLASSES
    from .objects import OBJECT_DATASETS
    from .pacs import PACS_CLASSES

    benchmark = parse_domain(domain).benchmark
    if benchmark in MEDICAL_CLASS_NAMES:
        return MEDICAL_CLASS_NAMES[benchmark]
    if benchmark == "fed_isic2019":
        from .medical import ISIC_CLASSES

        return ISIC_CLASSES
    if benchmark == "pacs":
        return PACS_CLASSES
    if benchmark == "cifar10":
        return CIFAR10_CLASSES
    if benchmark in OBJECT_DATASETS:
        return OBJECT_DATASETS[benchmark].classes
    return tuple(str(d) for d in range(10))


def num_classes(domains: list[str]) -> int:
    """The label count shared by ``domains``; mixing benchmarks (label spaces) is an error."""
    specs = [parse_domain(d) for d in domains]
    benchmarks = sorted({s.benchmark for s in specs})
    if len(benchmarks) != 1:
        raise ValueError(f"domains {domains} mix benchmarks with different classes ({', '.join(benchmarks)})")
    return specs[0].num_classes


def image_size(domains: list[str]) -> int:
    """Side of the images of ``domains``: 28 digits, 32 CIFAR-10, 64 PACS, 64 (or @size) objects."""
    sizes = {parse_domain(d).image_size for d in domains}
    if len(sizes) != 1:
        raise ValueError(f"domains {domains} mix image sizes ({', '.join(f'{s} x {s}' for s in sorted(sizes))})")
    return sizes.pop()


def domain_task(domains: list[str]) -> tuple[str, str]:
    """``(task, benchmark)`` shared by ``domains``: task ``classification``, ``segmentation`` or ``features``
    (:attr:`DomainSpec.task`); mixing benchmarks is an error (as :func:`num_classes`)."""
    num_classes(domains)
    spec = parse_domain(domains[0])
    return spec.task, spec.benchmark


def check_domain(domain: str) -> str:
    parse_domain(domain)
    return domain


@dataclass(frozen=True)
class LoadedDomain:
    """A domain's images: one ``pool`` (re-split by the digits protocol) or official ``train``/``test``."""

    spec: DomainSpec
    pool: Split | None = None
    # the pool is FedBN's preprocessed files: its first ``presplit`` images are the training pool in partition
    # order, the rest the test split; the protocol keeps that split instead of re-splitting (protocol.pool_split)
    presplit: int | None = None
    train: Split | None = None
    test: Split | None = None
    val: Split | None = None  # medical sites: their loader's validation split (a SegmentationSplit / FeatureSplit
    description: str = ""     # for masks and feature vectors, in the three fields above too)

    def parts(self) -> list[Split]:
        if self.pool is not None:
            return [self.pool]
        return [self.train, self.test] if self.val is None else [self.train, self.val, self.test]

    def all(self) -> Split:
        """Every sample: the pool, or the train list followed by the (val and) test list(s)."""
        parts = self.parts()
        return parts[0] if len(parts) == 1 else type(parts[0]).concat(parts)


def load_domain(domain: str, *, data_dir: Path | None, rendered_size: int = DEFAULT_RENDERED_SIZE, seed: int = 0,
                cache: bool = True, progress: bool = False, medical_options: dict | None = None) -> LoadedDomain:
    """The images of one domain (uint8 N x 3 x H x W). ``seed`` seeds rendering and corruption;
    ``cache``/``progress`` apply to corrupted domains (:func:`fednorm.data.corrupt.corrupt_pool`). A medical
    site comes with its loader's train/val/test splits (``seed`` and ``medical_options`` go to its loader)."""
    spec = parse_domain(domain)
    if spec.medical:
        site = load_medical(domain, data_dir=data_dir, seed=seed, options=medical_options)
        return LoadedDomain(spec, train=site.train, test=site.test, val=site.val, description=site.description)
    if spec.base is not None:
        from .corrupt import corrupt_pool

        base = load_domain(spec.base.name, data_dir=data_dir, rendered_size=rendered_size, seed=seed, cache=cache,
                           progress=progress)
        whole = base.all()
        x = corrupt_pool(whole.x, spec.corruption, spec.severity, seed=seed, base=spec.base.name, cache=cache,
                         progress=progress)
        if base.pool is not None:
            return LoadedDomain(spec, pool=Split(x, whole.y), presplit=base.presplit)
        n = len(base.train)
        return LoadedDomain(spec, train=Split(x[:n], base.train.y), test=Split(x[n:], base.test.y))
    if spec.origin == "rendered":
        from .rendered import rendered_domain

        x, y = rendered_domain(domain[len(RENDERED_PREFIX):], n=rendered_size, seed=seed)
        return LoadedDomain(spec, pool=Split(x, y))
    if data_dir is None:
        raise DataError(f"domain {domain!r} needs a data folder: pass --data-dir DIR or set FEDNORM_DATA")
    data_dir = Path(data_dir)
    if spec.benchmark == "pacs":
        from .pacs import load_pacs_pool

        return LoadedDomain(spec, pool=Split(*load_pacs_pool(domain[len(PACS_PREFIX):], data_dir)))
    if name_is_cifar10c(domain):
        from .cifar10c import load_cifar10c, parse_cifar10c_name

        return LoadedDomain(spec, pool=Split(*load_cifar10c(*parse_cifar10c_name(domain), data_dir)))
    if spec.benchmark == "cifar10":
        from .cifar10 import load_cifar10

        x_tr, y_tr, x_te, y_te = load_cifar10(data_dir)
        pool = Split(x_tr, y_tr) if domain.endswith("/train") else Split(x_te, y_te)
        return LoadedDomain(spec, pool=pool)
    if spec.official_split:
        from .objects import load_object_domain

        train, test = load_object_domain(spec.benchmark, domain.split("/", 1)[1].partition("@")[0], data_dir,
                                         spec.image_size)
        return LoadedDomain(spec, train=train, test=test)
    from .digits import load_digit_pool

    x, y, presplit = load_digit_pool(domain, data_dir, with_presplit=True)
    return LoadedDomain(spec, pool=Split(x, y), presplit=presplit)


def medical_loader_options(domain: str) -> list[str]:
    """The options the loader of a medical domain takes besides its site, data folder and seed."""
    import inspect

    from .medical import MEDICAL_DATASETS

    loader = MEDICAL_DATASETS[parse_domain(domain).benchmark].load
    params = list(inspect.signature(loader).parameters.values())[2:]
    return [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.name != "seed"]


def check_medical_options(domains: list[str], options: dict | None) -> None:
    """ValueError naming the options that the loaders of ``domains`` do not take."""
    if not options:
        return
    for domain in domains:
        if not parse_domain(domain).medical:
            raise ValueError(f"loader options {sorted(options)} apply to medical domains only, not {domain!r}")
        known = medical_loader_options(domain)
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"{domain!r}: its loader has no option {unknown}; it takes {', '.join(known) or 'none'}"
                             " (and seed, which is data.split_seed)")


def load_medical(domain: str, *, data_dir: Path | None, seed: int = 0, options: dict | None = None) -> Domain:
    """One medical site's :class:`Domain` with its loader's train/val/test splits (no re-split).

    The data folder must hold the file the site's ``prepare_*`` writes; if it does not, the
    :class:`DataError` names the file and the preparer to run (the raw data is never downloaded here).
    """
    from . import medical

    spec = parse_domain(domain)
    from .prepare import prepare_command

    if data_dir is None:
        raise DataError(f"domain {domain!r} needs a data folder holding {spec.file}: pass --data-dir DIR or set "
                        f"FEDNORM_DATA, after writing the file with {prepare_command(spec.file, 'DIR')}")
    data_dir = Path(data_dir)
    path = data_dir / spec.file
    if not path.is_file():
        raise DataError(
            f"domain {domain!r} reads {path}, which is missing (data folder {data_dir}). It is not downloaded by a "
            f"run: write it from the official files with {prepare_command(spec.file, data_dir)} (add --raw-dir "
            "DIR where they are; its error messages say what to download and where to put it)")
    check_medical_options([domain], options)
    loaded = medical.load_medical_domain(domain, data_dir, seed=seed, **(options or {}))
    if len(loaded.train) == 0:
        raise DataError(f"domain {domain!r}: {path} gives an empty training split; prepare it again")
    shape = tuple(loaded.train.x.shape[1:])
    if spec.task != "features" and shape[0] != spec.input_shape[0]:
        raise DataError(f"domain {domain!r}: {path} holds {shape} samples, expected {spec.input_shape[0]} channels")
    return loaded


def medical_clients(
    domains: list[str],
    *,
    data_dir: Path | None,
    seed: int = 0,
    truncate_train: bool | None = None,
    options: dict | None = None,
    standardize_features: bool = True,
) -> list[ClientData]:
    """One client per medical site, holding the site's own train/val/test splits (no re-split).

    ``truncate_train``: cut every training split to the smallest site's of the same dataset, keeping the
    first samples in split order (HarmoFL's code: ``Subset(trainset, range(min_len))``); None = the paper's
    choice per dataset (:attr:`MedicalDataset.truncate_train`: Camelyon17 and prostate yes, nuclei no).
    ``standardize_features``: feature-vector sites (ABIDE) standardized with their own training mean/std
    (Fed_ABIDE's per-site ``sepnorm``, the FedBN authors' earlier code), after truncation.
    """
    from .medical import MEDICAL_DATASETS, standardize_features as standardize, truncate_train_to_smallest

    specs = [parse_domain(d) for d in domains]
    if not all(s.medical for s in specs):
        others = [s.name for s in specs if not s.medical]
        raise ValueError(f"medical_clients takes medical domains only, got {others}")
    sites = [load_medical(d, data_dir=data_dir, seed=seed, options=options) for d in domains]
    shapes = {tuple(s.train.x.shape[1:]) for s in sites}
    if len(shapes) != 1:
        raise DataError(f"the sites {domains} hold samples of different shapes {sorted(shapes)}; one model (and "
                        "HarmoFL's average amplitude) needs one size: prepare every site with the same size")
    before = {d: len(s.train) for d, s in zip(domains, sites)}
    for benchmark in dict.fromkeys(s.benchmark for s in specs):
        cut = MEDICAL_DATASETS[benchmark].truncate_train if truncate_train is None else truncate_train
        if cut:
            idx = [i for i, s in enumerate(specs) if s.benchmark == benchmark]
            for i, site in zip(idx, truncate_train_to_smallest([sites[i] for i in idx])):
                sites[i] = site
    clients = []
    for domain, spec, site in zip(domains, specs, sites):
        train, val, test = site.train, site.val, site.test
        if spec.task == "features" and standardize_features:
            train, val, test = standardize(train, val, test)
        meta = {"protocol": "official splits", "split_seed": seed, "description": site.description,
                "train_len": before[domain]}
        if len(train) != before[domain]:
            meta["truncated_to"] = len(train)
        clients.append(ClientData(name=domain, domain=domain, train=train, test=test, val=val, origin=site.origin,
                                  meta=meta))
    return clients


def load_pool(domain: str, *, data_dir: Path | None, rendered_size: int = DEFAULT_RENDERED_SIZE,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All images and labels of one domain, uint8 N x 3 x H x W (an official split: train then test)."""
    whole = load_domain(domain, data_dir=data_dir, rendered_size=rendered_size, seed=seed).all()
    return whole.x, whole.y


def build_clients(
    domains: list[str],
    *,
    data_dir: Path | None,
    percent: float = 0.1,
    clients_per_domain: int = 1,
    pool_size: int | None = 7438,
    split_seed: int = 0,
    rendered_size: int = DEFAULT_RENDERED_SIZE,
    partition: str = "fedbn",
    truncate_train: bool | None = None,
    medical_options: dict | None = None,
    standardize_features: bool = True,
) -> list[ClientData]:
    """The clients of a multi-domain federation, in domain order.

    ``partition``: ``fedbn`` (FedBN's ten partitions, ``percent`` of the pool per client, at most ten
    clients per domain) or ``even`` (``percent`` of the pool split evenly over any number of clients
    per domain: FedWon's cross-device federations of 100 and 1,000 clients).

    Office-Caltech10 / DomainNet domains (and corrupted copies of them) use FedBN's object protocol:
    their pool is the first ``train_fraction`` of the smallest train list among the federation's
    domains of the same benchmark (62 / 105 samples with every domain, as the official code), so
    ``pool_size`` does not apply to them and ``percent=1`` is the papers' setting.

    Medical sites become one client each with their loader's splits (:func:`medical_clients`, which
    ``truncate_train``, ``medical_options`` and ``standardize_features`` go to); ``percent`` and
    ``pool_size`` do not apply to them.
    """
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}")
    if not domains:
        raise ValueError("a federation needs at least one domain")
    if len(set(domains)) != len(domains):
        raise ValueError(f"domains must be distinct, got {domains}")
    medical = [d for d in domains if parse_domain(d).medical]
    if medical:
        if len(medical) != len(domains):
            raise ValueError(f"medical sites cannot share a federation with other domains, got {domains}")
        if clients_per_domain != 1 or partition != "fedbn":
            raise ValueError("medical domains keep their official splits, one client per site: clients_per_domain "
                             "and partition do not apply to them (leave them at 1 and fedbn)")
        return medical_clients(domains, data_dir=data_dir, seed=split_seed, truncate_train=truncate_train,
                               options=medical_options, standardize_features=standardize_features)
    if truncate_train is not None or medical_options:
        raise ValueError("truncate_train and medical loader options apply to medical domains only")
    from .objects import OBJECT_DATASETS

    loaded = [load_domain(d, data_dir=data_dir, rendered_size=rendered_size, seed=split_seed) for d in domains]
    # The official prepare_data takes the smallest train list over its federation's domains.
    min_train: dict[str, int] = {}
    for item in loaded:
        if item.spec.official_split:
            b = item.spec.benchmark
            min_train[b] = min(min_train.get(b, len(item.train)), len(item.train))
    clients: list[ClientData] = []
    for domain, item in zip(domains, loaded):
        if item.spec.official_split:
            ds = OBJECT_DATASETS[item.spec.benchmark]
            clients += fedbn_object_clients(
                domain, item.train, item.test, min_train_len=min_train[item.spec.benchmark],
                train_fraction=ds.train_fraction, val_fraction=ds.val_fraction, percent=percent,
                clients_per_domain=clients_per_domain, partition=partition, origin=item.spec.origin,
            )
            continue
        split = fedbn_domain_clients if partition == "fedbn" else even_domain_clients
        clients += split(
            domain,
            item.pool.x,
            item.pool.y,
            percent=percent,
            clients_per_domain=clients_per_domain,
            pool_size=pool_size,
            seed=split_seed,
            origin=item.spec.origin,
            presplit=item.presplit,
        )
    return clients


def domain_eval_clients(clients: list[ClientData]) -> list[ClientData]:
    """One evaluation client per domain (the first client of each, renamed to the domain).

    Every client of a domain shares the domain's test split; with stateless clients (cross-device)
    they all hold the global model too, so evaluating each would repeat the same numbers. Its validation
    split is the union of the domain's clients' ones (each client's is a slice of its own training data,
    which under label skew may hold one class: model selection needs the domain's).
    """
    by_domain: dict[str, list[ClientData]] = {}
    for c in clients:
        by_domain.setdefault(c.domain, []).append(c)
    out = []
    for domain, members in by_domain.items():
        first = members[0]
        vals = [c.val for c in members if c.val is not None]
        val = type(vals[0]).concat(vals) if len(vals) > 1 else (vals[0] if vals else None)
        out.append(ClientData(name=domain, domain=domain, train=first.train, test=first.test, val=val,
                              origin=first.origin, meta={"evaluates": "global model on the domain's test split"}))
    return out


def pooled_client(clients: list[ClientData], name: str = "centralized") -> ClientData:
    """One client holding every client's training data (centralized training, the upper reference)."""
    kind = type(clients[0].train)  # Split, or a medical SegmentationSplit / FeatureSplit
    return ClientData(
        name=name,
        domain="pooled",
        train=kind.concat([c.train for c in clients]),
        test=kind.concat([c.test for c in clients]),
        origin="pooled",
    )
