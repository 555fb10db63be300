"""Flower's two runtimes for a fednorm experiment.

- :func:`simulate`: the simulation runtime (Ray), every node a virtual SuperNode in this machine's
  processes (``fednorm flower sim``);
- :func:`write_app`: a Flower app folder for the deployment runtime, run with ``flwr run`` against a
  SuperLink whose SuperNodes hold the data (``fednorm flower app``, docs/flower.md);
- :class:`LocalDeployment`: a SuperLink and SuperNodes as separate processes on this machine, the
  deployment runtime on localhost (``fednorm flower local``, the tests and the benchmark).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from ...runs.config import ExperimentConfig
from ...runs.runner import RunError, check_engine
from .node import NODE_DATA_DIR, NODE_STATE_DIR, experiment_text, federation_size
from .server import FlowerOptions, ServerSettings

FLWR_PIN = "flwr[simulation]==1.41.0"
APP_COMPONENTS = {"serverapp": "fednorm.engines.flower.app:server_app",
                  "clientapp": "fednorm.engines.flower.app:client_app"}


# ------------------------------------------------------------------------------------------ simulation
def simulate(config: ExperimentConfig, out: str | Path, data_dir: str | None = None, nodes: int | None = None,
             options: FlowerOptions = FlowerOptions(), cpus_per_node: float = 1.0, progress=None,
             resume: bool = False) -> None:
    """Run ``config`` on Flower's simulation runtime into the run folder ``out`` (``resume``: continue the
    stopped run there from its checkpoints).

    ``nodes`` virtual SuperNodes (default one per client; with fewer, node k holds clients k, k+nodes, ...)
    run the ClientApp in Ray actors of ``cpus_per_node`` CPUs each. The clients' state between rounds is kept
    on disk under ``out/node_state`` (:mod:`.node_state`), so any method's run can resume."""
    from flwr.simulation import run_simulation

    from .app import make_client_app, make_server_app

    out = Path(out).resolve()
    check_out(out, resume)
    count = nodes or federation_size(config, data_dir)
    settings = ServerSettings(experiment_text(config), str(out), options, resume=resume)
    # no GPU share: Ray (current versions) then hides the GPUs from the nodes, which train on the CPU
    # (federation.device auto); deployment SuperNodes use their machine's GPU
    backend = {"client_resources": {"num_cpus": cpus_per_node, "num_gpus": 0.0},
               "init_args": {"num_cpus": os.cpu_count() or 1, "include_dashboard": False}}
    try:
        run_simulation(make_server_app(settings, progress), make_client_app(data_dir, str(out / NODE_STATE_FOLDER)),
                       num_supernodes=count, backend_config=backend)
    except RuntimeError as exc:
        # Flower ends every failure with "An error was encountered. Ending simulation."; the cause is chained
        raise RunError(simulation_failure(exc, out)) from exc


def simulation_failure(exc: BaseException, out: Path) -> str:
    """What stopped a simulation, from Flower's chained exception, and what to do."""
    cause = exc.__cause__ or exc.__context__ or exc
    kept = (f"what finished is kept in {out}: `fednorm flower sim --out {out} --resume` goes on"
            if (out / "config.yaml").is_file() else "nothing was written")
    return (f"Flower's simulation stopped ({type(cause).__name__}: {cause}); {kept}. If Ray could not start its "
            "nodes (e.g. 'timed out during startup' on a busy machine), use fewer --nodes or a smaller "
            "--cpus-per-node; Ray's logs are under /tmp/ray/session_latest/logs")


NODE_STATE_FOLDER = "node_state"


def check_out(out: Path, resume: bool) -> None:
    """Refuse, before anything starts, a fresh run into a folder that holds one, a resume of a folder that holds
    none, or a resume of another engine's run (``fednorm flower app`` checks the same when the folder is here)."""
    if resume and not (out / "config.yaml").exists():
        raise RunError(f"{out} holds no run to resume (no config.yaml)")
    if resume:  # before Ray or the SuperLink start: the server's own refusal would end up in a log
        check_engine(out, "flower")
    if not resume and (out / "config.yaml").exists():
        raise RunError(f"{out} already holds a run; resume it with --resume or choose another --out")


