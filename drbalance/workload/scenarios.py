"""Workload scenarios: which apps (model, batch, plan, initial DR, arrival) on how many GPUs.

The paper's three experiments (a), (b), (c) are here in code, with the choices the paper leaves
open made explicit (batch, run length, initial placement; see docs/reproduction.md), plus scaled
down versions for the demo and the end-to-end test. New scenarios can be written as JSON:

    {"name": "mine", "gpus": 2, "placement": "round-robin",
     "apps": [{"name": "r1", "model": "resnet50", "batch": 32, "epochs": 4, "iterations_per_epoch": 50,
               "ratio": [10, 0], "arrival": 0.0}, ...]}

``placement`` gives the initial DR of apps without a ``ratio``: ``round-robin`` puts app i alone
on GPU i mod m (the usual one-GPU-per-job launch); ``spread`` splits evenly over every GPU (plain
DataParallel on all GPUs). ``gpu_speed`` (optional, one positive factor of at most
``MAX_GPU_SPEED`` per GPU, default all 1) makes GPUs of different speeds: a GPU of speed 0.5 needs
twice as long for the same work. ``dr_total`` (optional, default 10) is 1..65535, as for the daemon.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType

from drbalance.ipc.layout import MAX_GPUS
from drbalance.ipc.names import check_app_name
from drbalance.jsonlog import finite_number
from drbalance.ratio import DEFAULT_TOTAL, DataRatio, apportion
from drbalance.workload.models import SHORT_NAMES, model_costs

logger = logging.getLogger(__name__)

PLACEMENTS = ("round-robin", "spread")
MAX_DR_TOTAL = 65535  # the largest DR total the daemon accepts (a record's shares are 16-bit)
MAX_GPU_SPEED = 1000.0
"""The largest ``gpu_speed`` factor: 1000 times the reference GPU is far beyond any real one, and
the lower bound's linear programme fails on speeds near 10^15."""
MAX_TEXT = 1000
"""The longest scenario ``name`` or ``description`` (characters): they are printed and logged."""
SHORT_NAME = {full: short for short, full in SHORT_NAMES.items()}  # resnet50 -> res


