"""Study definitions (studies/*.yaml): a controlled architecture experiment, validated like a spec.

A study names its variants (a spec of the scale's spec folder, plus dotted overrides), the seeds,
the learning rates to try per variant, how the training budget is matched across variants, and
the baseline the report compares with. Each (variant, seed, lr slot) is one planned trial.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveFloat

from archlab.block import Problem, Problems, Strict
from archlab.cost import Cost, equal_flops_steps
from archlab.spec import ModelSpec, PathName, SchemaVersion, SpecError, load_yaml, set_dotted, set_each_dotted, validate_as, validate_spec
from archlab.table import LONGEST_CONTEXT
from archlab.train.config import SYNTHETIC, Seed, TrainConfig, holds_examples, tokenized

STUDIES = Path(__file__).resolve().parents[2] / "studies"  # the shipped studies
FOLDER_NAME = re.compile(r"[A-Za-z0-9._-]+")  # of a study, scale or variant: they name folders and report cells
LONGEST_NAME = 100  # characters: a trial's folder joins study and scale, or a variant, seed and slot, within a file name's 255 bytes
MAX_POINTS = 1000  # learning rates per (variant, seed): far past any study, short of a grid that never finishes expanding


class Pretrained(Strict):
    """Where a variant's trials start from (fine-tuning, as the paper's Figure 3 compares YOCO and
    YOCO-U pretrained alike): a training run, for every seed, or another study's trials of a
    variant at the same scale, each seed from that study's trial of the same seed at the learning
    rate its report chose."""

    run: PathName | None = None  # a training run (its latest checkpoint) or checkpoint folder, from where the study runs, as runs/ is
    study: PathName | None = None  # a study file (relative to this one) or the name of a shipped study
    variant: str | None = None  # that study's variant; None: the one of this variant's name


class Variant(Strict):
    spec: PathName  # a file in the scale's spec folder
    set: dict[str, Any] = {}  # dotted overrides, e.g. {"loop.times": 5, "layout.self_decoder.blocks.0.window": 8}
    scale_set: dict[str, dict[str, Any]] = {}  # overrides for one scale only, applied after ``set``
    init: Pretrained | None = None


class Scale(Strict):
    specs: PathName  # spec folder, relative to the study file
    train: dict[str, Any] = {}  # training config fields (validated as a TrainConfig)


class LearningRates(Strict):
    """Log-spaced grid ``points`` values from ``low`` to ``high`` (sampler grid), or the range
    TPE samples ``points`` times per (variant, seed) from."""

    low: PositiveFloat = 1e-3
    high: PositiveFloat = 1e-2
    points: int = Field(2, gt=0, le=MAX_POINTS)

    def grid(self) -> list[float]:
        if self.points == 1:
            return [math.sqrt(self.low * self.high)]
        ratio = (self.high / self.low) ** (1 / (self.points - 1))
        return [self.low * ratio**i for i in range(self.points)]


def train_setup(config: TrainConfig) -> dict:
    """The training config as a trial records it: without what the trial sets itself (steps, seed
    and learning rate)."""
    return config.model_dump(mode="json", exclude={"steps": True, "seed": True, "optimizer": {"lr"}})


def as_recorded_now(setup: dict) -> dict:
    """A trial's recorded setup with the training config fields added to archlab since then at
    their defaults, which is how it trained before they existed (a setup that no longer validates
    stays as it was, for the comparison to name what changed)."""
    if "train" not in setup:
        return setup
    try:
        return {**setup, "train": train_setup(TrainConfig.model_validate(setup["train"]))}
    except ValueError:  # pydantic's ValidationError: a field since removed, or a value no longer allowed
        return setup


class StudySpec(Strict):
    schema_version: SchemaVersion
    name: str = Field(min_length=1)
    description: str = ""
    question: str = ""  # what the study answers, for the report
    baseline: str
    variants: dict[str, Variant] = Field(min_length=1)
    budget: Literal["steps", "flops"] = "steps"  # flops: every variant gets the baseline's training FLOPs
    seeds: list[Seed] = Field([0], min_length=1)
    lr: LearningRates = LearningRates()
    sampler: Literal["grid", "tpe"] = "grid"
    pruner: Literal["none", "median", "hyperband"] = "none"
    metric: Literal["val_loss", "accuracy"] = "val_loss"  # accuracy: for the synthetic recall tasks
    report_seq_len: int = Field(16384, gt=0, le=LONGEST_CONTEXT)  # context at which the report gives cache memory
    scales: dict[str, Scale] = Field(min_length=1)

    @property
    def maximize(self) -> bool:
        return self.metric == "accuracy"

    @property
    def record_key(self) -> str:
        """The trainer's evaluation record holding the metric."""
        return "eval_acc" if self.maximize else "eval_loss"

    def problems(self) -> list[Problem]:
        root = Problems()
        if self.baseline not in self.variants:
            root.at("baseline").add(f"{self.baseline!r} is not one of the variants {sorted(self.variants)}")
        if self.lr.low > self.lr.high:
            root.at("lr").add(f"low={self.lr.low} is above high={self.lr.high}")
        if self.lr.low == self.lr.high and self.lr.points > 1:  # the same trial twice, counted as two seeds
            root.at("lr").add(f"low = high = {self.lr.low} gives {self.lr.points} equal learning rates; widen the range or set points: 1")
        elif not all(0 < lr < math.inf for lr in self.lr.grid()):  # their ratio, or product, past a float's range
            root.at("lr").add(f"low={self.lr.low} and high={self.lr.high} are too far apart to space learning rates between")
        for i, seed in enumerate(self.seeds):
            if seed in self.seeds[:i]:
                root.at("seeds").at(i).add(f"seed {seed} is listed twice")
        named = [("study", root.at("name"), self.name), *(("scale", root.at("scales").at(s), s) for s in self.scales),
                 *(("variant", root.at("variants").at(v), v) for v in self.variants)]
        for what, at, name in named:
            if not FOLDER_NAME.fullmatch(name):
                at.add(f"a {what}'s name is letters, digits, '.', '_' and '-' only")
            elif len(name) > LONGEST_NAME:  # every trial failed on a folder name too long for the disk
                at.add(f"a {what}'s name is at most {LONGEST_NAME} characters (this one has {len(name)}): it names the trials' folders")
            elif what == "scale" and "-" in name:  # the key name-scale of study a-b at scale c would be study a's at scale b-c
                at.add("a scale's name is letters, digits, '.' and '_' only: the study's key joins it to the study's name with '-'")
        for name, variant in self.variants.items():
            for scale in sorted(set(variant.scale_set) - set(self.scales)):  # a misspelt scale would be ignored
                root.at("variants").at(name).at("scale_set").at(scale).add(f"no scale {scale!r}; this study has {sorted(self.scales)}")
            init = variant.init
            blank = [key for key in ("run", "study", "variant") if init and getattr(init, key) is not None and not getattr(init, key).strip()]
            for key in blank:  # a run read as the current folder; a study, a variant of no name
                given = {"run": "a training run's folder", "study": "a study file or name", "variant": "a variant's name"}[key]
                root.at("variants").at(name).at("init").at(key).add(f"is empty; give {given}, or leave it out")
            if blank:
                continue
            if init and (init.run is None) == (init.study is None):
                root.at("variants").at(name).at("init").add("give one of run (a training run every seed starts from) and study (a"
                                                             " study whose trial of each seed that seed starts from)")
            elif init and init.variant and not init.study:
                root.at("variants").at(name).at("init").at("variant").add("names a variant of a study: give the study too, or drop it")
        return root.found


