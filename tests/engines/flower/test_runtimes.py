"""Flower's real runtimes: a SuperLink and SuperNodes as separate processes on localhost (deployment), and
the Ray simulation. Slow (process and Ray start-up): marked integration, each well under two minutes."""

import json
import signal
import time

import pytest

from fednorm.engines.flower.runtime import LocalDeployment, simulate, write_app
from fednorm.engines.flower.server import PARTICIPATION_FILE, FlowerOptions
from fednorm.runs import store
from fednorm.runs.runner import start_run

from .conftest import tiny_config
from .test_equivalence import bn_keys, model_keys

pytestmark = pytest.mark.integration


def metrics(run, label="fedbn"):
    return store.read_metrics(run / label / "seed0" / store.METRICS_FILE)


def assert_same_metrics(flower: list[dict], in_process: list[dict]) -> None:
    """The same records, floats equal to float tolerance: the SuperNodes / Ray workers are other processes whose
    torch thread count (hence float summation order) may differ from this one's; ints and names exactly."""
    assert len(flower) == len(in_process)
    for a, b in zip(flower, in_process):
        assert a.keys() == b.keys(), (a, b)
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a, b)
            else:
                assert a[key] == b[key], (key, a, b)


def wait(proc, seconds):
    try:
        return proc.wait(timeout=seconds)
    except Exception:
        proc.kill()
        raise


def test_deployment_fedbn_equals_in_process_and_keeps_bn_on_the_nodes(tmp_path):
    config = tiny_config("federation.rounds=2", "federation.eval_every=2")
    start_run(config, tmp_path / "in_process")
    write_app(tmp_path / "app", config, tmp_path / "flower", FlowerOptions(round_timeout=120, node_wait=60))
    nodes = [{"clients": "rendered/print"}, {"client-index": 1}]
    with LocalDeployment(tmp_path / "work", nodes) as deployment:
        assert wait(deployment.run_app(tmp_path / "app"), 240) == 0
    assert (tmp_path / "flower" / "results.md").exists(), (tmp_path / "work" / "flwr-run.log").read_text()[-3000:]
    assert_same_metrics(metrics(tmp_path / "flower"), metrics(tmp_path / "in_process"))
    # what the server sent and received: every entry of the model except the BatchNorm ones, both ways
    bn = bn_keys(config)
    shared = model_keys(config) - bn
    assert bn and shared
    for record in store.read_metrics(tmp_path / "flower" / "fedbn" / "seed0" / PARTICIPATION_FILE):
        if record["kind"] == "train":
            assert record["clients_used"] == 2
            assert set(record["received_keys"]) == set(record["sent_keys"]) == shared


def test_a_killed_supernode_is_left_out_and_the_run_finishes(tmp_path):
    config = tiny_config("data.domains=[rendered/print, rendered/neon, rendered/synth]", "federation.rounds=2",
                         "federation.eval_every=2")
    write_app(tmp_path / "app", config, tmp_path / "flower", FlowerOptions(round_timeout=45, node_wait=60))
    nodes = [{"client-index": i} for i in range(3)]
    cell = tmp_path / "flower" / "fedbn" / "seed0"
    with LocalDeployment(tmp_path / "work", nodes) as deployment:
        run = deployment.run_app(tmp_path / "app")
        deadline = time.monotonic() + 180
        while not any(r["round"] == 1 for r in metrics(tmp_path / "flower")):
            assert run.poll() is None and time.monotonic() < deadline, "round 1 never finished"
            time.sleep(0.2)
        deployment.kill("supernode2", signal.SIGKILL)
        assert wait(run, 180) == 0
    rounds = [r for r in store.read_metrics(cell / PARTICIPATION_FILE) if r["kind"] == "train"]
    assert [r["clients_used"] for r in rounds] == [3, 2]
    assert list(rounds[1]["dropped"]) == ["rendered/synth"]
    tests = [r for r in metrics(tmp_path / "flower") if r["split"] == "test"]
    assert {r["client"] for r in tests} == {"rendered/print", "rendered/neon"}
    assert (tmp_path / "flower" / "results.md").exists()


