"""Experiment configuration: a validated YAML document (pydantic), with presets shipped in the package.

An experiment is a grid of methods x seeds over one federation (data, model, local training,
rounds). Unknown keys are rejected; every error names the offending key.
"""

from __future__ import annotations

import difflib
import warnings
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..data.corrupt import UNIFED_TYPES, corruption_type_fold
from ..data.domain import INPUT_NORMS
from ..data.federation import check_domain, check_medical_options, domain_task, image_size, num_classes, parse_domain
from ..data.partition import LABEL_SKEW_SCHEMES
from ..engines.device import DEVICE_PATTERN, resolve_device
from ..methods.aggregation import WEIGHTINGS
from ..methods.amplitude import VARIANTS as AMPLITUDE_VARIANTS
from ..methods.augment import AUGMENTS, FLAMBY_CROP, FLAMBY_MIN_SIDE, MASK_AUGMENTS
from ..methods.external import EXTERNAL_MODES, MOMENTUM_CONVENTIONS, PREDICTIONS
from ..methods.local_update import LocalTraining, native_bf16, resolve_channels_last, resolve_precision
from ..methods.policy import POLICIES, keeps_bn_state, keeps_bn_statistics
from ..methods.presets import PRESETS, Method, resolve_method
from ..methods.robust import ATTACKS
from ..methods.server import ROBUST_RULES, SERVER_OPTIMIZERS, SERVER_RULES
from ..methods.tasks import DICE_BACKGROUND, LOSSES, METRICS, Task, build_task
from ..models.alexnet import MIN_INPUT as ALEXNET_MIN_INPUT, PRETRAINED
from ..models.norm import BATCHNORM_KINDS, NORM_KINDS
from ..models.projection import add_projection_head
from ..models.registry import MODEL_NAMES, build_model, unsupported_options
from ..models.wsconv import WSConv2d


OnDivergence = Literal["stop", "record"]
ON_DIVERGENCE: tuple[str, ...] = get_args(OnDivergence)  # `fednorm resume --on-divergence` offers the same


# FedWon App. A.3: AGC is used at batch size 32 only; smaller batches train without it.
AGC_MIN_BATCH = 32
HEADLESS_NORMS = ("ws", "none")  # norms under which the fedbn classifier has no normalization layer