class Study:
    """A validated study at one scale: the specs and training configs of its variants."""

    def __init__(self, definition: StudySpec, source: Path, scale: str, data: str | None = None, within: tuple[Path, ...] = ()):
        if scale not in definition.scales:
            raise SpecError(str(source), [Problem("scales", f"no scale {scale!r}; this study has {sorted(definition.scales)}")])
        self.definition, self.source, self.scale = definition, source, scale
        self.data_given = data  # in place of the scale's own
        at = definition.scales[scale]
        self.spec_dir = (source.parent / at.specs).resolve()
        if not self.spec_dir.is_dir():
            raise SpecError(str(source), [Problem(f"scales.{scale}.specs", f"{self.spec_dir} is {'a file' if self.spec_dir.exists() else 'not there'};"
                                                  " give the folder holding the variants' specs (relative to the study file)")])
        self.config = validate_as(TrainConfig, at.train, f"{source} (scales.{scale}.train)")
        if data:
            self.config = self.config.model_copy(update={"data": self.config.data.model_copy(update={"source": data})})
        self.specs: dict[str, ModelSpec] = {name: self._variant(name, v) for name, v in definition.variants.items()}
        self.pretraining: dict[str, tuple[Study, str]] = {  # variant -> (the study, its variant) its trials start from
            name: self._pretraining(name, v.init, (*within, source.resolve())) for name, v in definition.variants.items()
            if v.init and v.init.study}
        if found := self.problems():
            raise SpecError(str(source), found)

    def problems(self) -> list[Problem]:
        """What makes the study untrainable at this scale and data, found before any trial trains."""
        root, source = Problems(), self.config.data.source
        if self.definition.metric == "accuracy" and source not in SYNTHETIC:
            root.at("metric").add(f"accuracy is measured on the synthetic tasks {list(SYNTHETIC)}, but scale {self.scale} trains"
                                  f" on {source!r}; use metric: val_loss, or one of those tasks")
        baseline = self.specs[self.definition.baseline]
        for name in self.definition.variants:
            if self.steps(name) == 0:  # a step of it costs more than the baseline's whole run
                per_sequence = Cost(self.specs[name]).train_flops_per_sequence(self.config.seq_len)
                needed = math.ceil(per_sequence / Cost(baseline).train_flops_per_sequence(self.config.seq_len))
                root.at("variants").at(name).add(
                    f"budget: flops gives it 0 steps: one of its steps costs more training FLOPs than the baseline's whole run"
                    f" (steps: {self.config.steps}); raise scales.{self.scale}.train.steps to at least {needed}")
            if self.definition.variants[name].init and self.config.init:
                root.at("variants").at(name).at("init").add(
                    f"scales.{self.scale}.train.init already starts every trial from {self.config.init}; give one or the other")
        vocabularies = {spec.vocab_size for spec in self.specs.values()}
        if len(vocabularies) > 1 and self.shares_corpus and tokenized(source):
            sizes = ", ".join(f"{name} {spec.vocab_size}" for name, spec in self.specs.items())
            root.at("variants").add(f"the variants' vocab_size differ ({sizes}), but their trials share one corpus tokenized at one"
                                    " vocabulary, and losses per token of different tokenizers do not compare; give every variant one"
                                    " vocab_size (a study per vocabulary)")
        return root.found

    def _pretraining(self, name: str, init: Pretrained, within: tuple[Path, ...]) -> tuple[Study, str]:
        """The study a variant's trials start from, at this scale, and its variant there."""
        at = f"{self.source} (variants.{name}.init)"
        try:
            path = find_study(str(self.source.parent / init.study) if Path(init.study).suffix in YAML else init.study).resolve()
            if path in within:
                raise SpecError(at, [Problem("study", f"{init.study!r} starts from this study's trials, which start from it: a circle")])
            pretraining = Study(validate_as(StudySpec, load_yaml(path), str(path)), path, self.scale, within=within)
        except SpecError as exc:
            raise exc if exc.source == at else SpecError(f"{exc.source}, which {at} starts from", exc.problems) from None
        variant = init.variant or name
        if variant not in pretraining.specs:
            raise SpecError(at, [Problem("variant" if init.variant else "study",
                                         f"study {pretraining.name} has no variant {variant!r}; it has {sorted(pretraining.specs)}")])
        return pretraining, variant

    def _variant(self, name: str, variant: Variant) -> ModelSpec:
        path = self.spec_dir / variant.spec
        try:
            data = set_dotted(load_yaml(path), "name", name)
        except SpecError as exc:  # the spec file's own problem, said with the variant that names it
            raise SpecError(f"{exc.source} (variants.{name} of {self.source})", exc.problems) from None
        try:
            data = set_each_dotted(data, variant.set.items(), "set")
            data = set_each_dotted(data, variant.scale_set.get(self.scale, {}).items(), f"scale_set.{self.scale}")  # may replace set's whole
        except SpecError as exc:
            raise SpecError(f"{self.source} (variants.{name}: set / scale_set.{self.scale})", exc.problems) from None
        return validate_spec(data, f"{self.source} (variants.{name} from {path.name})")

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def shares_corpus(self) -> bool:
        """Whether the trials read one corpus tokenized once for all of them: not examples, tokenized
        at each start, nor text read by trials that start from trained runs, each with its run's tokenizer."""
        source = self.config.data.source
        return not (holds_examples(source) or tokenized(source) and any(map(self.fine_tuned, self.definition.variants)))

    @property
    def key(self) -> str:
        """The study's name in a storage, and its folder's: one per scale."""
        return f"{self.name}-{self.scale}"

    def fine_tuned(self, variant: str) -> bool:
        """Whether ``variant``'s trials start from trained weights: a run's, or a study's trials'."""
        return bool(self.definition.variants[variant].init or self.config.init)

    def start_run(self, variant: str) -> tuple[str, str] | None:
        """The run ``variant``'s trials start from, and the field that names it: its own
        ``init.run``, or the scale's ``train.init`` (every variant's); None where they train from
        random weights or from a study's trials."""
        init = self.definition.variants[variant].init
        if init and init.run:
            return init.run, f"variants.{variant}.init.run"
        if self.config.init:
            return self.config.init, f"scales.{self.scale}.train.init"
        return None

    def planned(self) -> set[tuple]:
        """The (variant, seed, lr slot) of every planned trial: what the report covers."""
        return {(p["variant"], p["seed"], p["slot"]) for p in self.plan()}

    def setup(self, variant: str, slot: int) -> dict:
        """Everything a planned trial trains with besides its seed. It is recorded with the trial,
        because a result trained otherwise does not answer the study as it now stands."""
        lr = self.definition.lr
        setup = {
            "spec": self.specs[variant].model_dump(mode="json", exclude={"name", "description"}),
            "train": train_setup(self.config),
            "steps": self.steps(variant),
            "lr": lr.grid()[slot] if self.definition.sampler == "grid" else [lr.low, lr.high],
            "metric": self.definition.metric,
            "pruner": self.definition.pruner,  # what cut a pruned trial short (check_unchanged compares it for those alone)
        }
        init = self.definition.variants[variant].init  # recorded only where set, so that setups recorded before it existed compare equal
        if init and init.run:
            setup["init"] = {"run": os.path.abspath(init.run)}
        elif init:
            study, pretrained = self.pretraining[variant]
            setup["init"] = {"study": study.key, "variant": pretrained}
        return setup

    def steps(self, variant: str) -> int:
        """Training steps of a variant: the config's, or those with the baseline's FLOPs."""
        steps = self.config.steps
        if self.definition.budget == "steps":
            return steps
        return equal_flops_steps(self.specs[self.definition.baseline], steps, self.specs[variant], self.config.seq_len)

    def plan(self) -> list[dict]:
        """Every planned trial's fixed parameters."""
        slots = range(self.definition.lr.points)
        return [
            {"variant": v, "seed": s, "slot": i} for v in self.definition.variants for s in self.definition.seeds for i in slots
        ]