def test_simulation_runtime_equals_in_process(tmp_path):
    config = tiny_config("federation.rounds=2", "federation.eval_every=2")
    start_run(config, tmp_path / "in_process")
    # Ray starts the simulated nodes; on a loaded 2-core machine that took over 60 s (a deadline, not a sleep)
    simulate(config, tmp_path / "flower", options=FlowerOptions(round_timeout=120, node_wait=300))
    assert_same_metrics(metrics(tmp_path / "flower"), metrics(tmp_path / "in_process"))


def _tls_material(folder):
    """A CA, a server certificate for localhost and two node keys, made with the commands of docs/flower.md."""
    import shutil
    import subprocess

    if not (shutil.which("openssl") and shutil.which("ssh-keygen")):
        pytest.skip("openssl and ssh-keygen are needed to make certificates and node keys")
    folder.mkdir()
    (folder / "certificate.conf").write_text(
        "[req]\nprompt = no\ndefault_md = sha256\nreq_extensions = req_ext\ndistinguished_name = dn\n"
        "[dn]\nO = fednorm\nCN = localhost\n[req_ext]\nsubjectAltName = @alt_names\n"
        "[alt_names]\nDNS.1 = localhost\nIP.1 = 127.0.0.1\nIP.2 = ::1\n")
    for cmd in ["openssl genrsa -out ca.key 2048",
                "openssl req -new -x509 -key ca.key -sha256 -subj /O=fednorm-CA -days 365 -out ca.crt",
                "openssl genrsa -out server.key 2048",
                "openssl req -new -key server.key -out server.csr -config certificate.conf",
                "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 365 "
                "-sha256 -extfile certificate.conf -extensions req_ext",
                *[f"ssh-keygen -q -t ecdsa -b 384 -N '' -C '' -f {name}" for name in ("node0", "node1", "intruder")]]:
        subprocess.run(cmd, shell=True, check=True, cwd=folder, capture_output=True)
    return folder


def test_deployment_with_tls_and_node_authentication(tmp_path):
    keys = _tls_material(tmp_path / "tls")
    config = tiny_config("federation.rounds=1", "federation.eval_every=1")
    write_app(tmp_path / "app", config, tmp_path / "flower", FlowerOptions(round_timeout=120, node_wait=60))
    nodes = [{"client-index": 0}, {"client-index": 1}]
    with LocalDeployment(tmp_path / "work", nodes, tls=(keys / "ca.crt", keys / "server.pem", keys / "server.key"),
                         auth_keys=[keys / "node0", keys / "node1"]) as deployment:
        deployment.start_node(2, {"client-index": 1}, key=keys / "intruder")  # its key was never registered
        assert wait(deployment.run_app(tmp_path / "app"), 240) == 0
    assert (tmp_path / "flower" / "results.md").exists(), (tmp_path / "work" / "flwr-run.log").read_text()[-3000:]
    assert "https://" in (tmp_path / "work" / "superlink.log").read_text()
    info = json.loads((tmp_path / "flower" / "flower.json").read_text())
    assert len(info["nodes"]) == 2  # the intruder never joined


def test_a_deployment_whose_start_fails_leaves_no_superlink_running(tmp_path, monkeypatch):
    """`with LocalDeployment(...)` whose start raises (here: the SuperLink's port never opens) must stop what it
    started: __exit__ does not run when __enter__ raises, and a SuperLink left behind holds its port and a core."""
    from fednorm.runs.runner import RunError

    def never_opens(self, port, timeout):
        raise RunError(f"the SuperLink did not open port {port}")

    monkeypatch.setattr(LocalDeployment, "_wait_for_port", never_opens)
    deployment = LocalDeployment(tmp_path / "work", [])
    with pytest.raises(RunError, match="did not open port"):
        with deployment:
            pass
    superlink = deployment.processes["superlink"]
    assert superlink.wait(timeout=30) is not None  # killed, not left running