class ConfigError(ValueError):
    """The configuration is invalid; the message lists each problem with its key. ``unknown_keys``: the dotted keys
    no setting of this fednorm has (a typo, or a setting of a later fednorm)."""

    def __init__(self, message: str, unknown_keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.unknown_keys = tuple(unknown_keys)


class ConfigWarning(RuntimeWarning):
    """The configuration runs, but not as its paper or this machine intends (the message says what to set).

    Raised while pydantic validates, so Python's own location line would name pydantic's file; the CLI prints
    these as one ``warning:`` line instead."""


def _admits(annotation, kinds: tuple[type, ...]) -> bool:
    """Whether a field's annotation (through Optional, unions, Annotated and containers) admits one of ``kinds``."""
    if annotation in kinds:
        return True
    return any(_admits(arg, kinds) for arg in getattr(annotation, "__args__", ()) if arg is not Ellipsis)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        """``true`` / ``false`` where a number belongs is a mistake, not 1 / 0 (pydantic's lax mode would take
        ``federation.rounds=true`` as one round). Numbers written as strings ("1e-3", which YAML 1.1 reads as
        a string) are still parsed."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                if (isinstance(value, bool) and field is not None and _admits(field.annotation, (int, float))
                        and not _admits(field.annotation, (bool,))):
                    raise ValueError(f"{key} is a number, got {str(value).lower()}")
        return data


def _images_of(domain: str) -> str:
    """A domain without its prepared size: ``office_caltech10/amazon`` and ``...amazon@256`` are the same images."""
    return domain.split("@")[0]


class DataConfig(_Strict):
    domains: list[str] = Field(
        default_factory=lambda: ["rendered/print", "rendered/neon", "rendered/synth", "rendered/street"],
        min_length=1,
    )
    percent: float = Field(0.1, gt=0, le=1, description="share of the 7,438-sample pool per client")
    clients_per_domain: int = Field(1, ge=1, le=1000)
    partition: Literal["fedbn", "even", "iid", "gamma", "dirichlet"] = Field(
        "fedbn", description="fedbn: ten partitions, percent of the pool per client (<= 10 clients per domain); "
        "even: percent of the pool split evenly over clients_per_domain clients (cross-device); "
        "iid / gamma / dirichlet: label skew, the domain's pool_size training images over num_clients clients "
        "(FBN's gamma-similarity with gamma, Dirichlet with alpha)")
    num_clients: int = Field(10, ge=1, le=10000, description="label-skew partitions: clients per domain")
    val_fraction: float = Field(0.0, ge=0, lt=1, description="share of each client's training split held out "
                                "for validation (model selection by validation accuracy); 0: none")
    gamma: float = Field(1.0, ge=0, le=1, description="gamma-similarity: share of iid data (1 iid, 0 extreme)")
    alpha: float = Field(1.0, gt=0, description="Dirichlet concentration (small = more skewed)")
    dirichlet_form: Literal["per_class", "per_client"] = Field(
        "per_class", description="per_class: each class split over the clients by Dir(alpha) (FBN authors' byzfl "
        "library; unequal client sizes); per_client: each client's class mix from Dir(alpha p), equal sizes (Hsu et "
        "al. 2019, the FBN paper's citation)")
    test_domain: str | None = Field(None, description="label-skew partitions: test every client on this domain's "
                                    "whole pool (cifar10/test) and train on the whole pool of the domain")
    pool_size: int | None = Field(7438, ge=10, description="training images per domain that the clients' shares "
                                  "are cut from (FedBN's 7,438); null: each domain's whole training split, so "
                                  "clients differ in size as their datasets do (FedBN App. E.6)")
    split_seed: int = Field(0, ge=0, lt=2**32, description="seed of the stratified split (fixed across runs, as FedBN)")
    rendered_size: int = Field(9298, ge=20, description="images rendered per rendered domain")
    data_dir: str | None = Field(None, description="data folder, used when --data-dir is not given (then, on resume, the "
                                    "run's recorded folder, FEDNORM_DATA, the user cache)")
    truncate_train: bool | None = Field(
        None, description="medical domains: cut every site's training split to the smallest site's (first samples, "
        "as HarmoFL's code); null = the paper's choice per dataset (Camelyon17 and prostate yes, nuclei no)")
    medical_options: dict[str, Any] = Field(
        default_factory=dict, description="medical domains: options of the sites' loader, e.g. {split_by: slide} "
        "(Camelyon17), {fold: 1} (ABIDE), {val_fraction: 0.1} (Fed-ISIC2019); its seed is split_seed")
    input_norm: Literal[tuple(INPUT_NORMS)] = Field(  # type: ignore[valid-type]
        "half", description="images' per-channel standardization after /255: half = (x - 0.5) / 0.5, [-1, 1] (FedBN's "
        "digits code; the default); unit = [0, 1], ToTensor only (FedBN's Office / DomainNet code); imagenet = "
        "torchvision's ImageNet mean and std, RGB only (pretrained weights, FLamby); raw = [0, 255] (HarmoFL's "
        "prostate code)")
    center_crop: int | None = Field(
        None, ge=8, description="the central crop of every image batch in the input pipeline (training, evaluation, "
        "external clients, diagnostics); a training batch that the augmentation already cropped to this size "
        "(flamby_isic: random 200 crops) passes as it is. FLamby's Fed-ISIC2019 tests on CenterCrop(200). Image "
        "classification only")
    standardize_features: bool = Field(
        True, description="feature-vector domains (ABIDE): standardize each site with its own training mean/std "
        "(Fed_ABIDE's per-site sepnorm)")

    @model_validator(mode="after")
    def _partition_fits(self) -> "DataConfig":
        if self.partition == "fedbn":
            per_client = max(1, round(self.percent * 10)) if self.percent >= 0.1 else 1
            if self.clients_per_domain * per_client > 10:
                raise ValueError(
                    f"partition fedbn cuts each domain into 10 partitions: {self.clients_per_domain} clients at "
                    f"percent {self.percent:g} do not fit; use partition: even for more clients per domain")
        return self

    @field_validator("domains")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        for d in value:
            check_domain(d)
        bases = [_images_of(d) for d in value]
        if len(set(bases)) != len(bases):
            raise ValueError("domains must be distinct (a domain at two prepared sizes is one domain)")
        return value


class ModelConfig(_Strict):
    name: Literal[MODEL_NAMES] = "digit_cnn"  # type: ignore[valid-type]
    norm: Literal[NORM_KINDS] = "bn"  # type: ignore[valid-type]
    classifier: Literal["fedbn", "fedwon"] = Field(
        "fedbn", description="digit_cnn / alexnet only: fedbn = BN after FC1, FC2; fedwon = dropout, no norm")
    width: float = Field(1.0, gt=0, le=4)
    ws_variance: Literal["unbiased", "biased"] = Field(
        "unbiased", description="WSConv variance: unbiased as FedWon's Listing 1 (torch.var), biased as its Eq. 3")
    bn_mode: Literal["running", "batch"] = Field(
        "running", description="unet / densenet121 only: batch = HarmoFL code's BatchNorm (no affine, batch statistics "
        "at evaluation too; no BN state for FedBN to keep local); running = the usual BatchNorm")
    code_zero_pad: bool = Field(
        False, description="densenet121 only: the HarmoFL code's ZeroPad2d(2) after the first dense block")
    pretrained: Literal[PRETRAINED] = Field(  # type: ignore[valid-type]
        "none", description="alexnet only: imagenet = convs and FC1, FC2 from torchvision's ImageNet AlexNet "
        "(UniFed CIFAR-10-C), class layer and normalization layers fresh; needs width 1 and a norm other than ws")
    input_size: int | None = Field(
        None, ge=1, description="alexnet only: resize every batch to input_size x input_size (bilinear) at the start "
        "of the forward pass, e.g. 224 for 32 x 32 CIFAR images and the ImageNet weights (UniFed's size is lost)")
    projection_dim: int | None = Field(
        None, ge=1, description="MOON's projection head (the paper's 256): the output layer becomes Linear(d, d) -> "
        "ReLU -> Linear(d, projection_dim) -> Linear(projection_dim, classes), and MOON contrasts the projection's "
        "output; for every method of the run, as MOON's code trains its baselines with the same network. Unset: "
        "no head, MOON contrasts the output layer's input")

    @model_validator(mode="after")
    def _projection_needs_a_linear_output(self) -> "ModelConfig":
        if self.projection_dim is not None and self.name == "unet":
            raise ValueError("model.projection_dim: the U-Net ends in a 1 x 1 convolution, not a linear output layer "
                             "for MOON's projection head to precede; leave model.projection_dim unset")
        return self

    @model_validator(mode="after")
    def _options_the_model_takes(self) -> "ModelConfig":
        # checked when the config is read, not when the first cell builds its model
        options = {k: getattr(self, k) for k in ("classifier", "width", "bn_mode")}
        bad = unsupported_options(self.name, options)
        if bad:
            raise ValueError(f"model {self.name!r} has no option {bad[0]!r}: remove model.{bad[0]} (set to "
                             f"{options[bad[0]]!r}; this model takes it only at its default, "
                             f"{type(self).model_fields[bad[0]].default!r})")
        return self

    @model_validator(mode="after")
    def _zero_pad_is_densenets(self) -> "ModelConfig":
        if self.code_zero_pad and self.name != "densenet121":
            raise ValueError(f"model.code_zero_pad is the HarmoFL code's DenseNet-121 padding; model {self.name!r} has "
                             "none (set model.name: densenet121 or leave it false)")
        return self

    @model_validator(mode="after")
    def _pretrained_and_input_size_are_alexnets(self) -> "ModelConfig":
        if self.pretrained != "none":
            if self.name != "alexnet":
                raise ValueError(f"model.pretrained: only alexnet has pretrained weights here, not {self.name!r} "
                                 "(set model.name: alexnet or model.pretrained: none)")
            if self.width != 1:
                raise ValueError(f"model.pretrained: the ImageNet weights have the papers' layer sizes; model.width "
                                 f"must be 1, got {self.width:g}")
            if self.norm == "ws":
                raise ValueError("model.pretrained: norm ws standardizes the convolutions' filters, which would "
                                 "rescale the pretrained ones; choose another model.norm (UniFed adds BN: bn)")
        if self.input_size is not None:
            if self.name != "alexnet":
                raise ValueError(f"model.input_size: only alexnet resizes its inputs, not {self.name!r} "
                                 "(set model.name: alexnet or leave it unset)")
            if self.input_size < ALEXNET_MIN_INPUT:
                raise ValueError(f"model.input_size: alexnet needs at least {ALEXNET_MIN_INPUT} (its third max-pool), "
                                 f"got {self.input_size}")
        return self

    def build(self, norm: str | None = None, num_classes: int = 10, image_size: int | None = None,
              in_features: int | None = None):
        """The model, with ``norm`` (a method's own normalization) in place of ``self.norm`` if given;
        ``image_size`` reaches the models whose layers depend on it (the FBN CNN), ``in_features`` the MLP."""
        context = {"image_size": image_size} if image_size else {}
        if in_features:
            context["in_features"] = in_features
        model = build_model(self.name, num_classes=num_classes, norm=norm or self.norm, classifier=self.classifier,
                            width=self.width, bn_mode=self.bn_mode, code_zero_pad=self.code_zero_pad,
                            pretrained=self.pretrained, input_size=self.input_size, **context)
        for module in model.modules():
            if isinstance(module, WSConv2d):
                module.variance = self.ws_variance
        if self.projection_dim is not None:
            add_projection_head(model, self.projection_dim)
        return model


class ServerConfig(_Strict):
    """Overrides of a method's server update (see :mod:`fednorm.methods.server`); unset keys keep the preset's."""

    rule: Literal[SERVER_RULES] | None = None  # type: ignore[valid-type]
    lr: float | None = Field(None, gt=0, description="server learning rate (FedAvgM / FedAdam / FedYogi / FedAdagrad)")
    momentum: float | None = Field(None, ge=0, lt=1, description="FedAvgM beta, or beta1 of the adaptive rules")
    beta2: float | None = Field(None, ge=0, lt=1)
    tau: float | None = Field(None, gt=0)
    nnm: bool | None = Field(None, description="nearest-neighbour mixing before a robust rule")
    robust_f: int | None = Field(None, ge=0, description="f of trimmed mean / Krum / NNM (default: the Byzantine count)")
    robust_scope: Literal["all", "statistics"] | None = Field(
        None, description="what a robust rule aggregates: all (parameters and BN statistics, default) or statistics "
        "(BN statistics only, parameters by the weighted mean)")


# which client algorithms read a client.<option> (by prefix), and which server rules read a server.<option>
CLIENT_OPTION_OWNERS = {"scaffold_option": ("scaffold",), "scaffold_gradient_bn": ("scaffold",),
                        "scaffold_effective_steps": ("scaffold", "feddc"), "moon_": ("moon",), "feddc_": ("feddc",), "perfedavg_": ("perfedavg",)}
_ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")
SERVER_OPTION_RULES = {"lr": SERVER_OPTIMIZERS, "momentum": SERVER_OPTIMIZERS, "beta2": _ADAPTIVE, "tau": _ADAPTIVE,
                       "nnm": ROBUST_RULES, "robust_f": ROBUST_RULES, "robust_scope": ROBUST_RULES}


# where a client's running amplitude starts when a method does not say: the paper's zero with its full-spectrum
# AmpNorm, the first batch with the official code's variant (whose momentum 0 would keep a zero start at zero)
AMPLITUDE_INIT_DEFAULTS = {variant: settings["init"] for variant, settings in AMPLITUDE_VARIANTS.items()}
# the start fednorm used for both variants before 2026-11-30, when config.yaml did not record it
LEGACY_AMPLITUDE_INIT = "first_batch"


def effective_amplitude_norm(method: dict) -> str | None:
    """The amplitude normalization (full, code or None) of a method entry as written (a dict of MethodConfig
    fields): its own ``amplitude_norm`` (YAML's bare on/off read as booleans), else its preset's."""
    value = method.get("amplitude_norm")
    if isinstance(value, bool):
        value = "full" if value else "off"
    if value is None:
        preset = PRESETS.get(method.get("name"))  # type: ignore[arg-type]
        value = preset.amplitude_norm if preset is not None else None
    return value if value in AMPLITUDE_INIT_DEFAULTS else None


class MethodConfig(_Strict):
    """A preset by name, optionally with axes overridden (e.g. FedBN + FedProx: name fedbn, prox_mu 0.01)."""

    name: str
    label: str | None = Field(None, pattern=r"^[^/\\]+$",
                              description="the method's row and folder name (one folder: no / or \\, not . or ..)")
    policy: str | None = None
    prox_mu: float | None = Field(None, ge=0)
    prox_schedule: Literal["paper", "fedbn_code"] | None = None
    norm: Literal[NORM_KINDS] | None = None  # type: ignore[valid-type]
    agc_clip: float | None = Field(None, ge=0, description="AGC threshold lambda; 0 turns AGC off")
    agc_exclude_head: bool | None = None
    freeze_bn_stats_at: float | None = Field(None, gt=0, description="FixBN switch: fraction of rounds (<1) or round")
    lr: float | None = Field(None, gt=0, description="this method's learning rate (the papers tune it per method)")
    server: ServerConfig | None = Field(None, description="server update overrides (rule, lr, momentum, ...)")
    client: dict[str, Any] | None = Field(None, description="client algorithm overrides (name, scaffold_option, ...; "
                                          "the fields of fednorm.methods.client_algorithms.ClientSpec)")
    weight_perturbation: float | None = Field(
        None, ge=0, description="HarmoFL's weight perturbation alpha (0 = off; harmofl's preset 0.05)")
    amplitude_norm: Literal["full", "code", "off"] | None = Field(
        None, description="HarmoFL's amplitude normalization: full (the paper's whole spectrum), code (the official "
        "code's DC-only swap) or off")
    amplitude_init: Literal["zero", "first_batch"] | None = Field(
        None, description="where a client's running amplitude starts in round 1: zero (the paper's Eq. 3, default "
        "with amplitude_norm full) or first_batch (the official code's, default with code); filled in when the "
        "config is read, so a run folder's config.yaml names the start its runs used")
    amplitude_band: float | None = Field(
        None, ge=0, le=0.5, description="amplitude_norm code only: the official code's low-frequency window ratio L "
        "(half-width floor(min(H, W) * L) around the DC term; unset: the code's L = 0, the DC coefficient alone)")
    amplitude_decay: float | None = Field(
        None, ge=0, le=1, description="the running amplitude's decay v (HarmoFL Eq. 3); unset: 0.1 with full (the "
        "paper), 0 with code (the code's int truncation of its 0.1)")

    @model_validator(mode="before")
    @classmethod
    def _resolve_amplitude_init(cls, data: Any) -> Any:
        # the default is resolved here rather than left None, so that config.yaml records it: a run folder whose
        # config.yaml has no amplitude_init was written before the default changed (load_run_config)
        if isinstance(data, dict) and data.get("amplitude_init") is None:
            variant = effective_amplitude_norm(data)
            if variant is not None:
                return {**data, "amplitude_init": AMPLITUDE_INIT_DEFAULTS[variant]}
        return data

    @field_validator("name")
    @classmethod
    def _preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown method {value!r}; choose one of {', '.join(PRESETS)}")
        return value

    @field_validator("label")
    @classmethod
    def _one_folder(cls, value: str | None) -> str | None:
        if value is not None and value.strip() in ("", ".", ".."):
            raise ValueError(f"label {value!r} names no folder of its own (a cell is RUN/<label>/seed<k>)")
        return value

    @field_validator("amplitude_norm", mode="before")
    @classmethod
    def _amplitude_switch(cls, value: Any) -> Any:
        # YAML reads a bare `off` as false (and `on` as true): accept the booleans as off / full
        if isinstance(value, bool):
            return "full" if value else "off"
        return value

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str | None) -> str | None:
        if value is not None and value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(POLICIES)}")
        return value

    @model_validator(mode="after")
    def _client_fields(self) -> "MethodConfig":
        if self.client:
            from dataclasses import fields

            from ..methods.client_algorithms import ClientSpec

            known = {f.name for f in fields(ClientSpec)}
            unknown = sorted(set(self.client) - known)
            if unknown:
                raise ValueError(f"client: unknown keys {unknown}; known: {', '.join(sorted(known))}")
            self.build()  # the ClientSpec checks the values
        self._refuse_unused()
        return self

    def _refuse_unused(self) -> None:
        """An option the method never reads would make a row that looks like a variant and computes the plain
        method (same numbers under another label): refused, naming what reads it."""
        method = self.build()
        unused = []
        algorithm = method.client.name
        for key in self.client or {}:
            owners = next((o for prefix, o in CLIENT_OPTION_OWNERS.items() if key.startswith(prefix)), None)
            if owners is not None and algorithm not in owners:
                unused.append(f"client.{key} (read by {' and '.join(owners)}; this method's client algorithm is "
                              f"{algorithm})")
        rule = method.server.rule
        for key in (self.server.model_fields_set - {"rule"} if self.server else ()):
            if getattr(self.server, key) is not None and rule not in SERVER_OPTION_RULES[key]:
                unused.append(f"server.{key} (read by the {', '.join(SERVER_OPTION_RULES[key])} rules; this method's "
                              f"is {rule})")
        if not method.communicates:
            unused += [f"{key} (this method trains each client alone: nothing is sent to a server)" for key, on in (
                ("prox_mu", method.prox_mu > 0), ("server", self.server is not None),
                ("client", algorithm != "sgd")) if on]
        if self.prox_schedule is not None and method.prox_mu == 0:
            unused.append("prox_schedule (the schedule of a proximal term, and prox_mu is 0)")
        if self.agc_exclude_head is not None and method.agc_clip == 0:
            unused.append("agc_exclude_head (adaptive gradient clipping is off: agc_clip 0)")
        if unused:
            raise ValueError(f"method {self.display!r} does not use {'; '.join(unused)}: remove it, or choose a "
                             "method that reads it")

    @property
    def display(self) -> str:
        return self.label or self.name

    def build(self) -> Method:
        method = resolve_method(
            self.name, policy=self.policy, prox_mu=self.prox_mu, prox_schedule=self.prox_schedule, norm=self.norm,
            agc_clip=self.agc_clip, agc_exclude_head=self.agc_exclude_head,
            freeze_bn_stats_at=self.freeze_bn_stats_at,
            server=self.server.model_dump(exclude_none=True) if self.server else None,
            client=self.client,
            weight_perturbation=self.weight_perturbation,
        )
        # the amplitude fields in one replace, so Method checks them together (resolve_method ignores None values,
        # and amplitude_norm off is None on the Method: an amplitude option on a method switched off is refused)
        amplitude = {k: v for k, v in (("amplitude_init", self.amplitude_init), ("amplitude_band", self.amplitude_band),
                                       ("amplitude_decay", self.amplitude_decay)) if v is not None}
        if self.amplitude_norm is not None:
            amplitude["amplitude_norm"] = None if self.amplitude_norm == "off" else self.amplitude_norm
        if amplitude:
            from dataclasses import replace

            method = replace(method, **amplitude)
        return method


class TrainingConfig(_Strict):
    epochs: int = Field(1, ge=1)
    steps: int | None = Field(None, ge=1, description="fixed local iterations per round instead of epochs")
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    drop_last: bool = False
    momentum_style: Literal["pytorch", "ema"] = Field(
        "pytorch", description="ema: buf = mu buf + (1 - mu) g from buf = 0 (the Byzantine-ML / FBN client momentum)")
    lr_decay_every: int | None = Field(None, ge=1, description="lr / (1 + floor(round / lr_decay_every)) (FBN)")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="the clients' optimizer: sgd (momentum, "
                                              "weight_decay) or adam (betas, weight_decay; set momentum 0)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's betas (HarmoFL segmentation: 0.9, 0.99)")
    precision: Literal["fp32", "bf16", "auto"] = Field(
        "fp32", description="auto: bf16 autocast where the training device has native bf16 (a CPU with AMX / "
        "AVX512-BF16, a GPU with bf16), else fp32")
    loss: Literal[("auto",) + LOSSES] = Field(  # type: ignore[valid-type]
        "auto", description="auto: ce for classification, the paper's loss for segmentation (nuclei dice, prostate "
        "ce_dice); ce, dice (soft Dice incl. background) or ce_dice ((CE + Dice) / 2) for segmentation")
    metric: Literal[METRICS] = Field(  # type: ignore[valid-type]
        "auto", description="the score evaluations report: auto (accuracy for classification, Dice for "
        "segmentation), accuracy, balanced_accuracy (mean per-class recall over the classes present in a split: "
        "FLamby's Fed-ISIC2019 metric), dice")
    dice_background: Literal[DICE_BACKGROUND] = Field(  # type: ignore[valid-type]
        "exclude", description="segmentation Dice score: exclude (foreground Dice, default), include (mean with the "
        "background), code (HarmoFL code's dice_coef exactly)")
    augment: Literal[AUGMENTS] = Field(  # type: ignore[valid-type]
        "none", description="training-time augmentation of the training batches (evaluation only through "
        "augment_validation): fedbn_objects = FedBN's Office/DomainNet code (FedWon too), per image a horizontal "
        "flip with probability 0.5, then a rotation uniform in [-30, 30] degrees about the centre, nearest, "
        "corners black; images only, not segmentation; rot90_flip = HarmoFL's prostate code, k quarter turns (k uniform in 0-4, 4 = none) then "
        "with probability 0.75 a flip of the rows, the columns or both, masks moved with their images; "
        "flamby_isic = FLamby's Fed-ISIC2019 pipeline (scale, rotation, colour, flip, shear, random 200 x 200 crop, "
        "cut-out), with data.center_crop: 200 (fednorm.methods.augment)")
    augment_validation: bool = Field(
        False, description="also augment the validation images, afresh at every evaluation (FedBN's Office / "
        "DomainNet code validates on a Subset of its augmented training set, so model selection sees augmented "
        "images); test images never; cross-silo federations only")

    @model_validator(mode="after")
    def _adam_has_no_sgd_momentum(self) -> "TrainingConfig":
        if self.optimizer == "adam" and (self.momentum or self.momentum_style != "pytorch"):
            raise ValueError("training.momentum and momentum_style are SGD's; with optimizer adam the momentum is "
                             "betas[0]: set momentum: 0")
        return self

    def build(self, task: Task | None = None, device: str = "cpu") -> LocalTraining:
        """The local training, with ``task`` (:meth:`ExperimentConfig.task`, which knows the domains); without
        one, a Dice loss means segmentation and anything else classification. ``device`` is the type of the
        device training runs on (``cpu`` or ``cuda``), for ``precision: auto``."""
        values = self.model_dump()
        loss, background, metric = values.pop("loss"), values.pop("dice_background"), values.pop("metric")
        if task is None:
            task = build_task("segmentation" if loss in ("dice", "ce_dice") else "classification", loss, background,
                              metric=metric)
        values["task"] = task
        values["precision"] = resolve_precision(self.precision, device)
        values["betas"] = tuple(values["betas"])
        if values["precision"] == "bf16" and device == "cpu" and not native_bf16():
            warnings.warn(
                "training.precision is bf16 but this machine has no native bf16 (no AMX / AVX512-BF16): "
                "PyTorch emulates it, many times slower than fp32; use precision: auto or fp32",
                ConfigWarning, stacklevel=2)
        return LocalTraining(**values)


class ByzantineConfig(_Strict):
    """Simulated Byzantine clients: the LAST ``count`` clients of the federation send attacks."""

    count: int = Field(0, ge=0, description="f, the number of Byzantine clients")
    attack: Literal[ATTACKS] | None = None  # type: ignore[valid-type]
    targets: list[Literal["statistics", "parameters"]] = Field(
        default_factory=lambda: ["statistics"], min_length=1,
        description="what the attackers corrupt: BN statistics (the FBN paper's Section 5) and/or parameters")
    # FOE's epsilon: the FBN paper gives no attack parameter; 0.1 (the attackers send -0.1 times the honest mean)
    # is a small epsilon, close to the honest vectors; byzfl's InnerProductManipulation defaults to 2.0, a larger
    # push away from them. Sweep it (federation.byzantine.foe_eps) before comparing to the paper's figures
    foe_eps: float = Field(0.1, gt=0)
    alie_z: float | None = None
    sign_flip_own: bool = Field(False, description="SF on statistics: negate the attacker's own mean (else the "
                                "honest mean's)")


class FederationConfig(_Strict):
    rounds: int = Field(20, ge=1)
    fraction: float = Field(1.0, gt=0, le=1)
    weighting: Literal[WEIGHTINGS] = "samples"  # type: ignore[valid-type]
    persistent_optimizer: bool = False
    eval_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(1, ge=1)
    keep_selected_model: bool = Field(
        True, description="with validation data, write <method>/seed<k>/selected.pt: the engine state of the round "
        "with the best mean validation score (UniFed's model selection), for `fednorm external-ablation --selected`; "
        "as large as a checkpoint. false: summary.json still reports the selected round's scores, no model is kept")
    channels_last: bool | Literal["auto"] = Field(
        "auto", description="NHWC memory format; auto: on where training runs in bf16 (AMX convolutions want it), "
        "off in fp32, where it was no faster here and its BN / conv backward less precise (benchmarks/performance.md)")
    reuse_freed_memory: bool = Field(
        True, description="keep freed memory in the process (glibc: no mmap, no trim), so each step reuses the "
        "last step's gradient buffers instead of page-faulting fresh ones; same results, 1.3-1.9x faster steps here "
        "for large linear layers (benchmarks/performance.md); resident memory stays at its peak")
    eval_batch_size: int = Field(500, ge=1, description="samples per evaluation batch (lower it for large images: "
                                 "a 384 x 384 U-Net)")
    evaluation_bn: Literal["stored", "recomputed"] = Field(
        "stored", description="the BN statistics a client's own model is evaluated with, for methods that keep BN "
        "statistics on each client (FedBN, SiloBN, SingleSet, the UniFed add-on): stored = the running statistics "
        "as training left them (the papers' protocol); recomputed = BN recalibration, a departure offered as an "
        "option: before each evaluation, the population statistics of the client's training split at its current "
        "weights (evaluation-only; training goes on from the stored ones). Stale small-batch statistics cost FedBN "
        "and SiloBN 7-13 points on PACS at B = 2-4 (benchmarks/fedwon.md)")
    device: str = Field(
        "auto", pattern=DEVICE_PATTERN,
        description="where clients train: auto (the first CUDA GPU when PyTorch sees one, else the CPU), cpu, cuda, "
        "cuda:N; data stay in host memory and each batch moves to the device (fednorm.engines.device)")
    setting: Literal["cross_silo", "cross_device"] = Field(
        "cross_silo", description="cross_device: stateless clients (methods keeping client state are refused), "
        "the global model evaluated once per domain")
    byzantine: ByzantineConfig = Field(default_factory=ByzantineConfig)
    pattern: Literal["rounds", "dsgd"] = Field(
        "rounds", description="rounds: E local epochs (or training.steps) per round, the FedAvg family; dsgd: one "
        "local step per round from the global model with a persistent client optimizer, so the server's average "
        "is DSGD's averaged (momentum) gradient step (FBN paper, Algorithm 3); dsgd's weighting defaults to uniform, "
        "the algorithm's 1/n")
    on_divergence: OnDivergence = Field(
        "stop", description="when a client's loss or update, or the global model's evaluation loss, turns NaN/inf: "
        "stop the run with an error (stop), or end only that cell, keep the last finite model's scores, mark the "
        "cell diverged and go on with the "
        "next cell (record: for grids where divergence is an outcome, e.g. attacks without defense)")

    def resolved_device(self) -> torch.device:
        """The device this setting trains on, on this machine (``auto`` resolved)."""
        return resolve_device(self.device)

    def channels_last_for(self, precision: str, device: str = "cpu") -> bool:
        """The memory format this setting gives for training ``precision`` on a ``device`` type (``auto``
        resolved)."""
        return resolve_channels_last(None if self.channels_last == "auto" else self.channels_last,
                                     resolve_precision(precision, device))


# the settings that shape only mode test_time_bn; shuffle_seed and unbiased also reach `fednorm external-ablation`
# (its rows read them whatever the modes), so they are not warned about
TEST_TIME_BN_KEYS = ("batch_size", "momentum", "convention", "reset", "predict")


class ExternalConfig(_Strict):
    """External clients (UniFed, FedBN App. G): domains that never train, evaluated under each mode."""

    domains: list[str] = Field(default_factory=list, description="domains of the external clients (their test "
                               "splits; e.g. the held-out domain of a leave-one-domain-out run)")
    held_out_domains: list[str] = Field(
        default_factory=list, description="a leave-domains-out fold: these domains of data.domains do not train "
        "and are evaluated as external clients (appended to external.domains): UniFed's Camelyon17 split (hospitals "
        "4-5 held out), FedBN App. G's unseen domain; one preset gives every fold, one domain held out per run "
        "(--set external.held_out_domains=[usps])")
    held_out_type: Literal[tuple(UNIFED_TYPES)] | None = Field(  # type: ignore[valid-type]
        None, description="UniFed's leave-one-corruption-type-out fold: data.domains and external.domains become "
        "the corruptions of the other three types and of this one (noise, blur, weather, digital), of the set and "
        "severity the listed corrupted domains name")
    modes: list[Literal[EXTERNAL_MODES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["global", "test_time_bn", "fedbn_average"], min_length=1,
        description="global: the global model; test_time_bn: UniFed's test-time BN statistics; fedbn_average: the "
        "clients' averaged BN weight and bias, statistics from the external data (FedBN App. G); bn_average: the "
        "clients' averaged BN weight, bias and running statistics, nothing from the external data (FedWon Table "
        "12's other reading)")
    data: Literal["test", "all"] = Field(
        "test", description="what an external client is scored on: its domain's test split under the federation's "
        "protocol, or every image of its domain (UniFed Sec. 4.1: external data 'are all held out for testing')")
    batch_size: int = Field(32, ge=1, description="test batch size of test-time BN statistics (UniFed)")
    momentum: float | None = Field(0.9, ge=0, le=1, description="test-time BN momentum; null: population "
                                   "statistics over one pass")
    convention: Literal[MOMENTUM_CONVENTIONS] = "history"  # type: ignore[valid-type]
    reset: bool = True
    predict: Literal[PREDICTIONS] = "online"  # type: ignore[valid-type]
    shuffle_seed: int | None = None
    unbiased: bool = Field(False, description="test-time BN variance with n/(n-1); false: the biased variance BN "
                           "normalizes with in training")

    @field_validator("domains")
    @classmethod
    def _known_external(cls, value: list[str]) -> list[str]:
        for d in value:
            check_domain(d)
        return value

    @model_validator(mode="after")
    def _test_time_settings_need_their_mode(self) -> "ExternalConfig":
        """The test-time BN settings shape only mode test_time_bn (fedbn_average follows FedBN App. G's own protocol:
        population statistics over one pass, then prediction): one changed without that mode has no effect, which
        is said, not left silent. Compared with the defaults, not with the keys given, so a run's config.yaml (every
        key written out) warns only as its first load did."""
        changed = [k for k in TEST_TIME_BN_KEYS if getattr(self, k) != type(self).model_fields[k].default]
        if changed and self.domains and "test_time_bn" not in self.modes:
            warnings.warn(f"external.{', external.'.join(changed)} set the test-time BN statistics of mode "
                          f"test_time_bn, which external.modes {self.modes} leaves out: they change nothing here "
                          "(fedbn_average always uses FedBN App. G's protocol: population statistics over one pass, "
                          "then prediction)", ConfigWarning, stacklevel=2)
        return self

    def bn(self):
        from ..methods.external import ExternalBN

        return ExternalBN(batch_size=self.batch_size, momentum=self.momentum, convention=self.convention,
                          reset=self.reset, predict=self.predict, shuffle_seed=self.shuffle_seed,
                          unbiased=self.unbiased)


class DiagnosticsConfig(_Strict):
    """HarmoFL's drift diagnostics (:mod:`fednorm.diagnostics`), off by default (they cost compute)."""

    drift: bool = Field(False, description="record each client's drift Gamma_i = 1/K sum_k ||theta_k - theta_0||^2 "
                        "per round (HarmoFL Eq. 9), as 'drift' in its training record; plotted in drift.png")
    gradient_dissimilarity: bool = Field(
        False, description="at every evaluation round, the clients' gradient dissimilarity at the global model "
        "(B^2 = sum p_i ||g_i||^2 / ||g||^2 and the mean pairwise ||g_i - g_j||); in-process engine only")
    samples: int = Field(256, ge=2, description="training samples per client for the gradients and the landscape")
    landscape: bool = Field(False, description="at the end of each cell, every client's training loss on a 2-D "
                            "slice around the global model (landscape.png; or `fednorm landscape RUN` afterwards)")
    landscape_span: float = Field(1.0, gt=0, description="the grid covers [-span, span]^2 in units of the "
                                  "filter-normalized directions (HarmoFL Fig. 6 also shows 8x the range)")
    landscape_points: int = Field(11, ge=2, le=101, description="grid points per axis")


class PaperVariant(_Strict):
    """The paper's numbers for a setting a preset reaches by override (FedWon Table 3 at C = 0.2 of the
    C = 0.1 preset): chosen when every ``when`` key of the run's config has its value."""
    when: dict[str, Any] = Field(min_length=1, description="dotted config keys -> the values of this setting, "
                                 "e.g. {federation.fraction: 0.2}")
    paper: dict[str, dict[str, float]]
    paper_source: str


def _dotted(config: BaseModel, key: str) -> Any:
    """The value of dotted ``key`` (``federation.fraction``) in a config; KeyError naming it when absent."""
    node: Any = config
    for part in key.split("."):
        if isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(key)
    return node


class ExperimentConfig(_Strict):
    name: str = "experiment"
    description: str = ""
    seeds: list[Annotated[int, Field(ge=0, lt=2**32)]] = Field(default_factory=lambda: [0], min_length=1)
    methods: list[MethodConfig] = Field(default_factory=lambda: [MethodConfig(name="fedavg")], min_length=1)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    external: ExternalConfig = Field(default_factory=ExternalConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    paper: dict[str, dict[str, float]] | None = Field(
        None, description="the paper's numbers for this preset: method -> domain -> accuracy (%) (Dice (%) for "
        "segmentation)"
    )
    paper_source: str | None = Field(
        None, description="where ``paper``'s numbers come from and for which setting (table, dataset, protocol); "
        "printed under the results table, since overrides of a run never change what the paper measured"
    )
    paper_variants: list[PaperVariant] = Field(
        default_factory=list, description="the paper's numbers for other settings of this preset: the first "
        "variant whose ``when`` matches the run replaces ``paper`` and ``paper_source`` in its tables"
    )

    def paper_for_setting(self) -> tuple[dict[str, dict[str, float]] | None, str | None]:
        """The paper's numbers and their source for this config's setting: the first of ``paper_variants``
        whose ``when`` keys all hold this config's values, else ``paper`` / ``paper_source``."""
        for variant in self.paper_variants:
            if all(_dotted(self, k) == v for k, v in variant.when.items()):
                return variant.paper, variant.paper_source
        return self.paper, self.paper_source

    def input_size(self) -> int:
        """The side of the images the model sees: ``data.center_crop`` where set, else the domains' image size."""
        return self.data.center_crop or image_size(self.data.domains)

    def task(self) -> Task:
        """The run's task: segmentation when the domains hold masks (prostate, nuclei), else classification
        (images or feature vectors); its loss from ``training.loss`` (see :func:`fednorm.methods.tasks.build_task`)."""
        kind, benchmark = domain_task(self.data.domains)
        return build_task("segmentation" if kind == "segmentation" else "classification", self.training.loss,
                          self.training.dice_background, benchmark, self.training.metric)

    def _check_external(self) -> None:
        """External clients (UniFed: domains that never trained) are other domains than the federation's, of the
        same image size, classes and task, so the global model can score them."""
        external = self.external.domains
        if not external:
            return
        overlap = sorted({_images_of(d) for d in self.data.domains} & {_images_of(d) for d in external})
        if overlap:
            raise ValueError(f"external.domains: {', '.join(overlap)} also train in data.domains; an external client "
                             "is a domain the federation never trained on (UniFed Sec. 4.1)")
        try:
            image_size([*self.data.domains, *external])
            num_classes([*self.data.domains, *external])
        except ValueError as exc:
            raise ValueError(f"external.domains do not fit data.domains: {exc}") from None
        kinds = {parse_domain(d).task for d in [*self.data.domains, *external]}
        if len(kinds) > 1:
            raise ValueError(f"external.domains do not fit data.domains: they mix {' and '.join(sorted(kinds))} "
                             "domains; an external client is scored by the federation's own model")
        needs_stats = [m for m in self.external.modes if m != "global"]
        if needs_stats and self.model.bn_mode == "batch":
            raise ValueError(f"external.modes {needs_stats} set BatchNorm running statistics for the external client "
                             "(re-estimated on its data, or averaged), but model.bn_mode: batch keeps none (batch "
                             "statistics at evaluation too); use external.modes: [global], or model.bn_mode: running")

    def _check_evaluation_bn(self) -> None:
        """federation.evaluation_bn: recomputed needs a method whose BN statistics are per client."""
        if self.federation.evaluation_bn != "recomputed":
            return
        if self.model.bn_mode == "batch":
            raise ValueError("federation.evaluation_bn: recomputed recomputes BatchNorm running statistics, but "
                             "model.bn_mode: batch keeps none (batch statistics at evaluation too); use "
                             "evaluation_bn: stored, or model.bn_mode: running")
        unaffected = []
        for m in self.methods:
            method = m.build()
            local_stats = keeps_bn_statistics(method.policy)
            if not (local_stats and (method.norm or self.model.norm) in BATCHNORM_KINDS):
                unaffected.append(m.display)
        if len(unaffected) == len(self.methods):
            raise ValueError(f"federation.evaluation_bn: recomputed recomputes the BN statistics each client keeps, "
                             f"but no method here keeps any ({', '.join(unaffected)}: shared statistics or no "
                             "BatchNorm); use a method with local BN (fedbn, silobn, singleset, a local_bn add-on) "
                             "or evaluation_bn: stored")
        if unaffected:
            warnings.warn(f"federation.evaluation_bn: recomputed applies to methods keeping BN statistics on each "
                          f"client; {', '.join(unaffected)} share theirs or have no BatchNorm and are evaluated with "
                          "their stored statistics", ConfigWarning, stacklevel=2)

    def _check_task(self) -> None:
        """Data, task, model and methods fit together (medical domains, segmentation, feature vectors)."""
        specs = [parse_domain(d) for d in self.data.domains]
        kind = specs[0].task
        try:
            task = self.task()
        except ValueError as exc:
            raise ValueError(f"training.loss / training.metric: {exc}") from None
        medical = any(s.medical for s in specs)
        d = self.data
        if medical:
            if d.partition != "fedbn" or d.clients_per_domain != 1:
                raise ValueError("data: medical domains keep their official splits, one client per site; "
                                 "partition and clients_per_domain do not apply (leave them at fedbn and 1)")
            if d.test_domain:
                raise ValueError("data.test_domain: medical sites are tested on their own test splits")
            try:
                check_medical_options(d.domains, d.medical_options)
            except ValueError as exc:
                raise ValueError(f"data.medical_options: {exc}") from None
        elif d.truncate_train is not None or d.medical_options:
            raise ValueError("data.truncate_train and data.medical_options apply to medical domains only")
        if kind == "features" and self.model.name != "mlp":
            raise ValueError(f"the domains hold feature vectors ({specs[0].benchmark}): use model.name mlp, "
                             f"not {self.model.name}")
        augment = self.training.augment
        if augment != "none" and (kind == "features" or (kind == "segmentation" and augment not in MASK_AUGMENTS)):
            # fedbn_objects' free-angle rotation does not move a segmentation mask with its image (not implemented);
            # feature vectors have no image to flip
            what = ("hold feature vectors" if kind == "features" else
                    "are segmentation, whose masks would need the same flip and rotation (rot90_flip moves them)")
            raise ValueError(f"training.augment {augment!r} flips and rotates training images; the "
                             f"domains {what}: use training.augment: none" + (" or rot90_flip" if kind != "features"
                                                                              else ""))
        if kind != "features" and self.model.name == "mlp":
            raise ValueError("model mlp takes feature vectors (abide/<site>); image domains need an image model")
        if d.center_crop is not None and kind != "classification":
            raise ValueError(f"data.center_crop crops classification images; the domains are {kind}")
        if self.training.augment_validation:
            if augment == "none":
                raise ValueError("training.augment_validation augments validation images with training.augment, "
                                 "which is none")
            if self.federation.setting == "cross_device" or d.partition in LABEL_SKEW_SCHEMES:
                # a domain's validation split is then the union of its clients' slices, scored in pieces on Flower
                raise ValueError("training.augment_validation is FedBN's cross-silo protocol: not with "
                                 "federation.setting cross_device or a label-skew partition")
        if self.training.augment == "flamby_isic" and d.center_crop != FLAMBY_CROP:
            raise ValueError(f"training.augment flamby_isic trains on random {FLAMBY_CROP} x {FLAMBY_CROP} crops and "
                             f"FLamby tests on the central {FLAMBY_CROP}: set data.center_crop: {FLAMBY_CROP} (got "
                             f"{d.center_crop})")
        if d.input_norm != "half":
            if kind == "features":
                raise ValueError(f"data.input_norm {d.input_norm!r} standardizes images; feature vectors are "
                                 "standardized per site (data.standardize_features): leave input_norm at half")
            gray = sorted({s.name for s in specs if s.input_shape and s.input_shape[0] != 3})
            if d.input_norm == "imagenet" and gray:
                raise ValueError(f"data.input_norm imagenet has one mean per RGB channel; {', '.join(gray)} are not "
                                 "RGB: use half or unit")
        if (kind == "segmentation") != (self.model.name == "unet"):
            raise ValueError(f"model {self.model.name} does not fit the {task.kind} domains: segmentation "
                             "(prostate, nuclei) needs model.name unet, and unet only does segmentation")
        for m in self.methods:
            method = m.build()
            spec = method.client
            if method.amplitude_norm and kind == "features":
                raise ValueError(f"method {m.display!r} normalizes image amplitudes (HarmoFL); feature vectors "
                                 "have none: set amplitude_norm: off or choose another method")
            if kind != "classification" and method.union_batches:
                raise ValueError(f"method {m.display!r} merges the clients' batches, for image classification only")
            if self.training.augment_validation and spec.name == "perfedavg" and spec.perfedavg_eval_steps > 0:
                # it would adapt on the stored images and be scored on augmented ones: neither protocol
                raise ValueError(f"method {m.display!r}: Per-FedAvg adapts on labelled samples before scoring; with "
                                 "training.augment_validation it would adapt on stored images and be scored on "
                                 "augmented ones: set client.perfedavg_eval_steps: 0 or augment_validation: false")
            if task.kind == "segmentation":
                # Per-FedAvg's meta-steps compute a classification cross-entropy of their own (client_algorithms.py);
                # SCAFFOLD option I takes the task's loss
                if spec.name == "perfedavg":
                    raise ValueError(f"method {m.display!r}: client algorithm {spec.name!r} computes its own "
                                     "classification loss, not the segmentation task's; use another")
                if spec.name == "moon" and spec.moon_layer is None:
                    raise ValueError(f"method {m.display!r}: MOON's representation is the input of the last "
                                     "nn.Linear, which the U-Net has none of; set client.moon_layer (e.g. upconvs.0: "
                                     "the bottleneck's output)")

    @model_validator(mode="before")
    @classmethod
    def _corruption_type_fold(cls, data: Any) -> Any:
        """``external.held_out_type`` rebuilds data.domains and external.domains as UniFed's fold of that type
        (the same lists again for a config that already holds them, so a run folder's config re-validates)."""
        if not isinstance(data, dict) or not isinstance(data.get("external"), dict) or \
                data["external"].get("held_out_type") is None:
            return data
        data, external = dict(data), dict(data["external"])
        dataset = dict(data.get("data") or {})
        held = external["held_out_type"]
        named = list(dataset.get("domains") or []) + list(external.get("domains") or [])
        try:
            dataset["domains"], external["domains"] = corruption_type_fold(held, named)
        except ValueError as e:
            raise ValueError(f"external.held_out_type: {e}") from None
        data["data"], data["external"] = dataset, external
        return data

    @model_validator(mode="before")
    @classmethod
    def _domain_fold(cls, data: Any) -> Any:
        """``external.held_out_domains`` takes those domains out of data.domains and appends them to
        external.domains (a config that already holds the fold, a run folder's, re-validates unchanged)."""
        if not isinstance(data, dict) or not isinstance(data.get("external"), dict) or \
                not data["external"].get("held_out_domains"):
            return data
        data, external = dict(data), dict(data["external"])
        dataset = dict(data.get("data") or {})
        held = list(external["held_out_domains"])
        if external.get("held_out_type") is not None:
            raise ValueError("external.held_out_domains and external.held_out_type are two ways of choosing the "
                             "external clients: give one")
        internal = list(dataset["domains"] if "domains" in dataset else
                        DataConfig.model_fields["domains"].get_default(call_default_factory=True))
        listed = list(external.get("domains") or [])
        if len(set(held)) != len(held):
            raise ValueError(f"external.held_out_domains names a domain twice: {held}")
        unknown = [d for d in held if d not in internal and d not in listed]
        if unknown:
            raise ValueError(f"external.held_out_domains: {unknown} are not in data.domains {internal}; hold out "
                             "domains the federation would train on (external.domains adds other ones)")
        dataset["domains"] = [d for d in internal if d not in held]
        if not dataset["domains"]:
            raise ValueError(f"external.held_out_domains {held} leaves no domain to train on in data.domains")
        external["domains"] = [d for d in listed if d not in held] + held
        data["data"], data["external"] = dataset, external
        return data

    @model_validator(mode="before")
    @classmethod
    def _dsgd(cls, data: Any) -> Any:
        """``federation.pattern: dsgd`` sets training.steps = 1 and a persistent optimizer, and refuses others; its
        weighting defaults to uniform, Algorithm 3's (1/n) sum_i g_i over clients that each step on a batch of b
        (``samples`` would weight each client's gradient by its data size; set explicitly, it is kept)."""
        if not isinstance(data, dict) or not isinstance(data.get("federation"), dict) or \
                data["federation"].get("pattern") != "dsgd":
            return data
        data = dict(data)
        training = dict(data.get("training") or {})
        federation = dict(data["federation"])
        if training.get("steps", 1) != 1:
            raise ValueError(f"federation.pattern dsgd takes one local step per round; training.steps is "
                             f"{training['steps']} (remove it or use pattern: rounds)")
        if federation.get("persistent_optimizer") is False:
            raise ValueError("federation.pattern dsgd keeps each client's momentum across steps; "
                             "remove persistent_optimizer: false")
        training["steps"] = 1
        federation["persistent_optimizer"] = True
        federation.setdefault("weighting", "uniform")
        data["training"], data["federation"] = training, federation
        return data

    @field_validator("methods", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, (str, dict)):
            value = [value]
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _unique_labels(self) -> "ExperimentConfig":
        labels = [m.display for m in self.methods]
        if len(set(labels)) != len(labels):
            raise ValueError(f"method labels must be distinct (give each a `label`), got {labels}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        for m in self.methods:
            method = m.build()
            norm = method.norm or self.model.norm
            if self.federation.setting == "cross_device" and method.stateful_clients:
                state = (POLICIES[method.policy] if method.policy != "shared" else
                         f"each client keeps {method.client.build().kept_state} from one round to the next")
                stateless = ", ".join(n for n, p in PRESETS.items() if not p.stateful_clients)
                raise ValueError(
                    f"method {m.display!r} cannot run cross-device: {state}, and cross-device clients are "
                    f"stateless (a new sample of devices each round). Use a stateless method ({stateless}) or "
                    "federation.setting: cross_silo")
            if norm in BATCHNORM_KINDS and self.training.batch_size == 1:
                raise ValueError(
                    f"method {m.display!r} trains a BatchNorm model, which cannot use batch_size 1; "
                    "use a method without BN (fedwon, fedavg_gn, fedavg_ln) or batch_size >= 2")
            if method.union_batches and self.training.steps is None:
                raise ValueError(f"method {m.display!r} steps on the union of the clients' batches of each step: "
                                 "set training.steps (1 for DSGD)")
            if (method.server.rule == "fednova" and self.federation.persistent_optimizer
                    and self.training.momentum > 0):
                warnings.warn(
                    f"method {m.display!r} normalizes updates by FedNova's a_k for momentum "
                    f"{self.training.momentum}, which assumes each client's momentum buffer starts every round at "
                    "zero; federation.persistent_optimizer carries it over, so a_k is only an approximation "
                    "(set persistent_optimizer: false for FedNova's exact normalization)",
                    ConfigWarning, stacklevel=2)
            if m.agc_clip is None and method.agc_clip and self.training.batch_size < AGC_MIN_BATCH:
                # FedWon App. A.3: "We only use AGC for FedWon with batch size B=32 and bypass AGC on small batch
                # sizes such as B={1,2,4}"; the preset's lambda is the Digits one (Office/DomainNet: 1.28)
                warnings.warn(
                    f"method {m.display!r} clips gradients with its preset's AGC lambda {method.agc_clip} at "
                    f"training.batch_size {self.training.batch_size}; FedWon's paper uses AGC only at batch size "
                    f"{AGC_MIN_BATCH} and bypasses it at small batches (App. A.3): set agc_clip: 0 for this method "
                    "as the paper, or set agc_clip explicitly to keep AGC", ConfigWarning, stacklevel=2)
            if (norm in HEADLESS_NORMS and self.model.classifier == "fedbn"
                    and not unsupported_options(self.model.name, {"classifier": "fedwon"})):
                # FedWon Tables 5-6: without normalization the head is Dropout-FC-ReLU-Dropout-FC-ReLU-FC; the fedbn
                # head with its BN removed has no dropout. Kept as a warning (not an error): a run comparing FedBN's
                # own CNN with a norm-free one is a legitimate ablation
                warnings.warn(
                    f"method {m.display!r} builds {self.model.name} with norm {norm!r} and classifier fedbn, whose "
                    "BN after FC1 and FC2 then leaves a plain FC-ReLU-FC-ReLU-FC head without dropout, not FedWon's "
                    "head (Tables 5-6: Dropout before FC1 and FC2); set model.classifier: fedwon for FedWon's "
                    "architecture (it applies to every method of the run)", ConfigWarning, stacklevel=2)
            if keeps_bn_state(method.policy) and norm not in BATCHNORM_KINDS:
                raise ValueError(f"method {m.display!r} keeps BatchNorm state local but its model norm is {norm!r}")
            if self.model.pretrained != "none" and norm == "ws":
                raise ValueError(f"method {m.display!r} standardizes the convolutions' filters (norm ws), which would "
                                 "rescale model.pretrained's; drop the method or set model.pretrained: none")
        try:
            stored = image_size(self.data.domains)
            num_classes(self.data.domains)
        except ValueError as exc:
            raise ValueError(f"data.domains: {exc}") from None
        self._check_external()
        self._check_task()
        if self.training.augment == "flamby_isic" and stored < FLAMBY_MIN_SIDE:
            raise ValueError(f"training.augment flamby_isic scales images down by up to 7 % and crops "
                             f"{FLAMBY_CROP} x {FLAMBY_CROP}: it needs images of at least {FLAMBY_MIN_SIDE} pixels "
                             f"(FLamby's are 224), the domains are {stored} x {stored}")
        crop = self.data.center_crop
        if crop is not None and crop > stored:
            raise ValueError(f"data.center_crop {crop} is larger than the domains' {stored} x {stored} images")
        size = self.input_size()
        if self.model.name == "digit_cnn" and size != 28:
            raise ValueError(f"model digit_cnn takes 28 x 28 digits; domains of {size} x {size} need alexnet, "
                             "resnet18, resnet20 or mobilenet_v2")
        if self.model.name == "alexnet" and (self.model.input_size or size) < ALEXNET_MIN_INPUT:
            raise ValueError(f"model alexnet needs images of at least {ALEXNET_MIN_INPUT} x {ALEXNET_MIN_INPUT} (its "
                             f"third max-pool), the domains are {size} x {size}: set model.input_size (e.g. 224) or "
                             "use digit_cnn, resnet18, resnet20 or mobilenet_v2")
        for variant in self.paper_variants:
            for key in variant.when:
                try:
                    _dotted(self, key)
                except KeyError:
                    raise ValueError(f"paper_variants: {key!r} is not a config key (write it dotted, e.g. "
                                     "federation.fraction)") from None
        self._check_evaluation_bn()
        byz = self.federation.byzantine
        if (byz.count > 0) != (byz.attack is not None):
            raise ValueError("federation.byzantine needs both a count > 0 and an attack (or neither)")
        if self.federation.setting == "cross_device" and self.federation.persistent_optimizer:
            raise ValueError("persistent_optimizer keeps state on each client; cross-device clients are stateless")
        return self


# ------------------------------------------------------------------------------------------ loading
def preset_names() -> list[str]:
    folder = resources.files("fednorm.runs") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one silently:
    ``training: {lr: 0.1, lr: 0.001}`` would run with 0.001)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *anchor, whose keys the mapping's own override
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: let the safe loader say so
                break
            if repeated:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# Top-level mappings that describe one thing as a whole: an extending config that gives one replaces it (the paper's
# numbers of another table must not keep the extended preset's rows or clients).
_REPLACED_WHOLE = frozenset({"paper"})
# The paper's numbers, where they come from and their variants are one statement: a config giving any of them
# drops the extended one's others (its numbers must not be captioned with the other table's source, nor replaced
# by its variants at some setting).
_PAPER_KEYS = frozenset({"paper", "paper_source", "paper_variants"})


def _merge(base: dict, own: dict, top: bool = True) -> dict:
    """``own`` over ``base``: sections (mappings) merge key by key, anything else (lists included) is replaced, and
    so is ``paper`` (with ``paper_source`` and ``paper_variants``: giving one drops the base's others)."""
    if top and _PAPER_KEYS & own.keys():
        base = {k: v for k, v in base.items() if k not in _PAPER_KEYS}
    merged = dict(base)
    for key, value in own.items():
        nested = isinstance(value, dict) and isinstance(base.get(key), dict) and not (top and key in _REPLACED_WHOLE)
        merged[key] = _merge(base[key], value, top=False) if nested else value
    return merged


def _read_document(source: str | Path | None, _chain: tuple[str, ...] = ()) -> dict:
    """The config document of a file or preset, with its ``extends:`` resolved.

    ``extends: <preset or file>`` starts from that document (itself possibly extending another; a relative file
    path is relative to the extending file's folder) and lays this one over it: sections merge key by key, lists
    (``methods``, ``seeds``, ``data.domains``), values and ``paper`` (the numbers of one table) are replaced whole;
    giving any of ``paper``, ``paper_source``, ``paper_variants`` drops the extended one's others. The result holds
    no ``extends``.
    """
    document, where = _read_one(source)
    chain = (*_chain, str(where.resolve()) if where is not None else str(source or "default"))
    parent = document.pop("extends", None)
    if parent is None:
        return document
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"config {source}: extends must name one preset or config file, got {parent!r}")
    if where is not None and Path(parent).suffix in (".yaml", ".yml") and not Path(parent).is_absolute():
        parent = str(where.parent / parent)
    is_file = Path(parent).suffix in (".yaml", ".yml") or Path(parent).exists()
    if (str(Path(parent).resolve()) if is_file else parent) in chain:
        raise ConfigError(f"config {source}: extends makes a cycle ({' -> '.join((*chain, parent))})")
    return _merge(_read_document(parent, chain), document)


def _read_one(source: str | Path | None) -> tuple[dict, Path | None]:
    """One config document as written (``extends`` unresolved), and its file (None for a preset)."""
    if source is None:
        source = "default"
    path = Path(source)
    where = None
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        if path.is_dir():
            hint = (f"it holds a run: `fednorm resume {path}` continues it, `fednorm run {path / 'config.yaml'}` "
                    "starts a new run with its settings" if (path / "config.yaml").is_file() else
                    "give a YAML config file or a preset name (`fednorm presets` lists them)")
            raise ConfigError(f"{path} is a folder, not a config file: {hint}")
        text = path.read_text()
        where = path
    else:
        name = str(source)
        if name not in preset_names():
            close = difflib.get_close_matches(name.lower(), preset_names(), n=3, cutoff=0.75)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ConfigError(
                f"{name!r} is neither a config file nor a preset; {hint}presets: {', '.join(preset_names())}"
            )
        text = (resources.files("fednorm.runs") / "presets" / f"{name}.yaml").read_text()
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {source} is not valid YAML: {exc}") from None
    if document is None:  # an empty file (or only comments): most likely the wrong file, not "all defaults"
        raise ConfigError(f"config {source} is empty: write the keys to change (README.md, section Configuration), "
                          "or `extends: default` for the built-in defaults as they are")
    if not isinstance(document, dict):
        raise ConfigError(f"config {source} must be a mapping of keys to values, got {type(document).__name__}")
    return document, where


def apply_overrides(document: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` overrides; values are parsed as YAML (``5``, ``[a, b]``, ``true``)."""
    document = yaml.safe_load(yaml.safe_dump(document))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. federation.rounds=5")
        key, raw = item.split("=", 1)
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key (or an empty part of one): write key=value, "
                              "e.g. federation.rounds=5")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from None
        node = document
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if isinstance(child, list):
                example = "methods=[{name: fedbn, lr: 0.05}]" if part == "methods" else f"{key.rsplit('.', 1)[0]}=[...]"
                raise ConfigError(f"override {item!r}: {part!r} is a list, set as a whole, e.g. {example}")
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return document


def _close_keys(loc: tuple) -> list[str]:
    """Known keys spelled like the unknown key at ``loc`` (e.g. federation.rouns -> federation.rounds)."""

    model: Any = ExperimentConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an entry of a list (methods[0]): its model is the list's
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = next((m for m in _models_in(field.annotation)), None)
        if model is None:
            return []
    prefix = ".".join(str(p) for p in loc[:-1])  # the list index stays: methods.0.name, the path the user wrote
    names = difflib.get_close_matches(str(loc[-1]), list(getattr(model, "model_fields", {})), n=2, cutoff=0.6)
    return [f"{prefix}.{n}" if prefix else n for n in names]


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def validate(document: dict, source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(document)
    except ValidationError as exc:
        lines, unknown = [], []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
            if err["type"] == "extra_forbidden":
                close = _close_keys(err["loc"])
                msg = ("unknown key" + (f"; did you mean {' or '.join(close)}?" if close else "") +
                       " (the keys and their meaning: README.md, section Configuration, and the presets' YAML)")
                unknown.append(where)
            lines.append(f"  {where}: {msg}")
        raise ConfigError(f"invalid {source}:\n" + "\n".join(lines), unknown_keys=tuple(unknown)) from None


def load_config(source: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """A config file path or preset name (default: the ``default`` preset), with overrides applied."""
    document = apply_overrides(_read_document(source), overrides or [])
    return validate(document, source=f"config {str(source or 'default')!r}")