YAML = (".yaml", ".yml")


def find_study(name_or_path: str) -> Path:
    """A study file, or the name of a shipped one (studies/NAME.yaml)."""
    path = Path(name_or_path)
    if path.suffix in YAML:
        return path
    if path.is_dir():
        raise SpecError(name_or_path, [Problem("<study>", "is a folder; give a study file (.yaml) or the name of a shipped study")])
    shipped = STUDIES / f"{name_or_path}.yaml"
    if not shipped.is_file():
        names = ", ".join(shipped_studies())
        if path.exists():  # a corpus, a spec without its suffix: there, but not read as a study
            raise SpecError(name_or_path, [Problem("<study>", f"is not a study file (.yaml or .yml), nor a shipped study's name;"
                                                              f" shipped: {names}")])
        raise SpecError(name_or_path, [Problem("<study>", f"no file or shipped study of that name; shipped: {names}")])
    return shipped


def shipped_studies() -> list[str]:
    """The names of the studies archlab ships, which ``archlab study NAME`` runs."""
    return sorted(p.stem for p in STUDIES.glob("*.yaml"))


def load_study(name_or_path: str, scale: str = "tiny", data: str | None = None) -> Study:
    """A study at one scale; ``data`` replaces the scale's data source for every trial."""
    path = find_study(name_or_path)
    return Study(validate_as(StudySpec, load_yaml(path), str(path)), path, scale, data)
