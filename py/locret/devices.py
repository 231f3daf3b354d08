"""Device profiles (devices/*.toml): what a board offers the model and how to use it there.

A profile names a device's memory available to the model, its memory bandwidth and compute class,
its CUDA architecture and CMake flags, and Locret defaults (budget, chunk, stabilizers, KV cache
type, GPU layers) per model size class. Every hardware figure cites where it comes from; the
format is described in devices/README.md.

    from locret import devices
    dev = devices.load("jetson-orin-nano-8gb")     # a name from devices/, or a path to a .toml file
    dev.memory.available_bytes, dev.size_class_for(n_params=7.6e9).budget

This module uses the standard library only and never imports the rest of the package, so that
scripts/setup.sh can run it with the system Python before the package is installed:

    python3 py/locret/devices.py list
    python3 py/locret/devices.py build-config rtx4090    # shell assignments for setup.sh
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: say so instead of failing with a traceback
    tomllib = None

# py/locret/devices.py -> repository root -> devices/
DEVICES_DIR = Path(__file__).resolve().parents[2] / "devices"
SCHEMA = 1
GIB = 1 << 30

MEMORY_KINDS = ("discrete", "unified", "host")
BACKENDS = ("cuda", "cpu")
# the K/V cache types llama.cpp accepts for -ctk/-ctv
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# figures that must cite a source; build.cuda_architectures only for CUDA devices
CITED_FIGURES = ("memory.total_gib", "memory.available_gib", "memory.bandwidth_gbs", "compute.class")
# setup.sh derives these two from build.cuda_architectures itself; the rest of cmake_flags is passed on
_DERIVED_FLAGS = ("LOCRET_CUDA", "CMAKE_CUDA_ARCHITECTURES")
_CMAKE_FLAG = re.compile(r"^-D([A-Za-z_][A-Za-z0-9_]*)(?::[A-Z]+)?=([A-Za-z0-9_.;,/+-]*)$")
_CUDA_ARCHS = re.compile(r"^[0-9]+(-real|-virtual)?(;[0-9]+(-real|-virtual)?)*$")


class DeviceError(ValueError):
    """An unknown device name or an invalid profile; the message says which and why."""


@dataclass(frozen=True)
class Memory:
    kind: str               # discrete: GPU memory of its own; unified: CPU and GPU share it; host: CPU only
    total_gib: float        # what the vendor states
    available_gib: float    # what the planner lets the model use (total minus OS/driver reservations)
    reserve_note: str       # why total - available is reserved
    bandwidth_gbs: float

    @property
    def available_bytes(self) -> int:
        return int(self.available_gib * GIB)


@dataclass(frozen=True)
class Compute:
    klass: str              # `class` in the file: GPU/CPU generation and size, in words
    cpu_cores: int | None
    gpu_cuda_cores: int | None


@dataclass(frozen=True)
class Build:
    backend: str                    # cuda or cpu
    cuda_architectures: str | None  # CMAKE_CUDA_ARCHITECTURES, e.g. "89"
    cmake_flags: tuple[str, ...]

    def extra_cmake_flags(self) -> tuple[str, ...]:
        """cmake_flags other than the two that setup.sh derives from the backend and architecture."""
        return tuple(f for f in self.cmake_flags if _CMAKE_FLAG.match(f).group(1) not in _DERIVED_FLAGS)


@dataclass(frozen=True)
class SizeClass:
    name: str               # e.g. "7-8B"
    max_params_b: float     # models up to this many billion parameters use these defaults
    budget: int             # Locret budget b (retained units per layer and KV head)
    ubatch: int             # chunk B = n_ubatch
    stabilizers: int        # n_s
    kv_type: str            # -ctk/-ctv
    gpu_layers: int         # -ngl; -1 means all layers (llama.cpp's own convention)

    @property
    def gpu_layers_text(self) -> str:
        return "all" if self.gpu_layers < 0 else str(self.gpu_layers)


@dataclass(frozen=True)
class Source:
    figures: tuple[str, ...]
    url: str
    says: str


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    memory: Memory
    compute: Compute
    build: Build
    size_classes: tuple[SizeClass, ...]
    sources: tuple[Source, ...]
    path: Path

    def size_class_for(self, n_params: float) -> tuple[SizeClass, bool]:
        """Defaults for a model of n_params parameters, and whether a class covers it. A model above
        every class gets the largest class's defaults (False): the memory check then decides."""
        for sc in self.size_classes:
            if n_params <= sc.max_params_b * 1e9:
                return sc, True
        return self.size_classes[-1], False