# ------------------------------------------------------------------------------------------ app folder
def write_app(app_dir: str | Path, config: ExperimentConfig, out: str | Path,
              options: FlowerOptions = FlowerOptions(), resume: bool = False) -> Path:
    """Write a Flower app folder (a ``pyproject.toml``) that runs ``config`` with ``flwr run APP_DIR SUPERLINK``.

    ``out`` is the run folder on the machine of the SuperLink (where the ServerApp runs). The folder holds
    no code: its components are fednorm's ServerApp and ClientApp, so fednorm (with the ``flower`` extra)
    must be installed on the SuperLink's and every SuperNode's machine."""
    from ... import __version__

    app_dir = Path(app_dir)
    app_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", config.name.lower()).strip("-") or "experiment"
    document = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": f"fednorm-{slug}",
            "version": __version__,
            "description": f"fednorm experiment {config.name!r} on Flower",
            "license": "MIT",
            "dependencies": [FLWR_PIN, "fednorm"],
        },
        "tool": {"flwr": {"app": {
            "publisher": "fednorm",
            "components": APP_COMPONENTS,
            "config": {
                "experiment": experiment_text(config),
                "out": str(Path(out).expanduser().resolve()),
                "round-timeout": float(options.round_timeout or 0.0),
                "node-wait": float(options.node_wait),
                "resume": bool(resume),
            },
        }}},
    }
    path = app_dir / "pyproject.toml"
    path.write_text("# written by `fednorm flower app`: run it with `flwr run <this folder> <superlink>`\n"
                    + tomli_w.dumps(document, multiline_strings=True))
    return path


def node_config_string(values: dict) -> str:
    """``--node-config`` text for ``values`` (strings quoted as Flower parses TOML values)."""
    parts = []
    for k, v in values.items():
        parts.append(f"{k}={v}" if isinstance(v, (int, float)) and not isinstance(v, bool) else f'{k}="{v}"')
    return " ".join(parts)