@dataclass(frozen=True)
class AppSpec:
    """One training job. ``batch`` is samples per iteration; ``arrival`` seconds after the start.

    ``ddp``: a DistributedDataParallel job under torchrun, one rank on each GPU where its initial
    DR is non-zero (the DR then moves only among those GPUs); default: one DataParallel process.
    """

    name: str
    model: str
    batch: int
    epochs: int
    iterations_per_epoch: int
    ratio: tuple[int, ...] | None = None
    arrival: float = 0.0
    ddp: bool = False

    def __post_init__(self) -> None:
        check_app_name(self.name)  # names become file names and IPC object names: no '/', no '..'
        if not isinstance(self.model, str):
            raise ValueError(f"app {self.name!r}: model must be a model name; got {self.model!r}")
        model_costs(self.model)  # raises for an unknown model
        if not isinstance(self.ddp, bool):
            raise ValueError(f"app {self.name!r}: ddp must be true or false; got {self.ddp!r}")
        for what in ("batch", "epochs", "iterations_per_epoch"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"app {self.name!r}: {what} must be a positive integer; got {value!r}")
        if not (finite_number(self.arrival) and self.arrival >= 0):
            raise ValueError(f"app {self.name!r}: arrival must be a finite number >= 0 of seconds; "
                             f"got {self.arrival!r}")

    @property
    def iterations(self) -> int:
        return self.epochs * self.iterations_per_epoch

    def solo_time(self) -> float:
        """Modelled seconds alone on one reference GPU (the SD denominator)."""
        return self.iterations * model_costs(self.model).solo_iteration(self.batch)


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int
    apps: tuple[AppSpec, ...]
    description: str = ""
    placement: str = "round-robin"
    dr_total: int = DEFAULT_TOTAL
    paper: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    gpu_speed: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.gpus <= MAX_GPUS:
            raise ValueError(f"scenario {self.name!r}: gpus must be 1..{MAX_GPUS} (what a job's record "
                             f"carries); got {self.gpus}")
        if isinstance(self.dr_total, bool) or not isinstance(self.dr_total, int) or not (
                1 <= self.dr_total <= MAX_DR_TOTAL):
            raise ValueError(f"scenario {self.name!r}: dr_total must be an integer 1..{MAX_DR_TOTAL} (what the "
                             f"daemon's 16-bit shares carry); got {self.dr_total!r}")
        if self.gpu_speed is not None:
            speeds = tuple(self.gpu_speed)
            if len(speeds) != self.gpus or not all(
                    finite_number(v) and 0 < v <= MAX_GPU_SPEED
                    for v in speeds):
                raise ValueError(f"scenario {self.name!r}: gpu_speed must hold {self.gpus} positive numbers of at "
                                 f"most {MAX_GPU_SPEED:g}; got {list(speeds)}")
            object.__setattr__(self, "gpu_speed", tuple(float(v) for v in speeds))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"scenario {self.name!r}: placement must be one of {PLACEMENTS}")
        names = [app.name for app in self.apps]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"scenario {self.name!r}: app names must be distinct and non-empty: {names}")
        for app in self.apps:
            if app.ratio is not None:
                try:
                    DataRatio(app.ratio, self.dr_total)  # validates
                except ValueError as error:
                    raise ValueError(f"app {app.name!r}: ratio: {error}") from None
                if len(app.ratio) != self.gpus:
                    raise ValueError(f"app {app.name!r}: ratio {list(app.ratio)} is not for {self.gpus} GPUs")

    def initial_ratio(self, index: int) -> DataRatio:
        app = self.apps[index]
        if app.ratio is not None:
            return DataRatio(app.ratio, self.dr_total)
        if self.placement == "spread":
            return DataRatio.even(self.gpus, self.dr_total)
        return DataRatio.single(self.gpus, index % self.gpus, self.dr_total)

    def speed(self, gpu: int) -> float:
        """Speed factor of GPU ``gpu`` (1 = the reference GPU the model costs are for)."""
        return 1.0 if self.gpu_speed is None else self.gpu_speed[gpu]

    def with_dr_total(self, total: int) -> Scenario:
        """The same scenario with DRs of granularity ``total`` (explicit DRs rescaled, largest remainder).

        A DDP app's ranks are the GPUs of its non-zero shares, and a rank must keep at least one
        unit (docs/ddp.md), so its DR is rescaled with one unit on each rank: a rank the plain
        rescale would leave at 0 gets 1 and the others share the rest. A DDP app of more ranks
        than ``total`` is refused (ValueError naming the app).
        """
        apps = tuple(replace(a, ratio=_rescaled(a, self.dr_total, total)) if a.ratio else a for a in self.apps)
        return replace(self, dr_total=total, apps=apps)

    def with_placement(self, placement: str) -> Scenario:
        return replace(self, placement=placement, apps=tuple(replace(a, ratio=None) for a in self.apps))

    def scaled(self, factor: float, name: str | None = None) -> Scenario:
        """The same scenario with every run ``factor`` times as long (iterations per epoch)."""
        apps = tuple(replace(a, iterations_per_epoch=max(1, round(a.iterations_per_epoch * factor))) for a in self.apps)
        return replace(self, apps=apps, name=name or self.name)

    def to_json(self) -> str:
        data = {
            "name": self.name, "gpus": self.gpus, "description": self.description, "placement": self.placement,
            "dr_total": self.dr_total, "paper": dict(self.paper),
            "gpu_speed": list(self.gpu_speed) if self.gpu_speed is not None else None,
            "apps": [{**asdict(app), "ratio": list(app.ratio) if app.ratio is not None else None} for app in self.apps],
        }
        return json.dumps(data, indent=2)


def _rescaled(app: AppSpec, old_total: int, total: int) -> tuple[int, ...]:
    """``app``'s explicit DR (of ``old_total``) in ``total`` units; a DDP app keeps one unit on each rank."""
    ratio = DataRatio(app.ratio, old_total)  # type: ignore[arg-type]
    if not app.ddp:
        return ratio.rescale(total).shares
    ranks = [gpu for gpu, share in enumerate(ratio.shares) if share]
    if len(ranks) > total:
        raise ValueError(f"app {app.name!r}: a DDP job of {len(ranks)} ranks needs a DR total of at least "
                         f"{len(ranks)} (one unit per rank); got {total}")
    pinned: set[int] = set()  # ranks held at one unit
    while True:
        free = [gpu for gpu in ranks if gpu not in pinned]
        split = apportion([ratio[gpu] for gpu in free], total - len(pinned)) if free else ()
        starved = {gpu for gpu, share in zip(free, split, strict=True) if share == 0}
        if not starved:
            shares = [0] * len(ratio)
            for gpu in pinned:
                shares[gpu] = 1
            for gpu, share in zip(free, split, strict=True):
                shares[gpu] = share
            return tuple(shares)
        pinned |= starved


