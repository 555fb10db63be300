"""training.augment through the engines: training batches augmented from their own stream, evaluation and external
clients on the untouched images, augment none bit-identical to a run without the option, every training path."""

import pytest
import torch

from fednorm.data.domain import ClientData, normalize_batch
from fednorm.methods.amplitude import amplitude_normalizer
from fednorm.engines.seeds import augment_generator
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method
from fednorm.methods.amplitude import AmplitudePrepare
from fednorm.methods.augment import BatchAugment
from fednorm.methods.local_update import batch_schedule
from fednorm.models import DigitCNN
from fednorm.runs import store
from fednorm.runs.config import ConfigError, load_config
from fednorm.runs.runner import build_engine, build_federation_data, resume_run, start_run

from ..conftest import TINY_RUN, make_split, record_client_messages, tiny_run_config

AUGMENTED = LocalTraining(batch_size=8, lr=0.05, augment="fedbn_objects")
def tiny_config(*extra):
    """The tiny federation of the run tests, 2 rounds, evaluated every round."""
    return tiny_run_config("federation.rounds=2", "federation.eval_every=1", *extra)


def expected_training_inputs(plan, training: LocalTraining) -> list[torch.Tensor]:
    """The model inputs of a round: each client's batches from its round seed, augmented from the seed's own stream."""
    out = []
    for client, instructions in plan:
        schedule = batch_schedule(client.num_train, training, torch.Generator().manual_seed(instructions.seed), True)
        augment = BatchAugment(training.augment, augment_generator(instructions.seed))
        out += [normalize_batch(augment(client.train.x[index])) for index in schedule]
    return out


def test_training_sees_augmented_batches_and_evaluation_the_images(tiny_clients):
    external = ClientData("ext", "dx", make_split(8, seed=9), make_split(12, seed=19, shift=20.0))
    seen: list[tuple[str, torch.Tensor]] = []
    phase = ["train"]
    torch.manual_seed(0)
    model = DigitCNN(width=0.125)
    # a hook, not an attribute: external evaluation deep-copies the model, and the copy keeps calling it
    model.register_forward_pre_hook(lambda module, args: seen.append((phase[0], args[0].detach().clone())))
    eng = InProcessEngine(model, tiny_clients, resolve_method("fedbn"), AUGMENTED,
                          Federation(seed=0, channels_last=False), normalize_batch, external_clients=[external])
    plan = eng.round_plan(0)
    eng.run_round()
    got = [x for p, x in seen if p == "train"]
    expected = expected_training_inputs(plan, AUGMENTED)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    first = batch_schedule(24, AUGMENTED, torch.Generator().manual_seed(plan[0][1].seed), True)[0]
    assert not torch.equal(got[0], normalize_batch(tiny_clients[0].train.x[first]))  # not the plain batch
    seen.clear()
    phase[0] = "evaluate"
    evaluations = eng.evaluate(("test",))
    assert {e.client for e in evaluations} >= {"c0", "ext:global", "ext:test_time_bn", "ext:fedbn_average"}
    rows = torch.cat([x for _, x in seen]).flatten(1)
    images = torch.cat([normalize_batch(c.test.x) for c in [*tiny_clients, external]]).flatten(1)
    assert all((images == row).all(1).any() for row in rows)  # every evaluated input is an untouched test image


def test_harmofl_amplitude_is_taken_on_the_augmented_training_batches(tiny_clients):
    """Augmentation composes before HarmoFL's amplitude normalization: round 1's client amplitude is the running
    amplitude of the augmented batches, the uint8 images augmented before /255, amplitude and standardization."""
    torch.manual_seed(3)
    eng = InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("harmofl"), AUGMENTED,
                          Federation(seed=0, channels_last=False), normalize_batch)
    messages = record_client_messages(eng)
    plan = eng.round_plan(0)
    eng.run_round()
    for (client, instructions), message in zip(plan, messages):
        normalizer = amplitude_normalizer(eng.method, None).train()
        augment = BatchAugment("fedbn_objects", augment_generator(instructions.seed))
        for index in batch_schedule(client.num_train, AUGMENTED, torch.Generator().manual_seed(instructions.seed),
                                    True):
            AmplitudePrepare(normalizer)(augment(client.train.x[index]))
        torch.testing.assert_close(message["amp.client"], normalizer.amplitude, rtol=0, atol=0)


def trained(config) -> dict[str, dict[str, torch.Tensor]]:
    """Each method's global and local states after the config's rounds (the runner's engine, in memory)."""
    clients = build_federation_data(config, None)
    out = {}
    for m in config.methods:
        engine = build_engine(config, m, config.seeds[0], clients)
        while engine.round < config.federation.rounds:
            engine.run_round()
        out[m.display] = {**engine.global_state,
                          **{f"{c}.{k}": v for c, s in engine.local_states.items() for k, v in s.items()}}
    return out


def assert_same_states(a, b):
    assert a.keys() == b.keys()
    for label in a:
        assert a[label].keys() == b[label].keys()
        assert all(torch.equal(a[label][k], b[label][k]) for k in a[label]), label