# ------------------------------------------------------------------------------------------ localhost deployment
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """A Flower command of this Python environment."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


@dataclass
class LocalDeployment:
    """A SuperLink and one SuperNode per entry of ``node_configs``, each its own process on localhost.

    Insecure (no TLS) unless ``tls`` gives (ca_cert, server_cert, server_key); ``auth_keys`` gives each
    node's private key file (node authentication, needs TLS; their public keys are registered with
    ``flwr supernode register`` by :meth:`start`). Logs go to ``workdir``; Flower's own files under
    ``workdir/flwr-home`` (FLWR_HOME), never the user's ~/.flwr."""

    workdir: Path
    node_configs: list[dict]
    tls: tuple[Path, Path, Path] | None = None
    auth_keys: list[Path] | None = None
    port: int = 0
    node_ports: list[int] = field(default_factory=list)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home = self.workdir / "flwr-home"
        self.home.mkdir(exist_ok=True)
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # flower-superexec
        self.env = {**os.environ, "PATH": path, "FLWR_HOME": str(self.home), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _security(self, server: bool) -> list[str]:
        if self.tls is None:
            return ["--insecure"]
        ca, cert, key = (str(p) for p in self.tls)
        return ["--ssl-ca-certfile", ca, "--ssl-certfile", cert, "--ssl-keyfile", key] if server else \
            ["--root-certificates", ca]

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                start_new_session=True)
        self.processes[name] = proc
        return proc

    def start(self, timeout: float = 180.0) -> "LocalDeployment":
        """Start the SuperLink, write the connection ``local`` into FLWR_HOME, register node keys, start the nodes."""
        self.port = self.port or free_port()
        argv = [_bin("flower-superlink"), *self._security(True), "--port", str(self.port),
                "--disable-runtime-dependency-installation"]
        if self.auth_keys:
            argv.append("--enable-supernode-auth")
        self._spawn("superlink", argv)
        self._wait_for_port(self.port, timeout)
        connection = {"address": self.address}
        if self.tls is None:
            connection["insecure"] = True
        else:
            connection["root-certificates"] = str(Path(self.tls[0]).resolve())
        (self.home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": "local", "local": connection}}))
        for i, key in enumerate(self.auth_keys or []):
            self.flwr(["supernode", "register", str(Path(key).with_suffix(".pub")), "local"], timeout=timeout,
                      log=f"register{i}")
        for i, cfg in enumerate(self.node_configs):
            self.start_node(i, cfg)
        return self

    def start_node(self, i: int, cfg: dict, key: Path | None = None) -> subprocess.Popen:
        """Start SuperNode ``i`` with node config ``cfg`` (and private key ``key``, default its auth key)."""
        port = free_port()
        self.node_ports.append(port)
        argv = [_bin("flower-supernode"), *self._security(False), "--superlink", self.address, "--port", str(port),
                "--node-config", node_config_string(cfg)]
        key = key or (self.auth_keys[i] if self.auth_keys else None)
        if key:
            argv += ["--auth-supernode-private-key", str(key)]
        return self._spawn(f"supernode{i}", argv)

    def _wait_for_port(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.processes["superlink"].poll() is not None:
                raise RunError(f"the SuperLink exited; see {self.workdir / 'superlink.log'}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise RunError(f"the SuperLink did not open port {port} within {timeout:.0f} s; its log "
                       f"{self.workdir / 'superlink.log'} shows how far it got (a busy machine starts it slowly)")

    def flwr(self, args: list[str], timeout: float | None = None, log: str = "flwr") -> subprocess.CompletedProcess:
        """Run a ``flwr`` command with this deployment's FLWR_HOME; its output goes to ``workdir/<log>.log``."""
        with open(self.workdir / f"{log}.log", "ab") as fh:
            done = subprocess.run([_bin("flwr"), *args], stdout=fh, stderr=subprocess.STDOUT, env=self.env,
                                  cwd=self.workdir, timeout=timeout)
        if done.returncode != 0:
            raise RunError(f"`flwr {' '.join(args)}` failed; see {self.workdir / f'{log}.log'}")
        return done

    def run_app(self, app_dir: str | Path, timeout: float | None = None) -> subprocess.Popen:
        """Start ``flwr run APP_DIR local --stream`` (returns at once; wait on the process)."""
        return self._spawn("flwr-run", [_bin("flwr"), "run", str(Path(app_dir).resolve()), "local", "--stream"])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process ``name`` only (a crash of that node: its children are left to notice)."""
        proc = self.processes[name]
        if proc.poll() is None:
            proc.send_signal(sig)

    def stop(self) -> None:
        """End every process this deployment started, each by its own process group."""
        for name, proc in reversed(list(self.processes.items())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.processes.values():  # children of a SIGKILLed node, still in its group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def __enter__(self) -> "LocalDeployment":
        try:
            return self.start()
        except BaseException:  # a start that fails half-way (SuperLink slow or gone, a node key refused) leaves no
            self.stop()        # process behind: __exit__ does not run when __enter__ raises
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def run_local(config: ExperimentConfig, out: str | Path, workdir: str | Path, data_dir: str | None = None,
              options: FlowerOptions = FlowerOptions(), timeout: float | None = None, resume: bool = False) -> Path:
    """Run ``config`` on the deployment runtime on this machine: one SuperNode process per client, each keeping
    its client's state under ``workdir/node_state`` (so a stopped run resumes: ``resume``)."""
    out = Path(out).resolve()
    check_out(out, resume)
    workdir = Path(workdir)
    app = workdir / "app"
    write_app(app, config, out, options, resume=resume)
    state = str((workdir / NODE_STATE_FOLDER).resolve())
    nodes = [{"client-index": i, NODE_STATE_DIR: state,
              **({NODE_DATA_DIR: str(Path(data_dir).resolve())} if data_dir else {})}
             for i in range(federation_size(config, data_dir))]
    with LocalDeployment(workdir, nodes) as deployment:
        proc = deployment.run_app(app)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RunError(f"the Flower run did not finish within {timeout} s; logs in {workdir}") from None
    if not (out / "results.md").exists():
        raise RunError(f"the Flower run ended without results in {out}; see {workdir / 'flwr-run.log'}")
    return out