def _check_keys(data: object, kind: type, what: str) -> dict:
    """``data`` as a dict with every required field of the dataclass ``kind`` and no other key;
    ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    known = {f.name: f for f in fields(kind)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    missing = [name for name, f in known.items()
               if f.default is MISSING and f.default_factory is MISSING and name not in data]
    if missing:
        raise ValueError(f"{what}: missing key(s) {', '.join(map(repr, missing))}")
    return data


def _refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict; ValueError on a key given twice (json keeps the last one
    silently, so a scenario edited by hand would run with a value its author did not see)."""
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {key!r} is given twice in one object")
        data[key] = value
    return data


def _check_text(data: dict, key: str) -> None:
    value = data.get(key, "")
    if not isinstance(value, str) or not value.isprintable() or len(value) > MAX_TEXT:
        raise ValueError(f"{key!r} must be printable text of at most {MAX_TEXT} characters; got {value!r:.80}")


def _check_types(data: dict) -> None:
    """The top-level values a scenario cannot be built from otherwise (ValueError naming the key)."""
    _check_text(data, "name")
    _check_text(data, "description")
    if not isinstance(data["gpus"], int) or isinstance(data["gpus"], bool):
        raise ValueError(f"'gpus' must be an integer, got {data['gpus']!r}")
    if not isinstance(data["apps"], list):
        raise ValueError(f"'apps' must be a list of apps, got {type(data['apps']).__name__}")
    if data.get("gpu_speed") is not None and not isinstance(data["gpu_speed"], list):
        raise ValueError(f"'gpu_speed' must be a list of one speed factor per GPU, e.g. [1, 1, 0.5, 0.5]; "
                         f"got {data['gpu_speed']!r}")
    paper = data.get("paper", {})
    if not isinstance(paper, dict) or not all(finite_number(value) for value in paper.values()):
        raise ValueError(f"'paper' must be a JSON object of the paper's reported values (numbers); got {paper!r:.80}")
    for index, app in enumerate(data["apps"]):
        if isinstance(app, dict) and app.get("ratio") is not None and not isinstance(app["ratio"], list):
            raise ValueError(f"app {index}: 'ratio' must be a list of shares, one per GPU, e.g. [10, 0]; "
                             f"got {app['ratio']!r}")


def scenario_from_json(text: str, source: str = "scenario") -> Scenario:
    try:
        data = _check_keys(json.loads(text, object_pairs_hook=_refuse_duplicate_keys), Scenario, "the scenario")
        _check_types(data)
        for index, app in enumerate(data["apps"]):
            _check_keys(app, AppSpec, f"app {index}")
        apps = tuple(
            AppSpec(**{**app, "ratio": tuple(app["ratio"]) if app.get("ratio") is not None else None})
            for app in data.pop("apps")
        )
        data["paper"] = MappingProxyType(dict(data.get("paper", {})))
        if data.get("gpu_speed") is not None:
            data["gpu_speed"] = tuple(data["gpu_speed"])
        return Scenario(apps=apps, **data)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:
        raise ValueError(f"{source}: not a valid scenario: {error}") from None
    except RecursionError:
        raise ValueError(f"{source}: not a valid scenario: JSON nested too deeply") from None


def sized_app(name: str, model: str, batch: int, solo_seconds: float, epochs: int, arrival: float = 0.0) -> AppSpec:
    """An app whose plan lasts about ``solo_seconds`` alone on one GPU."""
    per_iteration = model_costs(model).solo_iteration(batch)
    per_epoch = max(1, round(solo_seconds / per_iteration / epochs))
    return AppSpec(name, model, batch, epochs, per_epoch, None, arrival)


PAPER_BATCH = 32  # the paper does not say; 32 images per iteration for every app
PAPER_SOLO_SECONDS = 1800.0  # each app would take ~30 min alone (the paper's plots span tens of minutes)
PAPER_EPOCHS = 10


def _paper(name: str, gpus: int, models: list[str], description: str, paper: dict[str, float]) -> Scenario:
    counts: dict[str, int] = {}
    apps = []
    for model in models:
        counts[model] = counts.get(model, 0) + 1
        apps.append(sized_app(f"{SHORT_NAME[model]}{counts[model]}", model, PAPER_BATCH, PAPER_SOLO_SECONDS,
                              PAPER_EPOCHS))
    return Scenario(name, gpus, tuple(apps), description, "round-robin", DEFAULT_TOTAL, MappingProxyType(paper))