def differs(a, b) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a if k in b)


def test_augment_none_is_bit_identical_to_a_run_without_the_option(monkeypatch):
    methods = "methods=[fedbn]"  # HarmoFL's prepare: test_harmofl_amplitude_is_taken_on_the_augmented_training_batches
    absent = tiny_config(methods)
    assert "augment" not in str(TINY_RUN) and absent.training.augment == "none"
    plain = trained(absent)
    # under "none" the engines build no augmentation stream and train_locally no augmentation: nothing draws
    import fednorm.engines.client_step as client_step
    import fednorm.engines.simulation as simulation
    import fednorm.methods.local_update as local_update

    def refuse(*args, **kwargs):
        raise AssertionError("augment: none built an augmentation")

    with monkeypatch.context() as patch:
        for module, name in ((client_step, "augment_generator"), (simulation, "augment_generator"),
                             (local_update, "BatchAugment")):
            patch.setattr(module, name, refuse)
        assert_same_states(trained(tiny_config(methods, "training.augment=none")), plain)
    augmented = trained(tiny_config(methods, "training.augment=fedbn_objects"))
    assert all(differs(augmented[label], plain[label]) for label in plain)  # the option does act


def training_inputs_by_hand(engine, r: int) -> list[torch.Tensor]:
    """Round ``r``'s model inputs on the engine's training path, built by hand: each participant's batches from its
    round seed, augmented from the seed's own stream; under centralized BN (union batches) the concatenation of the
    participants' s-th batches, augmented from the round's own seed, one union batch per local step."""
    plan, training = engine.round_plan(r), engine._round_training(r)
    if not engine.method.union_batches:
        return expected_training_inputs(plan, training)
    from fednorm.data.domain import Split
    from fednorm.engines.seeds import derive_seed
    from fednorm.engines.simulation import _CLIENT_STREAM

    schedules, offsets, offset = [], [], 0
    for client, instructions in plan:
        schedules.append(batch_schedule(client.num_train, training, torch.Generator().manual_seed(instructions.seed),
                                        True))
        offsets.append(offset)
        offset += client.num_train
    union = Split.concat([client.train for client, _ in plan])
    augment = BatchAugment(training.augment, augment_generator(derive_seed(engine.federation.seed, r, _CLIENT_STREAM)))
    return [normalize_batch(augment(union.x[torch.cat([sched[s] + off for sched, off in zip(schedules, offsets)])]))
            for s in range(len(schedules[0]))]


# every path that trains: per-client (FedBN above), centralized (one pooled client), SingleSet (each client alone),
# centralized BN (union batches), DSGD (one step per round): every training input of two rounds is the augmented
# batch built by hand, and the same seed gives the same weights
@pytest.mark.parametrize("extra", [
    ["methods=[centralized, singleset]"],
    ["methods=[centralized_bn]", "training.steps=2"],
    ["methods=[fedavg]", "federation.pattern=dsgd"],
])
def test_every_training_path_trains_on_the_augmented_batches_reproducibly(extra):
    on = tiny_config(*extra, "training.augment=fedbn_objects")
    clients = build_federation_data(on, None)
    for method in on.methods:
        engine = build_engine(on, method, on.seeds[0], clients)
        seen: list[torch.Tensor] = []
        engine.model.register_forward_pre_hook(
            lambda module, args: seen.append(args[0].detach().clone()) if module.training else None)
        for r in range(on.federation.rounds):
            expected = training_inputs_by_hand(engine, r)
            seen.clear()
            engine.run_round()
            assert len(seen) == len(expected) > 0, method.display
            assert all(torch.equal(a, b) for a, b in zip(seen, expected)), (method.display, r)
    a, plain = trained(on), trained(tiny_config(*extra))
    assert_same_states(trained(on), a)
    assert all(differs(a[label], plain[label]) for label in a)


class Stop(Exception):
    pass


def test_a_resumed_augmented_run_equals_an_uninterrupted_one(tmp_path):
    config = tiny_config("methods=[fedbn]", "training.augment=fedbn_objects", "federation.rounds=3")

    def stop_after_round_2(label, seed, rnd, rounds, last):
        if rnd == 2:
            raise Stop()

    start_run(config, tmp_path / "straight")
    with pytest.raises(Stop):
        start_run(config, tmp_path / "stopped", progress=stop_after_round_2)
    cell = "fedbn/seed0"
    assert store.load_checkpoint(tmp_path / "stopped" / cell / store.CHECKPOINT_FILE)["round"] == 2
    resume_run(tmp_path / "stopped")
    assert store.read_metrics(tmp_path / "stopped" / cell / store.METRICS_FILE) == \
        store.read_metrics(tmp_path / "straight" / cell / store.METRICS_FILE)
    a, b = (store.load_checkpoint(tmp_path / run / cell / store.CHECKPOINT_FILE) for run in ("stopped", "straight"))
    assert a["round"] == b["round"] == 3
    assert_same_states({"global": a["global_state"], **a["local_states"]},
                       {"global": b["global_state"], **b["local_states"]})


