"""Build a federation's clients from domain names: real digit files or rendered styles.

Domain names: ``mnist``, ``mnistm``, ``usps``, ``semeion``, ``svhn``, ``synthdigits`` (real, read
from the data folder; the last two written there by ``python -m fednorm.data.prepare``), and
``rendered/<style>`` (procedurally rendered, built in memory, no file needed). Every domain goes
through the same FedBN digits protocol (:mod:`fednorm.data.protocol`): stratified 80/20 split,
training pool of 7,438, ten partitions, ``percent`` of the pool per client.
"""

from __future__ import annotations

from pathlib import Path

from .domain import ClientData, DataError, Split
from .protocol import even_domain_clients, fedbn_domain_clients

PARTITIONS = ("fedbn", "even")

RENDERED_PREFIX = "rendered/"
PACS_PREFIX = "pacs/"
# Rendered pools default to USPS's size (7,291 + 2,007 = 9,298), so the 80/20 split gives exactly
# the FedBN training pool of 7,438 and a test set of 1,860.
DEFAULT_RENDERED_SIZE = 9298


def is_rendered(domain: str) -> bool:
    return domain.startswith(RENDERED_PREFIX)


def known_domains() -> list[str]:
    from .digits import REAL_DIGIT_DOMAINS
    from .pacs import PACS_DOMAINS
    from .rendered import RENDER_STYLES

    return (list(REAL_DIGIT_DOMAINS) + [RENDERED_PREFIX + s for s in RENDER_STYLES]
            + [PACS_PREFIX + d for d in PACS_DOMAINS])


def num_classes(domains: list[str]) -> int:
    """The label count shared by ``domains`` (digits 10, PACS 7); mixing benchmarks is an error."""
    from .pacs import PACS_CLASSES

    counts = {len(PACS_CLASSES) if d.startswith(PACS_PREFIX) else 10 for d in domains}
    if len(counts) != 1:
        raise ValueError(f"domains {domains} mix benchmarks with different classes (digits and PACS)")
    return counts.pop()


def image_size(domains: list[str]) -> int:
    """Side of the images of ``domains``: 28 for digits, 64 for PACS."""
    sizes = {64 if d.startswith(PACS_PREFIX) else 28 for d in domains}
    if len(sizes) != 1:
        raise ValueError(f"domains {domains} mix image sizes (digits are 28 x 28, PACS 64 x 64)")
    return sizes.pop()


def check_domain(domain: str) -> str:
    if domain not in known_domains():
        raise ValueError(f"unknown domain {domain!r}; choose from {', '.join(known_domains())}")
    return domain


def load_pool(domain: str, *, data_dir: Path | None, rendered_size: int = DEFAULT_RENDERED_SIZE, seed: int = 0):
    """All images and labels of one domain, uint8 N x 3 x H x W (digits 28 x 28, PACS 64 x 64)."""
    check_domain(domain)
    if is_rendered(domain):
        from .rendered import rendered_domain

        return rendered_domain(domain[len(RENDERED_PREFIX):], n=rendered_size, seed=seed)
    if data_dir is None:
        raise DataError(f"domain {domain!r} needs a data folder: pass --data-dir DIR or set FEDNORM_DATA")
    if domain.startswith(PACS_PREFIX):
        from .pacs import load_pacs_pool

        return load_pacs_pool(domain[len(PACS_PREFIX):], Path(data_dir))
    from .digits import load_digit_pool

    return load_digit_pool(domain, Path(data_dir))


def build_clients(
    domains: list[str],
    *,
    data_dir: Path | None,
    percent: float = 0.1,
    clients_per_domain: int = 1,
    pool_size: int = 7438,
    split_seed: int = 0,
    rendered_size: int = DEFAULT_RENDERED_SIZE,
    partition: str = "fedbn",
) -> list[ClientData]:
    """The clients of a multi-domain federation, in domain order.

    ``partition``: ``fedbn`` (FedBN's ten partitions, ``percent`` of the pool per client, at most ten
    clients per domain) or ``even`` (``percent`` of the pool split evenly over any number of clients
    per domain: FedWon's cross-device federations of 100 and 1,000 clients).
    """
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}")
    if not domains:
        raise ValueError("a federation needs at least one domain")
    if len(set(domains)) != len(domains):
        raise ValueError(f"domains must be distinct, got {domains}")
    clients: list[ClientData] = []
    for domain in domains:
        x, y = load_pool(domain, data_dir=data_dir, rendered_size=rendered_size, seed=split_seed)
        split = fedbn_domain_clients if partition == "fedbn" else even_domain_clients
        clients += split(
            domain,
            x,
            y,
            percent=percent,
            clients_per_domain=clients_per_domain,
            pool_size=pool_size,
            seed=split_seed,
            origin="rendered" if is_rendered(domain) else "real",
        )
    return clients


def domain_eval_clients(clients: list[ClientData]) -> list[ClientData]:
    """One evaluation client per domain (the first client of each, renamed to the domain).

    Every client of a domain shares the domain's test split; with stateless clients (cross-device)
    they all hold the global model too, so evaluating each would repeat the same numbers.
    """
    seen: dict[str, ClientData] = {}
    for c in clients:
        if c.domain not in seen:
            seen[c.domain] = ClientData(name=c.domain, domain=c.domain, train=c.train, test=c.test, val=c.val,
                                        origin=c.origin, meta={"evaluates": "global model on the domain's test split"})
    return list(seen.values())


def pooled_client(clients: list[ClientData], name: str = "centralized") -> ClientData:
    """One client holding every client's training data (centralized training, the upper reference)."""
    return ClientData(
        name=name,
        domain="pooled",
        train=Split.concat([c.train for c in clients]),
        test=Split.concat([c.test for c in clients]),
        origin="pooled",
    )