SCENARIOS: Mapping[str, Scenario] = MappingProxyType({
    "a": _paper("a", 4, ["densenet121", "resnet50", "alexnet", "densenet121", "resnet50", "alexnet"],
                "paper (a): 4 GPUs, 6 apps: 2 x DenseNet121, 2 x ResNet50, 2 x AlexNet",
                {"sd_diff_start": 0.65, "sd_diff_end": 0.1, "mean_sd_change": -0.15, "util_change": 0.40}),
    "b": _paper("b", 3, ["densenet121", "resnet50", "alexnet", "densenet121", "resnet50"],
                "paper (b): 3 GPUs, 5 apps: 2 x DenseNet121, 2 x ResNet50, 1 x AlexNet",
                {"sd_diff_start": 0.65, "sd_diff_end": 0.3, "mean_sd_change": -0.20, "util_change": 0.25}),
    "c": _paper("c", 4, ["densenet121", "resnet50", "alexnet", "resnext50_32x4d", "shufflenet_v2_x1_0",
                         "mnasnet1_0"],
                "paper (c): 4 GPUs, 6 apps: one each of the six models",
                {"sd_diff_start": 0.65, "sd_diff_end": 0.1, "mean_sd_change": -0.15, "util_change": 0.15}),
})


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name (a, b, c, demo-a, e2e-a, e2e-skewed), or a JSON file.

    A built-in name wins over a file of that name in the working directory (a warning says so;
    ``./a`` names the file)."""
    builtin = SCENARIOS.get(name_or_path) or DEMO_SCENARIOS.get(name_or_path)
    if builtin is not None:
        if os.path.lexists(name_or_path):
            logger.warning("scenario %r: the built-in scenario, not the file %s here (write ./%s for the file)",
                           name_or_path, name_or_path, name_or_path)
        return builtin
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return scenario_from_json(_read_scenario_file(path), str(path))
    known = ", ".join([*SCENARIOS, *DEMO_SCENARIOS])
    raise ValueError(f"unknown scenario {name_or_path!r}: use one of {known}, or a .json file")


MAX_SCENARIO_BYTES = 16 * 1024 * 1024  # a scenario of thousands of apps is well under 1 MiB


def _read_scenario_file(path: Path) -> str:
    """The text of a scenario file: a regular file (not a FIFO or a device such as /dev/zero, which
    would hang or fill memory) of at most ``MAX_SCENARIO_BYTES``, UTF-8. ValueError naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"cannot read scenario file {path}: not a regular file")
        with open(fd, "rb") as handle:
            data = handle.read(MAX_SCENARIO_BYTES + 1)
    except OSError as error:
        raise ValueError(f"cannot read scenario file {path}: {error}") from None
    if len(data) > MAX_SCENARIO_BYTES:
        raise ValueError(f"cannot read scenario file {path}: larger than {MAX_SCENARIO_BYTES // (1024 * 1024)} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"cannot read scenario file {path}: not UTF-8 text ({error.reason} at byte "
                         f"{error.start})") from None


DEMO_BATCH = {"densenet121": 32, "resnet50": 32, "alexnet": 128}  # AlexNet's customary batch is 128


def _demo(name: str, solo_seconds: float, epochs: int, description: str,
          start_gpus: tuple[int, ...] | None = None) -> Scenario:
    """Scenario (a) with short runs. AlexNet uses batch 128 (as Krizhevsky et al. trained it), so
    that on emulated GPUs its modelled iteration is long enough to hide its real CPU work."""
    models = ["densenet121", "resnet50", "alexnet", "densenet121", "resnet50", "alexnet"]
    counts: dict[str, int] = {}
    apps = []
    for index, model in enumerate(models):
        counts[model] = counts.get(model, 0) + 1
        app = sized_app(f"{SHORT_NAME[model]}{counts[model]}", model, DEMO_BATCH[model], solo_seconds, epochs,
                        arrival=0.1 * index)
        if start_gpus is not None:  # explicit start GPUs instead of round-robin
            app = replace(app, ratio=DataRatio.single(4, start_gpus[index]).shares)
        apps.append(app)
    return Scenario(name, 4, tuple(apps), description, "round-robin")


# Solo-run lengths are in modelled seconds; the launcher's --time-scale stretches them in wall time.
DEMO_SCENARIOS: Mapping[str, Scenario] = MappingProxyType({
    "demo-a": _demo("demo-a", 2.6, 4, "scenario (a) scaled down for the demo: 6 apps on 4 GPUs"),
    "e2e-a": _demo("e2e-a", 2.4, 3, "scenario (a) scaled down further"),
    "e2e-skewed": _demo("e2e-skewed", 2.0, 3, "scenario (a)'s six apps started uncoordinated: 3 on GPU 0, "
                        "2 on GPU 1, 1 on GPU 2, GPU 3 idle", start_gpus=(0, 0, 0, 1, 1, 2)),
})