@pytest.mark.parametrize("preset, what", [
    ("fedbn_abide", "hold feature vectors"),
    ("harmofl_prostate", "are segmentation, whose masks"),
    ("harmofl_nuclei", "are segmentation, whose masks"),
])
def test_config_refuses_augment_off_image_classification(preset, what):
    with pytest.raises(ConfigError, match=f"training.augment 'fedbn_objects'.*{what}"):
        load_config(preset, ["training.augment=fedbn_objects"])
    assert load_config(preset, ["training.augment=none"]).training.augment == "none"
    if what.startswith("are segmentation"):  # the quarter-turn augmentation moves the masks too
        assert load_config(preset, ["training.augment=rot90_flip"]).training.augment == "rot90_flip"
    else:
        with pytest.raises(ConfigError, match="training.augment 'rot90_flip'.*hold feature vectors"):
            load_config(preset, ["training.augment=rot90_flip"])


def test_config_passes_augment_to_local_training():
    config = tiny_config("training.augment=fedbn_objects")
    assert config.training.build(task=config.task()).augment == "fedbn_objects"
    with pytest.raises(ConfigError, match="training.augment"):
        tiny_config("training.augment=flip")


def test_augment_validation_scores_freshly_augmented_validation_images_and_never_test_ones():
    """FedBN's Office code validates on a Subset of its augmented training set: with training.augment_validation the
    engine scores each client's validation images through the augmentation, drawn from the run seed, the rounds
    completed and the client's name (a new draw at every evaluation); test images are never augmented."""
    from fednorm.engines.seeds import validation_augment_generator

    config = tiny_config("methods=[fedavg]", "training.augment=fedbn_objects", "data.val_fraction=0.25",
                         "training.augment_validation=true")
    clients = build_federation_data(config, None)
    engine = build_engine(config, config.methods[0], config.seeds[0], clients)
    engine.run_round()
    scored = {(e.client, e.split): (e.accuracy, e.loss) for e in engine.evaluate()}
    client = engine.eval_clients[0]
    engine.load_client(client.name)
    augmented = BatchAugment("fedbn_objects", validation_augment_generator(engine.federation.seed, 1, client.name))
    step = engine.federation.eval_batch_size  # drawn chunk by chunk, in order, from the one generator
    x = torch.cat([augmented(client.val.x[i:i + step]) for i in range(0, len(client.val), step)])
    by_hand = engine.evaluate_split(type(client.val)(x, client.val.y))
    assert scored[(client.name, "val")] == pytest.approx(by_hand, abs=1e-12)
    assert by_hand[1] != pytest.approx(engine.evaluate_split(client.val)[1], abs=1e-6)  # not the stored images
    assert scored[(client.name, "test")] == pytest.approx(engine.evaluate_split(client.test), abs=1e-12)
    first = engine.augmented_validation(client.name, client.val).x
    engine.run_round()
    assert not torch.equal(engine.augmented_validation(client.name, client.val).x, first)  # new draws each round
    with pytest.raises(ConfigError, match="which is none"):
        tiny_config("training.augment_validation=true")
    with pytest.raises(ConfigError, match="perfedavg_eval_steps: 0 or augment_validation: false"):
        tiny_config("methods=[perfedavg]", "training.augment=fedbn_objects", "training.augment_validation=true")
    with pytest.raises(ConfigError, match="cross-silo protocol"):
        tiny_config("methods=[fedavg]", "training.augment=fedbn_objects", "training.augment_validation=true",
                    "federation.setting=cross_device")


def test_each_client_keeps_its_per_run_augmentation_draws_every_round(monkeypatch):
    """FLamby draws Fed-ISIC2019's hole count once per client dataset: the engine hands every BatchAugment of a
    client the same per-run generator, seeded from the run's seed and the client's name, round after round, and
    different clients (and another run seed) get other streams."""
    import fednorm.methods.local_update as local_update
    from fednorm.engines.seeds import client_augment_generator

    built: list[tuple[int, int]] = []  # (round, per-run generator's seed) of each BatchAugment

    class Recording(BatchAugment):
        def __init__(self, name, generator, client_generator=None):
            built.append((engine.round, client_generator.initial_seed()))
            super().__init__(name, generator, client_generator)

    monkeypatch.setattr(local_update, "BatchAugment", Recording)
    config = tiny_config("methods=[fedbn]", "training.augment=fedbn_objects")
    clients = build_federation_data(config, None)
    engine = build_engine(config, config.methods[0], config.seeds[0], clients)
    names = [c.name for c, _ in engine.round_plan(0)]
    engine.run_round()
    engine.run_round()
    expected = [client_augment_generator(config.seeds[0], n).initial_seed() for n in names]
    assert built == [(r, s) for r in (0, 1) for s in expected]
    assert len(set(expected)) == len(names)
    assert client_augment_generator(config.seeds[0] + 1, names[0]).initial_seed() != expected[0]
