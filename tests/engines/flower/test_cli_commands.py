"""`fednorm flower sim | local | app | clients`: what they refuse before Ray or a SuperLink starts, what the app
folder carries to the server, and which client each printed --node-config gives a SuperNode. Nothing here trains."""

import tomllib

import pytest
from typer.testing import CliRunner

from fednorm.cli.main import app
from fednorm.engines.flower import runtime
from fednorm.engines.flower.node import NodeSpec
from fednorm.engines.flower.server import ServerSettings
from fednorm.runs.config import load_config
from fednorm.runs.runner import RunError

from ...conftest import TINY_RUN

SETS = [arg for item in TINY_RUN for arg in ("--set", item)]


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)
    return result, " ".join(result.output.split())


def test_a_fresh_run_into_a_folder_that_holds_one_is_refused_before_anything_starts(tmp_path, monkeypatch):
    # else the server's refusal would only reach a log, and `flower local` would print the old run's table
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    config = load_config("default", TINY_RUN)
    for launch in (lambda: runtime.simulate(config, run), lambda: runtime.run_local(config, run, tmp_path / "work")):
        with pytest.raises(RunError, match="already holds a run; resume it with --resume or choose another --out"):
            launch()
    assert not (tmp_path / "work").exists() and not (run / "node_state").exists()
    written, text = invoke("flower", "app", tmp_path / "app", *SETS, "--out", run)
    assert written.exit_code == 2 and "already holds a run" in text and not (tmp_path / "app").exists()
    # the other way round: a resume with a config given, of a folder that holds no run
    empty = tmp_path / "empty"
    for command in ("sim", "local"):
        result, text = invoke("flower", command, "default", *SETS, "--out", empty, "--resume")
        assert result.exit_code == 2 and f"{empty} holds no run to resume (no config.yaml)" in text, command
    assert not empty.exists() and not (tmp_path / "empty-flower").exists()


@pytest.mark.parametrize("method", ["centralized", "centralized_bn"])
def test_a_centralized_reference_is_refused_by_every_flower_command_before_it_starts(tmp_path, monkeypatch, method):
    def must_not_start(*args, **kwargs):
        raise AssertionError("the runtime started")

    monkeypatch.setattr(runtime, "simulate", must_not_start)
    monkeypatch.setattr(runtime, "run_local", must_not_start)
    sets = [*SETS, "--set", f"methods=[fedavg, {method}]", "--set", "training.steps=1"]
    for command in (["sim"], ["local"], ["app", tmp_path / "app"]):
        result, text = invoke("flower", *command, *sets, "--out", tmp_path / "run")
        assert result.exit_code == 2, (command, text)
        assert f"method '{method}' trains one centralized model on the clients' pooled data" in text
        assert "run it in-process with `fednorm run`" in text
    assert not (tmp_path / "app").exists() and not (tmp_path / "run").exists()


def test_the_app_folder_carries_the_experiment_and_the_server_options_to_the_server(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result, text = invoke("flower", "app", "appdir", *SETS, "--out", "rel", "--round-timeout", "0",
                          "--node-wait", "7")
    assert result.exit_code == 0, text
    run_config = tomllib.loads((tmp_path / "appdir" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert run_config["out"] == str(tmp_path / "rel")  # absolute: the SuperLink does not run in this folder
    settings = ServerSettings.from_run_config(run_config)
    assert settings.options.round_timeout is None  # 0 on the command line: wait forever
    assert settings.options.node_wait == 7.0 and not settings.resume
    from fednorm.engines.flower.node import load_experiment

    assert load_experiment(settings.experiment).model_dump() == load_config("default", TINY_RUN).model_dump()
    with pytest.raises(RunError, match=r"lacks \['experiment'\]; write the app folder with `fednorm flower app`"):
        ServerSettings.from_run_config({"out": "x"})
    timed, _ = invoke("flower", "app", "appdir2", *SETS, "--out", "rel", "--round-timeout", "45")
    assert timed.exit_code == 0
    run_config = tomllib.loads((tmp_path / "appdir2" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert ServerSettings.from_run_config(run_config).options.round_timeout == 45.0
    for option in ("--round-timeout", "--node-wait"):  # a negative wait is a typo, not "forever"
        refused, text = invoke("flower", "app", "appdir3", *SETS, "--out", "rel", option, "-5")
        assert refused.exit_code == 2 and option in text
    assert not (tmp_path / "appdir3").exists()


def test_flower_clients_prints_the_node_config_of_the_node_that_holds_each_client(tmp_path):
    sets = [*SETS, "--set", "external.domains=[rendered/street]"]
    result = CliRunner().invoke(app, ["flower", "clients", *sets], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "3 clients" in result.output
    config = load_config("default", [*TINY_RUN, "external.domains=[rendered/street]"])
    rows = [line.split("│")[1:-1] for line in result.output.splitlines() if "client-index=" in line]
    assert len(rows) == 3
    for index, name, _, _, _, role, node_config in (tuple(c.strip() for c in row) for row in rows):
        k = int(index)
        assert node_config == f"client-index={k} data-dir='DIR'"
        held = NodeSpec.from_node_config({"client-index": k}).clients(config)
        assert list(held) == [k] and held[k].name == name
        assert role == ("external" if name == "rendered/street" else "trains")


def test_a_resume_with_set_values_and_no_config_edits_the_run_folders_config_not_the_default_preset(
        tmp_path, monkeypatch):
    from fednorm.runs.runner import load_run_config, start_run

    run = tmp_path / "run"
    start_run(load_config("default", [*TINY_RUN, "methods=[fedbn]", "federation.rounds=1"]), run)
    seen = []
    monkeypatch.setattr(runtime, "simulate", lambda config, out, **kwargs: seen.append((config, kwargs["resume"])))
    result, text = invoke("flower", "sim", "--out", run, "--resume", "--set", "federation.round_timeout_note=x")
    assert result.exit_code == 2 and f"invalid config {run / 'config.yaml'}" in text and "unknown key" in text
    result, text = invoke("flower", "sim", "--out", run, "--resume", "--set", "federation.eval_every=1")
    assert result.exit_code == 0, text
    (config, resume), = seen
    expected = load_run_config(run).model_dump()
    expected["federation"]["eval_every"] = 1
    assert resume and config.model_dump() == expected  # the run's config (its domains, fedbn, 1 round) edited