def known_devices() -> list[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.toml"))


def resolve_path(name_or_path: str | Path) -> Path:
    """The profile file of a device name (devices/NAME.toml) or of a path to a .toml file."""
    key = str(name_or_path)
    if key.endswith(".toml") or "/" in key:
        path = Path(key)
        if not path.is_file():
            raise DeviceError(f"device profile {key}: no such file")
        return path
    path = DEVICES_DIR / f"{key}.toml"
    if not path.is_file():
        known = ", ".join(known_devices()) or "none"
        raise DeviceError(f"unknown device '{key}': known devices are {known} (or give a path to a .toml profile)")
    return path


def load(name_or_path: str | Path) -> Device:
    """Load and validate a device profile; DeviceError (one line, naming the file) if it is wrong."""
    if tomllib is None:
        raise DeviceError("reading device profiles needs Python 3.11 or newer (tomllib)")
    path = resolve_path(name_or_path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise DeviceError(f"{path}: not valid TOML ({e})") from None
    try:
        return _parse(data, path)
    except _Invalid as e:
        raise DeviceError(f"{path}: {e}") from None


class _Invalid(Exception):
    pass


def _get(table: dict, key: str, kind, where: str, *, required: bool = True):
    """table[key] checked against a type (bool is not accepted as a number)."""
    if key not in table:
        if required:
            raise _Invalid(f"missing {where}{key}")
        return None
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise _Invalid(f"{where}{key} must be {names}, got {value!r}")
    return value


def _table(data: dict, key: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise _Invalid(f"missing table [{key}]")
    return value


def _parse(data: dict, path: Path) -> Device:
    if data.get("schema") != SCHEMA:
        raise _Invalid(f"schema must be {SCHEMA} (got {data.get('schema')!r})")
    name = _get(data, "name", str, "")
    if name != path.stem:
        raise _Invalid(f"name '{name}' does not match the file name '{path.stem}'")
    description = _get(data, "description", str, "")

    m = _table(data, "memory")
    memory = Memory(kind=_get(m, "kind", str, "memory."),
                    total_gib=float(_get(m, "total_gib", (int, float), "memory.")),
                    available_gib=float(_get(m, "available_gib", (int, float), "memory.")),
                    reserve_note=_get(m, "reserve_note", str, "memory."),
                    bandwidth_gbs=float(_get(m, "bandwidth_gbs", (int, float), "memory.")))
    if memory.kind not in MEMORY_KINDS:
        raise _Invalid(f"memory.kind must be one of {', '.join(MEMORY_KINDS)} (got '{memory.kind}')")
    if not 0 < memory.available_gib <= memory.total_gib:
        raise _Invalid(f"memory.available_gib ({memory.available_gib}) must be > 0 and <= memory.total_gib "
                       f"({memory.total_gib})")
    if memory.bandwidth_gbs <= 0:
        raise _Invalid("memory.bandwidth_gbs must be > 0")

    c = _table(data, "compute")
    compute = Compute(klass=_get(c, "class", str, "compute."),
                      cpu_cores=_get(c, "cpu_cores", int, "compute.", required=False),
                      gpu_cuda_cores=_get(c, "gpu_cuda_cores", int, "compute.", required=False))

    build = _parse_build(_table(data, "build"))
    if (build.backend == "cpu") != (memory.kind == "host"):
        raise _Invalid("a cpu build goes with memory.kind = 'host' and a cuda build with 'discrete' or 'unified'")

    classes = data.get("size_class")
    if not isinstance(classes, list) or not classes:
        raise _Invalid("needs at least one [[size_class]]")
    size_classes = tuple(_parse_size_class(sc, i, build) for i, sc in enumerate(classes))
    for a, b in zip(size_classes, size_classes[1:]):
        if b.max_params_b <= a.max_params_b:
            raise _Invalid(f"size classes must grow: '{b.name}' (max_params_b {b.max_params_b}) after '{a.name}'")

    sources = tuple(_parse_source(s, i) for i, s in enumerate(data.get("source") or []))
    cited = {f for s in sources for f in s.figures}
    needed = list(CITED_FIGURES) + (["build.cuda_architectures"] if build.backend == "cuda" else [])
    missing = [f for f in needed if f not in cited]
    if missing:
        raise _Invalid(f"no [[source]] cites {', '.join(missing)}")
    return Device(name=name, description=description, memory=memory, compute=compute, build=build,
                  size_classes=size_classes, sources=sources, path=path)


def _parse_build(b: dict) -> Build:
    backend = _get(b, "backend", str, "build.")
    if backend not in BACKENDS:
        raise _Invalid(f"build.backend must be one of {', '.join(BACKENDS)} (got '{backend}')")
    flags = _get(b, "cmake_flags", list, "build.")
    for flag in flags:
        if not isinstance(flag, str) or not _CMAKE_FLAG.match(flag):
            raise _Invalid(f"build.cmake_flags: {flag!r} is not a -DNAME=VALUE flag")
    given = {_CMAKE_FLAG.match(f).group(1): _CMAKE_FLAG.match(f).group(2) for f in flags}
    archs = _get(b, "cuda_architectures", str, "build.", required=backend == "cuda")
    if backend == "cuda":
        if not _CUDA_ARCHS.match(archs):
            raise _Invalid(f"build.cuda_architectures '{archs}' is not a CUDA architecture list like 89 or 87;89")
        # the flags document the full build; they must say what setup.sh will derive
        if given.get("LOCRET_CUDA") != "ON" or given.get("CMAKE_CUDA_ARCHITECTURES") != archs:
            raise _Invalid(f"build.cmake_flags must contain -DLOCRET_CUDA=ON and -DCMAKE_CUDA_ARCHITECTURES={archs}")
    else:
        if archs is not None:
            raise _Invalid("a cpu build has no build.cuda_architectures")
        if given.get("LOCRET_CUDA", "OFF") != "OFF" or "CMAKE_CUDA_ARCHITECTURES" in given:
            raise _Invalid("a cpu build must not turn CUDA on in build.cmake_flags")
    return Build(backend=backend, cuda_architectures=archs, cmake_flags=tuple(flags))


def _parse_size_class(sc, i: int, build: Build) -> SizeClass:
    if not isinstance(sc, dict):
        raise _Invalid(f"size_class[{i}] must be a table")
    where = f"size_class[{i}]."
    gpu_layers = sc.get("gpu_layers")
    if gpu_layers == "all":
        gpu_layers = -1
    elif isinstance(gpu_layers, bool) or not isinstance(gpu_layers, int) or gpu_layers < 0:
        raise _Invalid(f"{where}gpu_layers must be \"all\" or a number >= 0 (got {sc.get('gpu_layers')!r})")
    out = SizeClass(name=_get(sc, "name", str, where),
                    max_params_b=float(_get(sc, "max_params_b", (int, float), where)),
                    budget=_get(sc, "budget", int, where), ubatch=_get(sc, "ubatch", int, where),
                    stabilizers=_get(sc, "stabilizers", int, where), kv_type=_get(sc, "kv_type", str, where),
                    gpu_layers=gpu_layers)
    where = f"size class '{out.name}': "
    if out.max_params_b <= 0:
        raise _Invalid(f"{where}max_params_b must be > 0")
    if out.budget < 1 or out.ubatch < 1 or out.stabilizers < 0:
        raise _Invalid(f"{where}budget and ubatch must be >= 1, stabilizers >= 0")
    # the same rules the planner and llama.cpp apply to explicit settings
    if out.ubatch > out.budget:
        raise _Invalid(f"{where}ubatch ({out.ubatch}) above the budget ({out.budget})")
    if out.stabilizers >= out.budget or out.stabilizers > out.ubatch:
        raise _Invalid(f"{where}stabilizers ({out.stabilizers}) must be below the budget and fit in one ubatch")
    if out.kv_type not in KV_TYPES:
        raise _Invalid(f"{where}kv_type must be one of {', '.join(KV_TYPES)} (got '{out.kv_type}')")
    if build.backend == "cpu" and out.gpu_layers != 0:
        raise _Invalid(f"{where}a cpu device has no GPU layers (gpu_layers must be 0)")
    return out


def _parse_source(s, i: int) -> Source:
    if not isinstance(s, dict):
        raise _Invalid(f"source[{i}] must be a table")
    where = f"source[{i}]."
    figures = _get(s, "figures", list, where)
    if not figures or not all(isinstance(f, str) for f in figures):
        raise _Invalid(f"{where}figures must be a non-empty list of field names")
    url = _get(s, "url", str, where)
    # a vendor page, or for the local box a reading of this machine ("measured: <command>")
    if not re.match(r"^(https?://\S+|measured: .+)$", url):
        raise _Invalid(f"{where}url must be an http(s) address or 'measured: <how>' (got {url!r})")
    return Source(figures=tuple(figures), url=url, says=_get(s, "says", str, where))


def build_config_shell(dev: Device) -> str:
    """Bash assignments for scripts/setup.sh: CUDA_ARCH (empty for a CPU build) and DEVICE_CMAKE_FLAGS."""
    extra = " ".join(shlex.quote(f) for f in dev.build.extra_cmake_flags())
    return (f"CUDA_ARCH={shlex.quote(dev.build.cuda_architectures or '')}\n"
            f"DEVICE_CMAKE_FLAGS=({extra})\n")


def _main(argv: list[str]) -> int:
    usage = "usage: devices.py list | build-config DEVICE"
    try:
        if argv[:1] == ["list"] and len(argv) == 1:
            for name in known_devices():
                print(f"{name:24s} {load(name).description}")
            return 0
        if argv[:1] == ["build-config"] and len(argv) == 2:
            sys.stdout.write(build_config_shell(load(argv[1])))
            return 0
    except DeviceError as e:
        print(f"devices: error: {e}", file=sys.stderr)
        return 1
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
